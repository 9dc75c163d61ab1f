"""The engine under faults: a bad request is refused by add(); an exception or KeyboardInterrupt at any phase of a
step leaves it consistent (every page free or owned by a live request, no placeholder token in an output or a
batch) and run() again gives the tokens of a run never interrupted; a request's sampled tokens depend on its
prompt, parameters and seed only; 5,000 requests leave memory flat."""

import gc
import math
import tracemalloc

import attrs
import pytest
import torch

from examples import engine, generate, llama, sampling
from examples.request import PENDING, RequestError

PROMPTS = [
    [5, 17, 300, 2, 999, 41, 8, 8, 120, 77, 3, 64, 500, 1, 23, 45, 6, 7, 90],
    [11],
    [4, 4, 4, 4, 9],
    [1000, 3, 2, 1, 0, 12, 13],
    [7, 7],
]


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset, narrower and one layer deep: the same code paths at a third of the CPU time."""
    cfg = attrs.evolve(llama.preset("tiny"), dim=64, n_layers=1, head_dim=16, intermediate=128)
    return cfg, llama.init_params(cfg, torch.float32, "cpu", seed=0)


def build(tiny, **kw):
    kw = dict(dict(backend="torch", mode="eager", max_seqs=3, max_seq_len=64, page_size=4, max_batch_tokens=8), **kw)
    eng = engine.build(*tiny, **kw)
    run_batch = eng.run_batch

    def checked(batch, routine):  # no placeholder ever reaches the model
        assert PENDING not in batch.tokens.tolist()
        return run_batch(batch, routine)

    eng.run_batch = checked
    return eng


def submit(eng):
    """Greedy and sampled requests, each with its own seed."""
    for i, p in enumerate(PROMPTS):
        eng.add(p, max_new_tokens=7, temperature=0.9 if i % 2 else 0.0, top_p=0.8, seed=100 + i)


@pytest.fixture(scope="module")
def eos(tiny):
    """An EOS id that stops request 2 (greedy) at its third token: the runs below exercise the EOS path too."""
    eng = build(tiny)
    submit(eng)
    return [eng.run(progress=False).tokens[2][2]]


@pytest.fixture(scope="module")
def want(tiny, eos):
    """Tokens of the uninterrupted run, per overlap setting (both equal)."""
    out = {}
    for overlap in (True, False):
        eng = build(tiny, overlap=overlap, eos_ids=eos)
        submit(eng)
        out[overlap] = eng.run(progress=False).tokens
    assert out[True] == out[False] and len(out[True][2]) <= 3
    return out[True]


def assert_consistent(eng):
    """Every page is free or owned by exactly one running request; no output holds a placeholder; no step open."""
    owned = [p for r in eng.running for p in r.pages]
    assert sorted(owned + list(eng.blocks.free)) == list(range(1, eng.blocks.num_pages))
    assert all(not r.pages for r in eng.waiting) and eng._undo is None
    assert all(PENDING not in r.output for r in [*eng.waiting, *eng.running, *eng.finished])


# ------------------------------------------------------------------------------------------------ add()
BAD = {
    "temperature nan": dict(temperature=float("nan")),
    "temperature inf": dict(temperature=float("inf")),
    "temperature -1": dict(temperature=-1.0),
    "temperature 'hot'": dict(temperature="hot"),
    "temperature True": dict(temperature=True),
    "top_p -1": dict(top_p=-1),
    "top_p 0": dict(top_p=0.0),
    "top_p 1.5": dict(top_p=1.5),
    "top_p nan": dict(top_p=float("nan")),
    "max_new_tokens 2.5": dict(max_new_tokens=2.5),
    "max_new_tokens 0": dict(max_new_tokens=0),
    "max_new_tokens '3'": dict(max_new_tokens="3"),
    "seed -1": dict(seed=-1),
    "seed 2**64": dict(seed=2**64),
    "seed 1.5": dict(seed=1.5),
    "prompt empty": dict(prompt=[]),
    "prompt a string": dict(prompt="hello"),
    "prompt None": dict(prompt=None),
    "prompt of floats": dict(prompt=[1.5, 2.0]),
    "prompt id -1 (the placeholder)": dict(prompt=[3, -1]),
    "prompt id past the vocabulary": dict(prompt=[1024]),
    "longer than max_seq_len": dict(prompt=[1] * 60, max_new_tokens=10),
    "larger than the whole cache": dict(prompt=[1] * 30, max_new_tokens=10),
}


@pytest.fixture(scope="module")
def small(tiny):
    """An engine of 8 KV pages of 4 tokens and max_seq_len 64."""
    return build(tiny, num_pages=1 + 8)


@pytest.mark.parametrize("case", list(BAD))
def test_add_refuses_a_bad_request_and_changes_nothing(small, case):
    args = dict(dict(prompt=[1, 2, 3], max_new_tokens=4), **BAD[case])
    n = small.next_id
    with pytest.raises(RequestError, match=f"request {n}[: ]"):
        small.add(args.pop("prompt"), **args)
    assert not small.busy() and small.next_id == n


def test_an_engine_built_directly_checks_prompts_against_its_vocabulary(tiny):
    """vocab_size is required: without it an id past the embedding got in, failed every step that batched it, and
    kept the other requests from finishing."""
    cfg = llama.preset("tiny")
    cache = llama.init_cache(cfg, 1 + 8, 4, torch.float32, "cpu")
    kw = dict(max_seq_len=8, mode="eager", max_batch_tokens=8, max_seqs=2)
    with pytest.raises(TypeError, match="vocab_size"):
        engine.Engine(stub, {"w": torch.zeros(V)}, cache, **kw)
    eng = engine.Engine(stub, {"w": torch.zeros(V)}, cache, vocab_size=V, **kw)
    with pytest.raises(RequestError, match=rf"prompt\[0\]={V} is out of range \[0, {V}\)"):
        eng.add([V], max_new_tokens=2)
    eng.add([1, 2], max_new_tokens=2)
    assert [len(t) for t in eng.run(progress=False).tokens] == [2]


def test_add_takes_numpy_and_torch_integers(small):
    small.add(torch.tensor([1, 2, 3]), max_new_tokens=torch.tensor(2), temperature=0.5, top_p=0.9, seed=torch.tensor(3))
    assert [len(t) for t in small.run(progress=False).tokens] == [2]


# ------------------------------------------------------------------------------------------------ faults
def inject(eng, phase: str, exc: BaseException, when: str, at: int):
    """Make the `at`-th call of eng.<phase> raise `exc`, before or after doing its work."""
    real, calls = getattr(eng, phase), [0]

    def faulty(*a, **k):
        calls[0] += 1
        if calls[0] == at and when == "before":
            raise exc
        out = real(*a, **k)
        if calls[0] == at:
            raise exc
        return out

    setattr(eng, phase, faulty)
    return lambda: setattr(eng, phase, real)


PHASES = ["schedule", "make_batch", "run_batch", "_account", "choose", "_settle", "_stage"]
# After each phase (and before the model step: it never ran), a Ctrl-C; an error of the model step and of sampling;
# the same in the one-step-at-a-time loop.
FAULTS = (
    [(p, "after", KeyboardInterrupt(), True) for p in PHASES]
    + [("run_batch", "before", KeyboardInterrupt(), True)]
    + [("run_batch", w, RuntimeError("injected"), True) for w in ("before", "after")]
    + [("choose", "before", RuntimeError("injected"), True)]
    + [(p, "after", KeyboardInterrupt(), False) for p in ("run_batch", "choose", "_settle")]
)


@pytest.mark.parametrize(
    "phase, when, exc, overlap",
    FAULTS,
    ids=[f"{p}-{w}-{type(e).__name__}-{'overlapped' if o else 'stepwise'}" for p, w, e, o in FAULTS],
)
def test_a_fault_at_any_phase_of_a_step_is_undone_and_the_run_resumes_to_the_same_tokens(
    tiny, eos, want, phase, when, exc, overlap
):
    eng = build(tiny, overlap=overlap, eos_ids=eos)
    submit(eng)
    restore = inject(eng, phase, exc, when, at=4)
    with pytest.raises(type(exc)):
        eng.run(progress=False)
    assert_consistent(eng)
    assert eng.busy()
    restore()
    rep = eng.run(progress=False)  # resumes: the report holds every request (none was handed back)
    assert rep.tokens == want
    assert_consistent(eng)
    assert not eng.busy() and not eng.finished and len(eng.blocks.free) == eng.blocks.num_pages - 1


def test_repeated_faults_then_new_requests(tiny, eos, want):
    """A model step failing every third call: each run() gets a little further, the engine stays consistent, and
    requests added between the failures are served too."""
    eng = build(tiny, eos_ids=eos)
    submit(eng)
    for k in range(60):
        restore = inject(eng, "run_batch", RuntimeError("flaky device"), "before", at=3)
        try:
            rep = eng.run(progress=False)
            break
        except RuntimeError:
            assert_consistent(eng)
        finally:
            restore()
        if k == 2:
            eng.add([9, 9, 9], max_new_tokens=3)
    assert rep.tokens[:5] == want and len(rep.tokens) == 6 and rep.requests[5].finish_reason in ("eos", "length")


def test_finished_requests_are_handed_back_and_released(tiny):
    eng = build(tiny)
    r = eng.add([1, 2], max_new_tokens=3)
    assert eng.step() == [] and eng.step() == []  # still running
    rep = eng.run(progress=False)
    assert rep.requests == [r] and r.finish_reason == "length" and not eng.finished and not eng.busy()


# ------------------------------------------------------------------------------------------------ seeds
def sampled(tiny, prompts, max_seqs, **kw):
    eng = build(tiny, max_seqs=max_seqs, max_batch_tokens=max(8, max_seqs), **kw)
    for i, p in enumerate(prompts):
        eng.add(p, max_new_tokens=8, temperature=1.0, top_p=0.95, seed=7 if p is PROMPTS[2] else i)
    return eng.run(progress=False).tokens


def test_a_requests_sampled_tokens_depend_on_its_seed_not_on_its_batch(tiny):
    alone = sampled(tiny, [PROMPTS[2]], max_seqs=1)[0]
    assert sampled(tiny, PROMPTS, max_seqs=4)[2] == alone  # in a batch of others
    assert sampled(tiny, PROMPTS[::-1], max_seqs=2)[2] == alone  # other neighbours, other order
    assert sampled(tiny, PROMPTS, max_seqs=4, overlap=False)[2] == alone
    eng = build(tiny)
    eng.add(PROMPTS[2], max_new_tokens=8, temperature=1.0, top_p=0.95, seed=8)
    assert eng.run(progress=False).tokens[0] != alone  # another seed, other tokens


def test_the_command_line_samples_a_prompt_the_same_alone_in_a_batch_and_with_max_seqs_1():
    base = ["--json", "--no-progress", "--mode", "eager", "--max-new-tokens", "6", "--seed", "3"]
    prompts = ["--prompt-ids", "4,4,4,4,9", "--prompt-ids", "1000,3,2", "--prompt-ids", "11"]
    batch = generate.main(base + prompts)["tokens"]
    assert generate.main(base + prompts + ["--max-seqs", "1"])["tokens"] == batch
    assert generate.main(base + prompts[2:4])["tokens"] == [batch[1]]


def test_sample_draws_from_the_nucleus_in_proportion():
    """The inverse CDF at evenly spread uniforms: each kept token is drawn in proportion to its renormalised
    probability, the rest never."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 1000
    u = (torch.arange(n) + 0.5) / n
    logits = p.log().expand(n, 4)
    got = sampling.sample(logits, torch.ones(n), torch.full((n,), 0.7), u)  # nucleus: 0.5, 0.3 (0.5 + 0.3 > 0.7)
    counts = torch.bincount(got, minlength=4).tolist()
    assert counts[2:] == [0, 0] and abs(counts[0] - n * 0.5 / 0.8) <= 2 and abs(counts[1] - n * 0.3 / 0.8) <= 2


