"""fgraph::linear's kernels at work (tests/kernels/test_linear.py has its rewrites): every config against the float32
product as close as cuBLAS, the tuned choice replayed in CUDA graphs, split-K sums in order, a new key's candidates
compiled side by side with no memory kept, and compiled CUDA steps that call the ops and equal eager."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import fgraph
from fgraph import kernels
from fgraph.compile import compiler
from fgraph.kernels import _gemv, _rowwise, _workers
from tests.compile.test_sdpa import rewriting_on_cpu as sdpa_rewriting_on_cpu
from tests.kernels.linear_cases import (
    GLU_SHAPES,
    GPU_SHAPES,
    GROUP_SHAPES,
    bf16,
    err,
    gated,
    gated_inputs,
    glus,
    grouped_inputs,
    hf_mlp,
    mlp,
    rand,
    rewriting_on_cpu,
    rewritten,
)


def test_what_fgraph_linear_glu_of_two_weights_cannot_serve_stays_as_traced():
    x, wg, wu, wd = rand(2, 8), rand(12, 8, seed=1), rand(12, 8, seed=2), rand(8, 12, seed=3)

    def gate_read_twice(x, wg, wu):
        g = F.linear(x, wg)
        return F.silu(g) * F.linear(x, wu), g

    cases = {
        "the gate read elsewhere too": (gate_read_twice, (x, wg, wu)),
        "other rows": (lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x + 1, wu), (x, wg, wu)),
        "weights of two shapes": (lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu), (x, wg, wu[:1])),
        "another activation": (lambda x, wg, wu: F.gelu(F.linear(x, wg)) * F.linear(x, wu), (x, wg, wu)),
        "a bias": (lambda x, wg, wu: F.silu(F.linear(x, wg, wg[:, 0])) * F.linear(x, wu), (x, wg, wu)),
        "float32": (lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu), (x.float(), wg.float(), wu.float())),
        "more rows than the kernel takes": (hf_mlp, (rand(32, 8), wg, wu, wd)),
    }
    for why, (fn, a) in cases.items():
        gm, other, _ = rewritten(fn, a)
        assert glus(other) == 0, why
        for want, got in zip(pytree.tree_leaves(gm(*a)), pytree.tree_leaves(other(*a))):
            assert torch.equal(want, got), why


@pytest.mark.parametrize("on", [True, False])
def test_compiled_pieces_call_fgraph_linear_glu_when_its_switch_is_on_and_equal_eager(on, tmp_path, monkeypatch):
    from examples.layers import gated_mlp

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "small_m_glu", on)
    params = {"w13": rand(96, 16, seed=1), "w2": rand(16, 48, seed=3)}
    mlp_ = lambda params, x: gated_mlp(x, params["w13"], params["w2"])  # noqa: E731 (its own jit state)
    with rewriting_on_cpu(monkeypatch):
        before = dict(compiler.counts)
        f = fgraph.jit(mlp_, batch={"x": fgraph.Batched()}, buckets=[1, 4], compile=True)
        for m in (1, 3, 4):  # 3: padded into bucket 4
            x = rand(m, 16, seed=10 + m)
            want = mlp_(params, x)
            # (off, Inductor's fused activation rounds once where eager rounds silu's result first)
            torch.testing.assert_close(f(params, x), want, atol=2e-2 * want.abs().max().item(), rtol=0)
    assert compiler.counts["linear"] - before["linear"] == 2 * 2  # gate_up (with or without its activation), down
    assert compiler.counts["glu"] - before["glu"] == (2 if on else 0)
    said = str(fgraph.explain(f))  # each compiled piece names fgraph's kernels in it
    assert ("fgraph kernels: fgraph::linear x1, fgraph::linear_glu x1" in said) == on
    assert ("fgraph kernels: fgraph::linear x2" in said) == (not on)


@pytest.mark.interpreter
def test_every_glu_config_and_the_activation_kernel_compute_the_unfused_result_in_the_interpreter():
    for m, (n, k) in [(1, (20, 40)), (3, (64, 96)), (5, (33, 513)), (16, (64, 96))]:
        x, w = rand(m, k, dtype=torch.float16), rand(2 * n, k, dtype=torch.float16, seed=1)
        y = x.float() @ w.float().t()
        want = F.silu(y[:, :n]) * y[:, n:]
        assert _gemv.candidates(m, n, k, glu=True)
        wg, wu = w[:n].clone(), w[n:].clone()  # two weights
        for cfg in _gemv.candidates(m, n, k, glu=True):
            out = torch.full((m, n), float("nan"), dtype=torch.float16)
            _gemv._launch(cfg, x, w, None, out, glu=True)
            torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)
            pair = torch.full((m, n), float("nan"), dtype=torch.float16)
            _gemv._launch(cfg, x, wg, None, pair, glu=True, u=wu)
            assert torch.equal(pair, out), cfg
        yh, out = x @ w.t(), torch.full((m, n), float("nan"), dtype=torch.float16)
        _rowwise._launch_glu(yh[:, :n], yh[:, n:], out, block=16)  # (a last block past the row)
        assert torch.equal(out, gated(x, w))
    assert all(c[-1] == 1 for c in _gemv.candidates(2, 40, 2100, glu=True))  # K is not split


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_every_candidate_kernel_is_as_close_to_the_float32_product_as_cublas(shape, dtype):
    m, n, k, bias = shape
    x, w = rand(m, k, dtype=dtype, device="cuda"), rand(n, k, dtype=dtype, device="cuda", seed=1) / k**0.5
    b = rand(n, dtype=dtype, device="cuda", seed=2) if bias else None
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    floor = err(_gemv._cublas(x, w, b), want)
    for cfg in _gemv.candidates(m, n, k):
        y = torch.empty(m, n, dtype=dtype, device="cuda")
        _gemv._launch(cfg, x, w, b, y)
        assert err(y, want) <= 2 * floor + 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_the_tuned_choice_replays_in_a_cuda_graph_as_it_runs_eagerly(shape):
    m, n, k, bias = shape
    x, w = rand(m, k, device="cuda"), rand(n, k, device="cuda", seed=1) / k**0.5
    b = rand(n, device="cuda", seed=2) if bias else None
    kernels.op(x, w, b)  # tunes the key outside the capture, as fgraph's warm-up does
    assert (m, n, k, bf16, bias, False, 0, x.device.index) in _gemv._choice
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = kernels.op(x, w, b)
    for seed in (5, 6):  # new rows in the same memory, as a decode step's inputs
        x.copy_(rand(m, k, device="cuda", seed=seed))
        g.replay()
        assert torch.equal(y, kernels.op(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_every_split_k_config_sums_its_partials_once_in_order_replay_after_replay(m):
    # 0.5B's down projection: the last program of a column block to arrive sums the partials the others stored; a
    # sum started early, or counters left dirty, would show as a replay that differs from the first launch
    n, k = 896, 4864
    x, w = rand(m, k, device="cuda"), rand(n, k, device="cuda", seed=1) / k**0.5
    split = [c for c in _gemv.candidates(m, n, k) if c[-1] > 1]
    assert split
    for cfg in split:
        want = torch.empty(m, n, dtype=bf16, device="cuda")
        _gemv._launch(cfg, x, w, None, want)
        g, y = torch.cuda.CUDAGraph(), torch.empty_like(want)
        with torch.cuda.graph(g):
            _gemv._launch(cfg, x, w, None, y)
        for _ in range(20):
            y.fill_(float("nan"))
            g.replay()
            assert torch.equal(y, want), cfg


@pytest.mark.gpu
def test_a_new_key_compiles_every_kernel_side_by_side_before_timing_any_and_keeps_no_memory(monkeypatch):
    m, n, k = 3, 776, 768
    x, w = rand(m, k, device="cuda"), rand(n, k, device="cuda", seed=1) / k**0.5
    warm, real = [], _gemv._launch

    def spy(*args, **kwargs):
        warm.append(kwargs.get("warm", args[8] if len(args) > 8 else False))
        return real(*args, **kwargs)

    monkeypatch.setattr(_gemv, "_launch", spy)
    monkeypatch.setattr(fgraph.config, "tune_cache", False)
    before, n_cands = dict(_gemv.counts), len(_gemv.builds(_gemv.candidates(m, n, k)))
    torch.mm(x, w.t())  # (cuBLAS's workspace of this stream, made before the count)
    allocated = torch.cuda.memory_allocated()
    y = kernels.op(x, w, None)
    # (the timings ran on side streams: cuBLAS's workspace of each, 32 MiB on Hopper, is not kept)
    assert torch.cuda.memory_allocated() - allocated < 4 << 20
    assert _gemv.counts["tuned"] == before["tuned"] + 1
    assert _gemv.counts["compiled"] == before["compiled"] + n_cands
    assert warm[:n_cands] == [True] * n_cands and not any(warm[n_cands:])
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_key_first_met_inside_a_capture_runs_cublas_and_is_counted():
    x, w = rand(2, 512, device="cuda"), rand(520, 512, device="cuda", seed=1)
    assert (2, 520, 512, bf16, False, False, 0, x.device.index) not in _gemv._choice
    before = dict(_gemv.counts)
    torch.mm(x, w.t())  # (cuBLAS's own set-up, outside the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = kernels.op(x, w, None)
    g.replay()
    assert _gemv.counts["untuned"] == before["untuned"] + 1 and _gemv.counts["tuned"] == before["tuned"]
    assert torch.equal(y, torch.mm(x, w.t()))


@pytest.mark.gpu
def test_a_compiled_cuda_step_calls_fgraph_linear_and_equals_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    params = {
        "w1": rand(256, 128, device="cuda", seed=1),
        "b1": rand(256, device="cuda", seed=2),
        "w2": rand(128, 256, device="cuda", seed=3) / 16,
    }
    before = compiler.counts["linear"]
    batch = {"x": fgraph.Batched()}
    f = fgraph.jit(lambda params, x: mlp(params, x), batch=batch, buckets=[1, 8], mode="FULL", compile=True)
    for m in (1, 5, 8):
        x = rand(m, 128, device="cuda", seed=10 + m)
        torch.testing.assert_close(f(params, x), mlp(params, x))
    assert compiler.counts["linear"] - before == 2 * 2


@pytest.mark.parametrize("parts", [False, True], ids=["whole", "in parts"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_hf_models_compiled_decode_runs_every_projection_through_the_op_and_equals_eager(
    device, parts, tmp_path, monkeypatch
):
    # HF's o_proj input is the transposed attention output: its matmul traces to a bmm, rewritten too. In parts
    # (fgraph.config.compile_parts): the piece is rewritten whole, then cut at its two sdpa_decode calls
    from benchmarks import hf_bench
    from examples import hf_generate

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "compile_parts", parts)
    base = hf_bench.make_model(True, device, bf16, layers=2)
    model = hf_bench.make_model(True, device, bf16, layers=2)
    model.load_state_dict(base.state_dict())
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
    before, workers = dict(compiler.counts), dict(_workers.counts)
    monkeypatch.setattr(_gemv, "_choice", {})  # every key tuned here: none by an earlier test, nor read from the
    monkeypatch.setattr(fgraph.config, "tune_cache", False)  # disk, where an earlier process on this machine tuned it
    monkeypatch.setattr(_workers, "_launched", set())  # (no launch of an earlier test's: each first one looks)
    kw = dict(output_logits=True, return_dict_in_generate=True)
    cpu = device == "cpu"  # (its SDPA calls rewritten too, as CUDA pieces' are: so that the piece is cut here too)
    with rewriting_on_cpu(monkeypatch) if cpu else contextlib.nullcontext():
        with sdpa_rewriting_on_cpu(monkeypatch) if cpu else contextlib.nullcontext():
            f = hf_generate.jit_forward(model, "FULL", buckets=[1], compile=True)
            want, got = hf_generate.generate(base, ids, 3, **kw), hf_generate.generate(model, ids, 3, **kw)
    # each piece compiled, per layer: q, k and v in one fgraph::linears, o, gate and up in one fgraph::linear_glu,
    # down; and the head
    made = {k: compiler.counts[k] - before[k] for k in ("linear", "group", "glu")}
    assert made["linear"] > 0 and made["linear"] % (4 * 2 + 1) == 0
    assert made["group"] * 9 == made["glu"] * 9 == made["linear"] * 2
    assert ("compiled: in parts, cut at its 2 fgraph::sdpa_decode calls" in str(fgraph.explain(f))) == parts
    assert torch.equal(got.sequences[:, : ids.shape[1] + 1], want.sequences[:, : ids.shape[1] + 1])  # the prefill
    scale = want.logits[1].abs().max().item()
    torch.testing.assert_close(got.logits[1], want.logits[1], atol=3e-2 * scale, rtol=0)  # the first decode step
    if device == "cuda":  # every kernel the tuner compiled had been queued for a worker as its piece compiled (and
        # was waited for, or taken back while still queued), and so had sdpa_decode's: its first launch found its job
        workers = {k: _workers.counts[k] - workers[k] for k in workers}
        assert workers["waited"] + workers["taken"] > 0 and workers["direct"] >= 1, workers
        assert workers["late"] == workers["ahead_errors"] == workers["failed"] == 0, workers


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GLU_SHAPES)
def test_every_glu_kernel_is_as_close_to_the_float32_result_as_cublas_and_the_activation_launch(shape):
    m, n, k = shape
    x, w = gated_inputs(m, n, k)
    y = x.float() @ w.float().t()
    want = F.silu(y[:, :n]) * y[:, n:]
    unfused = _gemv.silu_mul(_gemv._cublas(x, w, None))
    # the activation's launch is eager's two ops on the same matmul output, to one rounding of its exp
    torch.testing.assert_close(unfused, gated(x, w))
    pair = _gemv.silu_mul(_gemv._cublas(x, w[:n], None), _gemv._cublas(x, w[n:], None))
    torch.testing.assert_close(pair, gated(x, w))  # two matmuls and the launch of the activation of both
    wg, wu = w[:n].clone(), w[n:].clone()
    for cfg in _gemv.candidates(m, n, k, glu=True):
        out = torch.full((m, n), float("nan"), dtype=bf16, device="cuda")
        _gemv._launch(cfg, x, w, None, out, glu=True)
        assert err(out, want) <= 2 * err(unfused, want) + 1e-2, cfg
        two = torch.full((m, n), float("nan"), dtype=bf16, device="cuda")
        _gemv._launch(cfg, x, wg, None, two, glu=True, u=wu)
        assert torch.equal(two, out), cfg  # two weights: the same arithmetic


@pytest.mark.gpu
@pytest.mark.parametrize("two", [False, True], ids=["one weight", "two weights"])
@pytest.mark.parametrize("shape", GLU_SHAPES)
def test_the_tuned_glu_choice_replays_in_a_cuda_graph_as_it_runs_eagerly(shape, two):
    m, n, k = shape
    x, w = gated_inputs(m, n, k)
    ws = (w[:n].clone(), w[n:].clone()) if two else (w,)
    kernels.glu_op(x, *ws)  # tunes the key outside the capture, as fgraph's warm-up does
    assert (m, ws[0].shape[0], k, bf16, False, "pair" if two else True, 0, x.device.index) in _gemv._choice
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = kernels.glu_op(x, *ws)
    for seed in (5, 6):
        x.copy_(rand(m, k, device="cuda", seed=seed))
        g.replay()
        assert torch.equal(y, kernels.glu_op(x, *ws))


@pytest.mark.gpu
def test_a_compiled_cuda_gated_mlp_calls_fgraph_linear_glu_and_equals_eager(tmp_path, monkeypatch):
    from examples.layers import gated_mlp

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    params = {"w13": rand(2 * 512, 256, device="cuda", seed=1) / 16, "w2": rand(256, 512, device="cuda", seed=3) / 22}
    mlp_ = lambda params, x: gated_mlp(x, params["w13"], params["w2"])  # noqa: E731 (its own jit state)
    before = compiler.counts["glu"]
    f = fgraph.jit(mlp_, batch={"x": fgraph.Batched()}, buckets=[1, 8], mode="FULL", compile=True)
    for m in (1, 5, 8):
        x = rand(m, 256, device="cuda", seed=10 + m)
        want = mlp_(params, x)
        torch.testing.assert_close(f(params, x), want, atol=2e-2 * want.abs().max().item(), rtol=0)
    assert compiler.counts["glu"] - before == 2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GROUP_SHAPES)
def test_every_group_kernel_is_as_close_to_each_float32_product_as_cublas(shape):
    m, ns, k, bias = shape
    x, ws, bs = grouped_inputs(m, ns, k, bias)
    for cfg in [c for c in _gemv.candidates(m, max(ns), k) if c[-1] == 1]:
        ys = [torch.full((m, n), float("nan"), dtype=bf16, device="cuda") for n in ns]
        _gemv._launch_group(cfg, x, ws, bs, ys)
        for y, w, b in zip(ys, ws, bs):
            want = x.float() @ w.float().t() + (0 if b is None else b.float())
            assert err(y, want) <= 2 * err(_gemv._cublas(x, w, b), want) + 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GROUP_SHAPES)
def test_the_tuned_group_choice_replays_in_a_cuda_graph_as_it_runs_eagerly(shape):
    m, ns, k, bias = shape
    x, ws, bs = grouped_inputs(m, ns, k, bias)
    kernels.group_op(x, ws, bs)  # tunes the key outside the capture, as fgraph's warm-up does
    assert (m, ns, k, bf16, bias, "group", x.device.index) in _gemv._choice
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = kernels.group_op(x, ws, bs)
    for seed in (5, 6):
        x.copy_(rand(m, k, device="cuda", seed=seed))
        g.replay()
        assert all(map(torch.equal, ys, kernels.group_op(x, ws, bs)))
