"""A property of the engine: for random request streams every request gets the tokens it gets alone.

A stream is waves of requests added between run() calls: prompts of 1 token to past a page and past
max_batch_tokens (chunked prefills), 1 new token to the rest of max_seq_len (and one past it, which add() must
refuse), greedy and seeded sampling side by side, EOS ids taken from what the requests generate (so they stop
early), more requests than seats, few pages, and one run() interrupted by a KeyboardInterrupt at some call of
the model step or of a phase of a step, then resumed; in every mode, overlapped or step by step. The oracle is
the request alone through the plain step (`Alone`); each run()'s report must account for what ran.
"""

from __future__ import annotations

import math
import time

import attrs
import numpy as np
import pytest
import torch

from examples import engine, llama, sampling
from examples.request import RequestError
from fgraph.ops import attention as A
from tests.examples.test_engine_faults import PHASES, assert_consistent, build, inject
from tests.examples.test_generate import tiny  # noqa: F401 (the tiny model, a module fixture)

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

PAGE, MAX_SEQ_LEN = 4, 40
MAX_PAGES = math.ceil(MAX_SEQ_LEN / PAGE)
VOCAB = 1024  # the tiny preset's
MODES = ["eager", "NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]


class Alone:
    """The oracle: one request through the plain (unjitted) step, its whole prompt in one call, then one token a
    call, on a cache of its own with the engine's page size and block-table width (the same attention shapes).
    Greedy takes the argmax; sampling draws what the seed defines at each position (sampling.uniform). Memoised
    per (prompt, temperature, top_p, seed): the longest continuation asked for so far."""

    def __init__(self, cfg, params):
        self.params, self.step = params, llama.make_step(cfg, "torch", MAX_SEQ_LEN)
        self.cache = llama.init_cache(cfg, 1 + MAX_PAGES, PAGE, params.embed.dtype, "cpu")
        self.memo: dict = {}

    def __call__(self, prompt, n: int, temperature=0.0, top_p=1.0, seed=0) -> list[int]:
        key = (tuple(prompt), temperature, top_p, seed if temperature else None)
        if len(self.memo.get(key, ())) < n:
            self.memo[key] = self._generate(prompt, n, temperature, top_p, seed)
        return self.memo[key][:n]

    def _generate(self, prompt, n, temperature, top_p, seed) -> list[int]:
        out, fed, start = [], list(prompt), 0
        while len(out) < n:
            end = start + len(fed)
            meta = A.build_metadata([len(fed)], [end], [list(range(1, 1 + math.ceil(end / PAGE)))], PAGE, MAX_PAGES)
            batch = llama.Batch(torch.tensor(fed), torch.arange(start, end), meta)
            with torch.no_grad():
                logits, self.cache = self.step(self.params, self.cache, batch, "decode" if len(fed) == 1 else "mixed")
            u = sampling.uniform(seed, end) if temperature else 0.0  # (greedy: no seed, no draw)
            knobs = [torch.tensor([x], dtype=torch.float32) for x in (temperature, top_p, u)]
            out.append(int(sampling.sample(logits[-1:], *knobs)[0]))
            fed, start = out[-1:], end
        return out


@pytest.fixture(scope="module")
def alone(tiny):  # noqa: F811
    return Alone(*tiny)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny model's ops take microseconds, and handing them to a second thread on a
    loaded 2-core machine cost 10x (a 30-token reference 0.5 s instead of 0.05 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@attrs.frozen
class Req:
    n: int  # prompt length
    ids: int  # seeds the prompt's token ids (a short repr for hypothesis to print)
    new: int
    temperature: float
    top_p: float
    seed: int | None

    @property
    def prompt(self) -> list[int]:
        return torch.randint(0, VOCAB, (self.n,), generator=torch.Generator().manual_seed(self.ids)).tolist()

    def fits(self, num_pages: int) -> bool:
        """What add() must take: within max_seq_len and within the cache's pages (less the scratch page)."""
        fed = len(self.prompt) + self.new - 1  # the last token is never fed
        return fed <= MAX_SEQ_LEN and math.ceil(fed / PAGE) <= num_pages - 1


@st.composite
def requests(draw):
    n = draw(st.one_of(st.integers(1, PAGE), st.integers(PAGE + 1, 20), st.integers(1, MAX_SEQ_LEN)))
    rest = MAX_SEQ_LEN - n + 1  # the most new tokens that fit
    new = draw(st.one_of(st.integers(1, 4), st.integers(1, rest), st.sampled_from([rest, rest + 1])))
    return Req(
        n,
        draw(st.integers(0, 2**16)),
        new,
        draw(st.sampled_from([0.0, 0.0, 0.01, 0.7, 1.5])),
        draw(st.sampled_from([1.0, 0.9, 0.5])),
        draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
    )


CONFIGS = st.fixed_dictionaries(
    {
        "overlap": st.booleans(),
        "max_seqs": st.integers(1, 4),
        "max_batch_tokens": st.sampled_from([4, 6, 8]),
        "num_pages": st.integers(1 + 3, 1 + 2 * MAX_PAGES),  # 3 pages: room for one short request at a time
        "buckets": st.sampled_from([None, (1,), (3,), (2, 5)]),  # (with max_batch_tokens): more padding
        "capture": st.booleans(),  # every bucket of both routines up front, as on a GPU (jitted modes)
    }
)
# (the wave whose run() is interrupted, what raises, before or after its work, at which of its calls)
FAULTS = st.tuples(
    st.integers(0, 2),
    st.sampled_from(["step_fn", "model", *PHASES]),
    st.sampled_from(["before", "after"]),
    st.integers(1, 4),
)
EOS_AS = {"list": list, "numpy": np.array, "torch": torch.tensor}  # how eos_ids reach the engine


def want(alone, r, eos: frozenset) -> list[int]:
    """What request r must get: its tokens alone, up to and including the first EOS."""
    out = alone(r.prompt, r.max_new_tokens, r.temperature, r.top_p, r.seed)
    stop = next((i for i, t in enumerate(out) if t in eos), len(out) - 1)
    return out[: stop + 1]


class Runs:
    """run() on one engine, counting the model calls and checking each report against them and the clock."""

    def __init__(self, eng):
        self.eng, self.calls, self.handed, self.open = eng, 0, [], None
        real = eng.step_fn

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)

        eng.step_fn = counted

    def run(self, fault=None) -> bool:
        """run(), with `fault` (phase, before/after, at) injected if given. Whether it finished: if a fault
        interrupted it, the next run() resumes it, and the report of that one covers both (its steps are the
        model calls made, less the one undone if the model had run in the interrupted step)."""
        t0, calls0, steps0 = self.open or (time.perf_counter(), self.calls, self.eng.steps)
        restore = lambda: None
        if fault is not None:  # "model": a norm inside the model, so inside fgraph's trace on a signature's 1st call
            phase, when, at = fault
            obj, name = (llama, "rms_norm") if phase == "model" else (self.eng, phase)
            restore = inject(obj, name, KeyboardInterrupt(), when, at)
        try:
            rep = self.eng.run(progress=False)
        except KeyboardInterrupt:
            assert_consistent(self.eng)
            # undone means undone: a request whose tokens were all taken back has no first-token time
            assert all(r.t_first is None for r in [*self.eng.running, *self.eng.waiting] if not r.output)
            self.open = (t0, calls0, steps0)
            return False
        finally:
            restore()
        assert rep.steps == self.eng.steps - steps0 and 0 <= self.calls - calls0 - rep.steps <= bool(self.open)
        check_report(rep, time.perf_counter() - t0, self.eng.max_seqs)
        self.handed, self.open = self.handed + rep.requests, None
        return True


def check_report(rep, took: float, max_seqs: int) -> None:
    """A report's numbers say what ran: its requests in submission order with their tokens; every count and
    time within what that run() did (a request got at most one token a step; times within the call)."""
    ids = [r.id for r in rep.requests]
    assert ids == sorted(set(ids)) and rep.tokens == [r.output for r in rep.requests]
    assert rep.output_tokens == sum(map(len, rep.tokens)) <= rep.steps * max_seqs
    assert rep.prompt_tokens == sum(len(r.prompt) for r in rep.requests)
    assert all(len(t) <= rep.steps for t in rep.tokens), (rep.steps, [len(t) for t in rep.tokens])
    assert 0 < rep.elapsed <= took and 0 <= rep.waited <= rep.elapsed
    assert rep.throughput == rep.output_tokens / rep.elapsed and "TTFT" in rep.summary()
    for r, ttft, tpot in zip(rep.requests, rep.ttft, rep.tpot):
        assert r.t_arrive < r.t_first <= r.t_done and ttft == r.t_first - r.t_arrive
        assert (tpot is None) == (len(r.output) == 1) and (tpot is None or tpot >= 0)


def check_stream(tiny, alone, mode, config, waves, fault, eos_pick):  # noqa: F811
    # EOS: a token a request of the stream generates early (one whose seed is known before add()), so that it,
    # and maybe others, stop there
    known = [
        q for wave in waves for q in wave if q.fits(config["num_pages"]) and (q.temperature == 0 or q.seed is not None)
    ]
    eos, ids = frozenset(), []
    if eos_pick is not None and known:
        q = known[eos_pick[0] % len(known)]
        out = alone(q.prompt, q.new, q.temperature, q.top_p, q.seed)
        eos = frozenset([out[eos_pick[1] % len(out)]])
        ids = EOS_AS[eos_pick[2]](sorted(eos))  # as a tokenizer may hand them over
    eng = engine.build(
        *tiny, backend="torch", max_seq_len=MAX_SEQ_LEN, page_size=PAGE, eos_ids=ids, seed=3, mode=mode, **config
    )
    runs, added = Runs(eng), []
    for w, wave in enumerate(waves):
        for q in wave:
            if not q.fits(config["num_pages"]):
                n = eng.next_id
                with pytest.raises(RequestError, match=f"request {n}[: ]"):
                    eng.add(q.prompt, q.new, q.temperature, q.top_p, q.seed)
                assert eng.next_id == n and len(eng.waiting) == len([r for r in added if r in eng.waiting])
                continue
            added.append(eng.add(q.prompt, q.new, q.temperature, q.top_p, q.seed))
        if not runs.run(fault[1:] if fault[0] % len(waves) == w else None):
            if w < len(waves) - 1:
                continue  # interrupted: the next wave's requests are added before it resumes
            assert runs.run()
        assert not eng.busy() and not eng.finished and eng.staged is None
        assert sorted(eng.blocks.free) == list(range(1, eng.blocks.num_pages))
    assert [r.id for r in runs.handed] == [r.id for r in added]  # each handed back once, none lost
    for r in added:
        assert r.output == want(alone, r, eos), (r.id, r.prompt, r.max_new_tokens, r.temperature, r.seed)
        stop = "eos" if r.output[-1] in eos else "length"
        assert r.finish_reason == stop and (stop == "eos" or len(r.output) == r.max_new_tokens)


@pytest.mark.parametrize("mode", MODES)
def test_random_request_streams_give_each_request_its_tokens_alone(tiny, alone, mode):  # noqa: F811
    @hypothesis.seed(MODES.index(mode))  # streams of their own in each mode (one derandomized seed would repeat them)
    @hypothesis.settings(max_examples=10, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        CONFIGS,
        st.lists(st.lists(requests(), min_size=1, max_size=5), min_size=1, max_size=3),
        FAULTS,
        st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(0, 3), st.sampled_from(list(EOS_AS)))),
    )
    def prop(config, waves, fault, eos_pick):
        check_stream(tiny, alone, mode, config, waves, fault, eos_pick)

    prop()