# ------------------------------------------------------------------------------------------------ soak
V = 64


def stub(params, cache, batch, routine):
    """A pure step of almost no work: logits [N, V] from the tokens and positions, the cache untouched."""
    return torch.nn.functional.one_hot((batch.tokens * 7 + batch.positions) % V, V).float() + params["w"], cache


def test_soak_5000_tiny_requests_leave_memory_flat():
    """5,000 requests of 1-2 tokens each way, in 50 waves of 100 (the model stubbed): after a warm-up of 10 waves
    the Python heap and the object count stay flat, every page comes back, the engine holds no request."""
    cfg = llama.preset("tiny")
    cache = llama.init_cache(cfg, 1 + 32, 4, torch.float32, "cpu")
    eng = engine.Engine(
        stub,
        {"w": torch.zeros(V)},
        cache,
        max_seq_len=8,
        mode="eager",
        max_batch_tokens=64,
        max_seqs=32,
        vocab_size=V,
    )
    g = torch.Generator().manual_seed(0)
    tracemalloc.start()
    try:
        served = 0
        for wave in range(50):
            if wave == 10:
                gc.collect()
                heap0, objects0 = tracemalloc.get_traced_memory()[0], len(gc.get_objects())
            for i in range(100):
                n = 1 + int(torch.randint(0, 2, (1,), generator=g))
                eng.add(
                    torch.randint(0, V, (n,), generator=g).tolist(), max_new_tokens=1 + i % 2, temperature=i % 3 / 2
                )
            rep = eng.run(progress=False)
            served += len(rep.tokens)
            assert [len(t) for t in rep.tokens] == [1 + i % 2 for i in range(100)]
        gc.collect()
        heap, objects = tracemalloc.get_traced_memory()[0], len(gc.get_objects())
    finally:
        tracemalloc.stop()
    assert served == 5000 and not eng.busy() and not eng.finished and eng.staged is None
    assert len(eng.blocks.free) == 32
    assert heap - heap0 < 64 * 1024, (heap0, heap)  # a leak of one small object per request would be ~0.5 MB
    assert objects - objects0 < 500, (objects0, objects)
    assert math.isfinite(rep.throughput)


def test_the_engine_resolves_auto_for_metadata_padded_to_its_buckets(tiny, monkeypatch):
    """Its step declares the metadata batched, so "auto" may pick FlashInfer's mixed kernel (capturable only then)."""
    asked = []
    resolve = engine.A.resolve_backend

    def spy(*args, **kw):
        asked.append(kw.get("padded_metadata"))
        return resolve(*args, **kw)

    monkeypatch.setattr(engine.A, "resolve_backend", spy)
    build(tiny, backend="auto")
    assert asked == [True]
