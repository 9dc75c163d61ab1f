"""The example engine and CLI on CPU: greedy tokens identical across capture modes, continuous batching
(chunked prefills mixed with decodes, routine choice, page release), sampling with a seed, EOS, the CLI."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from examples import engine, generate, llama, request, sampling

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [
    [5, 17, 300, 2, 999, 41, 8, 8, 120, 77, 3, 64, 500, 1, 23, 45, 6, 7, 90],
    [11],
    [4, 4, 4, 4, 9],
    [1000, 3, 2, 1, 0, 12, 13],
]


@pytest.fixture(scope="module")
def tiny():
    cfg = llama.preset("tiny")
    return cfg, llama.init_params(cfg, torch.float32, "cpu", seed=0)


def run(tiny, mode, prompts=PROMPTS, new=10, temperature=0.0, **kw):
    cfg, params = tiny
    kw = dict(dict(backend="torch", max_seqs=4, max_seq_len=64, page_size=4, max_batch_tokens=8), **kw)
    eng = engine.build(cfg, params, **kw) if mode is None else engine.build(cfg, params, mode=mode, **kw)
    for p in prompts:
        eng.add(p, max_new_tokens=new, temperature=temperature)
    return eng, eng.run(progress=False)


@pytest.fixture(scope="module")
def eager(tiny):
    """The oracle: greedy tokens of the plain step function (no fgraph.jit), 10 per prompt."""
    return run(tiny, "eager")[1].tokens


def test_greedy_tokens_identical_across_modes(tiny, eager):
    assert [len(t) for t in eager] == [10] * 4
    for mode in ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
        eng, got = run(tiny, mode, buckets=(2, 8))  # two buckets: padding exercised, few signatures to trace
        assert got.tokens == eager, mode
        total = eng.step_fn.stats()["total"]
        routines = {dict(e.sig.statics)["routine"] for e in eng.step_fn.entries.values()}
        assert total["calls"] == got.steps and total["traces"] == len(routines)  # buckets 2 and 8 share a trace
        if mode != "NONE":
            assert total["replays"] > 0, mode  # later steps of a bucket replay the (host stand-in) graphs


def test_the_engine_runs_every_step_as_one_graph_by_default(tiny, eager):
    """Without a mode, decode and mixed steps are each one graph (FULL: served faster than FULL_AND_PIECEWISE with
    every attention backend, docs/performance.md), with eager's tokens."""
    eng, got = run(tiny, None, buckets=(2, 8))
    assert got.tokens == eager
    modes = {(dict(e.sig.statics)["routine"], e.mode.name) for e in eng.step_fn.entries.values()}
    assert modes == {("decode", "FULL"), ("mixed", "FULL")}, modes


@pytest.mark.parametrize("in_graph", [True, False], ids=["copied-by-the-graphs", "copied-by-each-call"])
def test_greedy_tokens_identical_with_inputs_copied_by_the_graphs_or_the_calls(in_graph, tiny, eager, monkeypatch):
    """fgraph.config.inputs_in_graph (the default: FULL graphs copy their batched inputs in themselves), on or off:
    the same tokens."""
    import fgraph

    monkeypatch.setattr(fgraph.config, "inputs_in_graph", in_graph)
    eng, got = run(tiny, "FULL_AND_PIECEWISE", buckets=(2, 8))
    assert got.tokens == eager
    full = [e for e in eng.step_fn.entries.values() if e.full is not None]
    assert full and all((e.buffers.graph_mirror is not None) == in_graph for e in full)


def test_captured_up_front_bucket_one_shares_the_routines_trace_in_the_models(tiny, eager):
    """Capturing every bucket up front (largest first, as on the GPU): bucket 1 reuses each routine's symbolic trace
    (2 traces for 2 routines, 6 signatures). It can because nothing in the models asks whether N == 1: attention()
    passes k/v on as the strided views of the fused qkv they are, where a `.contiguous()` would record that guard
    (and gave bucket 1 a trace of its own: 4 traces) -- test_jit's `asks-n-equals-1` case."""
    eng, got = run(tiny, "FULL_AND_PIECEWISE", buckets=(1, 2, 8), capture=True)
    assert got.tokens == eager
    assert eng.step_fn.stats()["total"]["traces"] == 2 and len(eng.step_fn.entries) == 6


