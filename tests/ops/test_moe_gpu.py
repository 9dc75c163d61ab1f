"""MoE on the GPU: the local backend is sync-free and capturable (every layout, inside a raw CUDA graph and in
the example model's FULL graphs); all2all over NCCL at world size 1 runs piecewise around the MoE break;
allgather's NCCL collectives sit inside a full graph. Eager (same buckets, same kernels) is the oracle: the engines
here replay eager's own kernels (compile=False), so their bf16 tokens are eager's bit for bit; compiled pieces are
checked in float32, where Inductor's reordered sums cannot flip a greedy token.
Run on the device: `python -m pytest -q tests/ops/test_moe_gpu.py` (timings: `python -m fgraph.ops.moe cuda`)."""

import contextlib
import os
import tempfile
from datetime import timedelta

import attrs
import pytest
import torch
import torch.distributed as dist

import fgraph
from fgraph.ops import moe as M

pytestmark = pytest.mark.gpu

DEV = "cuda"


def weights(dtype, E=16, dim=256, inter=128, shared=256, top_k=4, seed=0):
    return M.MoEWeights.random(
        E,
        dim,
        inter,
        shared,
        top_k=top_k,
        dtype=dtype,
        device=DEV,
        renormalize=True,
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.parametrize(
    "dtype, n, layout",
    [
        (torch.bfloat16, 1, "grouped"),
        (torch.bfloat16, 64, "grouped"),
        (torch.float32, 2, "gather"),
        (torch.float32, 64, "dense"),
    ],
)
def test_local_op_is_sync_free_and_replays_in_a_cuda_graph(dtype, n, layout):
    w = weights(dtype)
    x = torch.randn(n, 256, dtype=dtype, device=DEV)
    rw, ids = M.route(x, w.router, w.top_k, w.scoring, w.renormalize)
    assert M.choose_layout(x, ids, w.w13) == layout
    # the layout's kernels against the plain per-expert loop in float32, on the same routing
    f32 = [t.float() for t in (x, rw, w.w13, w.w2)]
    tol = dict(rtol=0.03, atol=0.03) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        M.experts(x, ids, rw, w.w13, w.w2).float(), M.experts(f32[0], ids, f32[1], f32[2], f32[3], layout="loop"), **tol
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync on the hot path raises
    try:
        eager = M.moe(x, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        M.moe(static_x, w)  # warm-up off the default stream, as capture does
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = M.moe(static_x, w)
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    g.replay()
    torch.testing.assert_close(static_out, M.moe(x2, w), rtol=0, atol=0)
    static_x.copy_(x)
    g.replay()
    assert torch.equal(static_out, eager)


@contextlib.contextmanager
def nccl_world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(
            "nccl",
            init_method=f"file://{os.path.join(d, 'store')}",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
            device_id=torch.device(DEV, torch.cuda.current_device()),
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


def tiny_moe(moe_backend, dtype=torch.bfloat16):
    from examples import qwen2_moe

    cfg = qwen2_moe.preset("tiny-moe", moe_backend=moe_backend, mlp_only_layers=(1,), n_layers=3)
    return cfg, qwen2_moe.init_params(cfg, dtype, DEV, seed=0)


def run_engine(cfg, params, mode, seed=0, backend="auto", compile=False):
    from examples import qwen2_moe

    eng = qwen2_moe.build(
        cfg,
        params,
        backend=backend,
        mode=mode,
        max_seqs=8,
        max_seq_len=96,
        max_batch_tokens=64,
        capture=mode != "eager",
        compile=compile,
    )
    g = torch.Generator().manual_seed(seed)
    for n in (5, 17, 1, 33, 9, 2, 40, 12):
        eng.add(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), max_new_tokens=12)
    return eng, eng.run(progress=False).tokens


def decode_entries(eng):
    return [e for e in eng.step_fn.entries.values() if dict(e.sig.statics)["routine"] == "decode"]


@pytest.mark.parametrize("backend", ["auto", "triton", "flash_attn", "flashinfer"])
def test_moe_model_full_graph_with_local_equals_eager(backend):
    if backend != "auto":
        pytest.importorskip(backend)
    cfg, params = tiny_moe("local")
    _, want = run_engine(cfg, params, "eager", backend=backend)
    eng, got = run_engine(cfg, params, "FULL", backend=backend)
    assert got == want
    dec = decode_entries(eng)
    assert dec and all(e.mode is fgraph.Mode.FULL and len(e.graphs) == 1 for e in dec)
    assert sum(e.stats.replays for e in eng.step_fn.entries.values()) > 0


def test_moe_model_compiled_pieces_equal_eager_in_float32():
    """The engine's default on CUDA: FULL with Inductor-compiled pieces (the MoE break and triton attention inside
    the full graphs), against eager in float32."""
    cfg, params = tiny_moe("local", torch.float32)
    _, want = run_engine(cfg, params, "eager", backend="triton")
    eng, got = run_engine(cfg, params, "FULL", backend="triton", compile=True)
    assert eng.step_fn.options.compile == {}
    assert got == want
    assert all(e.mode is fgraph.Mode.FULL and len(e.graphs) == 1 for e in decode_entries(eng))


def test_all2all_world1_runs_piecewise_around_moe_and_equals_eager():
    # (Flipped tokens here once: the eager oracle's flashinfer attention took the plan the previous engine's last
    # FULL replay had made; plans are now tied to the fgraph execution they were made for.)
    cfg, params = tiny_moe("all2all")
    with nccl_world_of_one():
        _, want = run_engine(cfg, params, "eager")
        eng, got = run_engine(cfg, params, "FULL")
        assert got == want
        n_breaks = 3 + 2  # attention per layer + MoE on layers 0 and 2
        for e in eng.step_fn.entries.values():
            assert e.mode is fgraph.Mode.PIECEWISE and "all2all exchanges" in e.reason
            assert sum(p.is_break and p.ops == ("moe",) for p in e.program.pieces) == 2
            assert len(e.graphs) == n_breaks + 1
        text = str(eng.explain("decode"))
        assert "break moe  support NEVER" in text and "FULL requested -> PIECEWISE" in text
        del eng  # graphs go before the communicator they were captured with
        torch.cuda.synchronize()


def test_all2all_world1_matches_local_tokens():
    # same weights and tokens: all2all at world 1 sends every token to itself, so the math is local's
    cfg, params = tiny_moe("local")
    _, want = run_engine(cfg, params, "eager")
    with nccl_world_of_one():
        eng, got = run_engine(attrs.evolve(cfg, moe_backend="all2all"), params, "PIECEWISE")
        del eng
        torch.cuda.synchronize()
    assert got == want


def test_allgather_world1_nccl_inside_full_graph_equals_eager():
    cfg, params = tiny_moe("allgather")
    with nccl_world_of_one():
        _, want = run_engine(cfg, params, "eager")
        eng, got = run_engine(cfg, params, "FULL")
        assert got == want
        assert all(e.mode is fgraph.Mode.FULL and len(e.graphs) == 1 for e in decode_entries(eng))
        del eng
        torch.cuda.synchronize()