# ------------------------------------------------------------------------------------------ what it found
def test_the_report_after_an_interrupted_run_covers_the_interrupted_runs_steps_and_time(tiny):  # noqa: F811
    """A run() interrupted at its 5th step hands back nothing; the run() that resumes it hands back the request,
    whose 6 tokens took 6 steps. Its report said 2 steps and the second run's time alone (3x the rate)."""
    eng = build(tiny, overlap=False)
    eng.add([1, 2, 3], max_new_tokens=6)
    real, slow = eng.step_fn, lambda *a, **k: time.sleep(0.02) or real(*a, **k)
    eng.step_fn = slow
    restore = inject(eng, "step_fn", KeyboardInterrupt(), "before", 5)
    with pytest.raises(KeyboardInterrupt):
        eng.run(progress=False)
    restore()
    eng.step_fn = real
    rep = eng.run(progress=False)
    assert rep.steps == eng.steps == 6 and rep.output_tokens == 6 and rep.elapsed >= 4 * 0.02
    assert eng.run(progress=False).steps == 0  # (reported once)


def test_an_undone_step_takes_back_the_time_of_the_first_token_it_gave(tiny):  # noqa: F811
    """A step interrupted after sampling (here: while staging the next batch) gives no token; the request kept
    the first-token time of the token taken back, so its TTFT was that of a token it never got."""
    eng = build(tiny, overlap=True)
    r = eng.add([1, 2, 3], max_new_tokens=4)
    restore = inject(eng, "_stage", KeyboardInterrupt(), "after", 2)  # the 1st step's staging of the 2nd
    with pytest.raises(KeyboardInterrupt):
        eng.run(progress=False)
    restore()
    assert r.output == [] and r.t_first is None
    t = time.perf_counter()
    assert eng.run(progress=False).ttft[0] >= t - r.t_arrive