def test_captured_up_front_decode_stops_at_max_seqs_bucket(tiny):
    """A decode step has one token per running request, at most max_seqs: capture() takes decode up to max_seqs's
    bucket (2 here: buckets 1 and 2) and mixed at every bucket (1, 2, 8), and the run never meets a decode signature
    it did not capture (no fallback), with eager's tokens."""
    kw = dict(buckets=(1, 2, 8), max_seqs=2)
    eager = run(tiny, "eager", **kw)[1].tokens
    eng, got = run(tiny, "FULL_AND_PIECEWISE", capture=True, **kw)
    assert got.tokens == eager
    captured = {(dict(e.sig.statics)["routine"], e.sig.bucket) for e in eng.step_fn.entries.values()}
    assert captured == {("decode", 1), ("decode", 2), ("mixed", 1), ("mixed", 2), ("mixed", 8)}
    assert not any(eng.step_fn.stats()["fallbacks"].values())


def test_continuous_batching_schedule(tiny):
    """A step mixes decodes with a prompt chunk; pure-decode steps use routine="decode"; pages come back."""
    cfg, params = tiny
    eng = engine.build(
        cfg, params, backend="torch", mode="eager", max_seqs=4, max_seq_len=64, page_size=4, max_batch_tokens=8
    )
    seen, run_batch = [], eng.run_batch
    eng.run_batch = lambda batch, routine: seen.append((routine, batch.tokens.shape[0])) or run_batch(batch, routine)
    for p in PROMPTS:
        eng.add(p, max_new_tokens=6)
    free0 = len(eng.blocks.free)
    report = eng.run(progress=False)
    assert all(n <= 8 for _, n in seen)
    assert seen[0] == ("mixed", 8)  # the first 8 tokens of the 19-token prompt: a chunk
    assert ("mixed", 8) in seen[1:3] and ("decode", 4) in seen and ("decode", 1) in seen
    assert all((r == "decode") == (n <= 4) for r, n in seen if r == "decode")
    assert len(eng.blocks.free) == free0 and not eng.running and not eng.waiting
    assert report.steps == len(seen) and report.output_tokens == 24 and all(t is not None for t in report.tpot)
    assert "TTFT" in report.summary() and report.throughput > 0


@pytest.mark.parametrize(
    "chunks, rows",
    [
        ([1, 1, 1], [0, 1, 2]),  # decodes alone: a prefix of the rows
        ([1, 1, 3], [0, 1]),  # decodes + a prompt chunk mid-prompt
        ([1, 1, 5], [0, 1, 6]),  # decodes + the end of a prompt
        ([1, 5, 3], [0, 5]),
    ],
)  # the end of a prompt, then a chunk
def test_advance_samples_the_last_row_of_each_request_that_caught_up(tiny, chunks, rows):
    """A step's logits hold every scheduled token's row, requests back to back: a request is sampled from the row of
    its last token once it has caught up (a decode, or the last chunk of its prompt), not mid-prompt."""
    cfg, params = tiny
    eng = engine.build(
        cfg, params, backend="torch", mode="eager", max_seqs=4, max_seq_len=64, page_size=4, max_batch_tokens=16
    )
    plan = []
    for n in chunks:  # a decode (n=1): one output token so far; a chunk: the first (or last) n of a 5-token prompt
        r = eng.add([1] * (1 if n == 1 else 5), max_new_tokens=8)
        if n == 1:
            r.output, r.computed = [2], 1
        plan.append((r, n))
    logits = torch.eye(sum(chunks), 40)  # row i picks token i
    before = [len(r.output) for r, _ in plan]
    eng.advance(plan, logits)
    assert [r.output[-1] for (r, _), b in zip(plan, before) if len(r.output) > b] == rows


def test_queue_longer_than_max_seqs(tiny, eager):
    """More requests than seats (max_seqs=2) and pages (just enough for 2): the rest wait, nothing is lost."""
    cfg, params = tiny
    eng = engine.build(
        cfg,
        params,
        backend="torch",
        mode="eager",
        max_seqs=2,
        max_seq_len=32,
        page_size=4,
        max_batch_tokens=8,
        num_pages=1 + 2 * 8,
    )
    for p in PROMPTS:
        eng.add(p, max_new_tokens=10)
    assert eng.run(progress=False).tokens == eager


def test_eos_stops_and_sampling_is_seeded(tiny, eager):
    eos = eager[1][0]  # the first token request 1 generates
    eng, rep = run(tiny, "eager", new=4, eos_ids=[eos])
    assert rep.tokens[1] == [eos] and rep.requests[1].finish_reason == "eos"
    assert all(r.finish_reason in ("eos", "length") for r in rep.requests) and not eng.running
    a, b, c = (run(tiny, "eager", new=6, temperature=1.0, seed=s)[1].tokens for s in (3, 3, 4))
    assert a == b and a != c and a != [t[:6] for t in eager]
    assert all(0 <= t < 1024 for ts in a for t in ts)


@pytest.mark.parametrize("mode", ["eager", "FULL_AND_PIECEWISE"])
def test_overlapped_run_builds_the_batches_of_the_stepwise_run(tiny, mode):
    """Engine.run_overlapped builds step n+1's batch while step n runs, before its tokens are known (PENDING, then
    filled in). Without EOS every batch equals the one-step-at-a-time loop's, so tokens (greedy and seeded
    sampling) and step counts are equal, and no batch is built twice."""

    def batches(overlap, **kw):
        eng = engine.build(
            tiny[0],
            tiny[1],
            backend="torch",
            mode=mode,
            max_seqs=3,
            max_seq_len=64,
            page_size=4,
            max_batch_tokens=8,
            buckets=(2, 8),
            overlap=overlap,
            **kw,
        )
        seen, run_batch = [], eng.run_batch
        eng.run_batch = lambda b, routine: (
            seen.append((routine, b.tokens.tolist(), b.positions.tolist())) or run_batch(b, routine)
        )
        for p in PROMPTS:
            eng.add(p, max_new_tokens=7, temperature=kw.pop("temperature", 0.0))
        rep = eng.run(progress=False)
        assert not eng.running and len(eng.blocks.free) == eng.cache.k[0].shape[0] - 1  # every page back
        return rep, seen

    for kw in ({}, {"seed": 5}):
        (want, want_seen), (got, got_seen) = (batches(o, **kw) for o in (False, True))
        assert got.tokens == want.tokens and got.steps == want.steps == len(got_seen)
        assert got_seen == want_seen and all(request.PENDING not in t for _, t, _ in got_seen)
        assert [len(t) for t in got.tokens] == [7] * len(PROMPTS)


def test_overlapped_run_drops_a_request_that_stopped_at_eos_from_the_next_batch(tiny, eager):
    """A request that samples EOS at step n already had a row in step n+1's batch: that batch is built again
    without it. Same tokens as the one-step-at-a-time loop; the stop takes effect at once."""
    eos = eager[1][0]  # request 1 (a 1-token prompt) stops at its first token; the others never sample it
    assert all(eos not in ts for j, ts in enumerate(eager) if j != 1)
    out = {}
    for overlap in (False, True):
        cfg, params = tiny
        eng = engine.build(
            cfg,
            params,
            backend="torch",
            mode="eager",
            max_seqs=4,
            max_seq_len=64,
            page_size=4,
            max_batch_tokens=8,
            eos_ids=[eos],
            overlap=overlap,
        )
        built, make_batch = [], eng.make_batch
        eng.make_batch = lambda plan, **kw: built.append([r.id for r, _ in plan]) or make_batch(plan, **kw)
        for p in PROMPTS:
            eng.add(p, max_new_tokens=10)
        rep = eng.run(progress=False)
        out[overlap] = rep.tokens
        assert rep.tokens[1] == [eos] and rep.requests[1].finish_reason == "eos"
        assert not eng.running and len(eng.blocks.free) == eng.cache.k[0].shape[0] - 1
        # overlapped: the batch built while request 1 sampled EOS held it, and was built again without it
        rebuilt = [(a, b) for a, b in zip(built, built[1:]) if 1 in a and 1 not in b and set(b) <= set(a)]
        assert len(built) == rep.steps + overlap and (len(rebuilt) == 1 if overlap else True)
    assert out[True] == out[False] == [eager[0], [eos], eager[2], eager[3]]


def test_the_report_counts_the_host_waiting_for_the_device(tiny):
    """Report.waited: the time the host spent getting the sampled tokens (where it waits for the device), which
    says whether the device or the host loop sets the pace. Here sampling takes 5 ms (a stand-in for a busy
    device): at least that much per sampling, and no more than the run took."""
    eng = engine.build(tiny[0], tiny[1], backend="torch", mode="eager", max_seqs=4, max_seq_len=64, page_size=4)
    choose, calls = eng.choose, []
    eng.choose = lambda logits, ready: calls.append(time.sleep(0.005)) or choose(logits, ready)
    for p in PROMPTS:
        eng.add(p, max_new_tokens=3)
    rep = eng.run(progress=False)
    assert len(calls) * 0.005 <= rep.waited <= rep.elapsed and len(calls) >= 3
    assert "host waiting for the device" in rep.summary()


def test_sample_top_p():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0], [1.0, 0.0, 0.0, 0.0]])
    for u in torch.linspace(0, 0.999, 20):  # top_p 0.5 keeps only the best token of row 0; row 1 is greedy
        t = sampling.sample(logits, torch.tensor([1.0, 0.0]), torch.tensor([0.5, 1.0]), torch.tensor([u, u]))
        assert t.tolist() == [1, 0]