@pytest.mark.parametrize("kind", list(EOS_AS))
def test_eos_ids_as_a_tokenizer_hands_them_over_stop_requests(tiny, alone, kind):  # noqa: F811
    """eos_ids as a torch tensor became a set of tensors, which no sampled int equals: EOS never stopped a
    request. They are read as ints now, and what is not ids is refused when the engine is made."""
    first, eos, _ = alone([11], 3, 1.0, 1.0, seed=5)  # (sampled: greedy repeats the prompt's last token here)
    assert first != eos
    eng = build(tiny, eos_ids=EOS_AS[kind]([eos]))
    assert eng.eos_ids == {eos} and all(type(t) is int for t in eng.eos_ids)
    eng.add([11], max_new_tokens=3, temperature=1.0, seed=5)
    rep = eng.run(progress=False)
    assert rep.tokens == [[first, eos]] and rep.requests[0].finish_reason == "eos"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(eos_ids=2), "eos_ids=2 is not a sequence of token ids"),
        (dict(eos_ids=[2.0]), r"eos_ids\[0\]=2.0 is not an integer"),
        (dict(eos_ids=[-1]), r"eos_ids\[0\]=-1 is out of range"),
        (dict(max_seqs=0, num_pages=9), r"max_seqs=0 is out of range \[1, inf\)"),
        (dict(max_batch_tokens=2.5), r"max_batch_tokens=2.5 is not an integer"),
    ],
)
def test_engine_options_that_would_fail_later_are_refused_when_it_is_made(tiny, kw, match):  # noqa: F811
    """max_seqs=0 admitted no request, and run() returned at once with every request still waiting."""
    with pytest.raises(RequestError, match=match):
        build(tiny, **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_pages=2.0), r"num_pages=2.0 is not an integer"),
        (dict(max_seqs=2.0), r"max_seqs=2.0 is not an integer"),
        (dict(page_size=2.5), r"page_size=2.5 is not an integer"),
        (dict(page_size=-4), r"page_size=-4 is out of range \[1, inf\)"),
        (dict(max_seq_len=None), r"max_seq_len=None is not an integer"),
    ],
)
def test_build_refuses_sizes_of_the_wrong_type_before_they_size_the_cache(tiny, kw, match):  # noqa: F811
    """They failed inside torch.zeros ("zeros() takes 1 positional argument but 4 were given"), or as a negative
    num_pages the caller never passed."""
    with pytest.raises(RequestError, match=match):
        build(tiny, **kw)