def test_request_errors(tiny):
    cfg, params = tiny
    eng = engine.build(cfg, params, backend="torch", mode="eager", max_seqs=2, max_seq_len=16, page_size=4)
    with pytest.raises(Exception, match="exceed max_seq_len"):
        eng.add(list(range(10)), max_new_tokens=10)
    with pytest.raises(Exception, match=r"prompt\[0\]=5000 is out of range \[0, 1024\)"):
        eng.add([5000], max_new_tokens=1)
    with pytest.raises(Exception, match="empty prompt"):
        eng.add([], max_new_tokens=1)


def test_cli_json(capsys):
    out = generate.main(
        [
            "--json",
            "--greedy",
            "--max-new-tokens",
            "5",
            "--prompt-ids",
            "1,2,3",
            "--prompt-ids",
            "7",
            "--no-progress",
            "--mode",
            "PIECEWISE",
        ]
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens"] == out["tokens"] and [len(t) for t in printed["tokens"]] == [5, 5]
    eager = generate.main(
        [
            "--json",
            "--greedy",
            "--max-new-tokens",
            "5",
            "--prompt-ids",
            "1,2,3",
            "--prompt-ids",
            "7",
            "--no-progress",
            "--mode",
            "eager",
        ]
    )
    assert eager["tokens"] == out["tokens"]


def test_cli_text_prompt_with_tokenizer(tmp_path, capsys):
    """--model DIR with a tokenizer.json: --prompt TEXT is encoded, the output decoded."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tests.examples.test_models import make_hf

    make_hf("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True), str(tmp_path))
    words = ["<unk>", "the", "capital", "of", "france", "is"] + [f"w{i}" for i in range(122)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    out = generate.main(
        [
            "--model",
            str(tmp_path),
            "--prompt",
            "the capital of france is",
            "--greedy",
            "--json",
            "--max-new-tokens",
            "4",
            "--no-progress",
            "--mode",
            "NONE",
        ]
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out["tokens"] == [want[0, 5:].tolist()]
    assert out["text"] == [tok.decode(out["tokens"][0])] and json.loads(capsys.readouterr().out)["text"]


def test_cli_explain(capsys):
    generate.main(["--explain", "--max-new-tokens", "2", "--prompt-ids", "1,2", "--no-progress"])
    text = capsys.readouterr().out
    assert "attention" in text and "decode" in text and "mixed" in text


def test_readme_command_runs_fresh():
    """`python -m examples.generate --json` on a fresh process: the embedded tiny model, end to end."""
    r = subprocess.run(
        [sys.executable, "-m", "examples.generate", "--json", "--max-new-tokens", "3", "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert [len(t) for t in out["tokens"]] == [3] * 4 and out["model"] == "tiny"


def test_compile_flag_reaches_the_jitted_step(tiny, eager):
    """`--compile` / Engine(compile=True) serves Inductor-compiled pieces (FULL+C); with mode NONE nothing is
    captured or compiled, so the tokens are eager's (the compiled path's tokens: tests/examples/test_models_gpu.py)."""
    eng, report = run(tiny, "NONE", compile=True)
    assert eng.step_fn.options.compile == {} and report.tokens == eager
    assert generate.parse_args(["--compile"]).compile and not generate.parse_args([]).compile


def test_the_cli_captures_on_first_use_or_with_capture_all_up_front(monkeypatch, capsys):
    """A short run meets few of the buckets: the CLI asks the engine for no capture up front (the engine's default on
    CUDA), so 3 prompts of 16 tokens capture one mixed step's signature and one of decodes; --capture-all captures
    every bucket a step can be padded to first, as a server does."""
    seen, build = {}, generate.build_engine
    monkeypatch.setattr(generate, "build_engine", lambda *a, **kw: seen.update(kw) or build(*a, **kw))
    argv = ["--num-prompts", "3", "--max-new-tokens", "4", "--no-progress", "--greedy"]
    phases = generate.main(argv)["phases_s"]  # where the start went, in seconds since the process started
    err = capsys.readouterr().err
    assert seen["capture"] is False
    assert "fgraph: captured 2 graphs for 2 signatures of the step on first use, 2 traces" in err
    assert list(phases) == ["imports", "model", "engine", "first token", "done"]
    assert 0 < phases["imports"] <= phases["model"] <= phases["engine"] <= phases["first token"] <= phases["done"]
    assert f"start-up, since the process started: imports {phases['imports']:.1f} s" in err
    generate.main([*argv, "--capture-all"])  # as a server, up front: mixed at 9 buckets up to 48, decode up to 4
    err = capsys.readouterr().err
    assert seen["capture"] is True and "first use" not in err
    assert "captured 9 graphs for 9 signatures of step" in err and "captured 3 graphs for 3 signatures of step" in err
