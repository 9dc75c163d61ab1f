"""Expert parallelism on the CPU: 2 processes over gloo (spawned here, bounded in time). allgather and
all2all on sharded weights must give what local gives on the full weights, alone and inside fgraph.jit."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
DEADLINE_S = 120  # the whole test, spawn included; the process group times out before this


def _checks(rank, world):
    import fgraph
    from fgraph import Batched, Mode
    from fgraph.ops import moe as M
    from tests.ops.test_moe import moe_params, moe_step, tokens, weights

    def close(a, b, dtype):
        tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, b, **tol)

    for dtype in (torch.float64, torch.float32):
        for shared in (0, 24):
            w = weights(E=8, top_k=3, shared=shared, dtype=dtype, renormalize=shared == 0)
            mine = w.shard(rank, world)
            x = tokens(6, dtype=dtype, seed=10 + rank)  # same N on every rank (allgather)
            close(M.moe(x, mine, "allgather"), M.moe(x, w, "local"), dtype)
            close(M.moe(x, mine, "all2all"), M.moe(x, w, "local"), dtype)
            for n in ([5, 11], [7, 0], [0, 3]):  # all2all: per-rank N may differ, or be 0
                x = tokens(n[rank], dtype=dtype, seed=20 + rank)
                close(M.moe(x, mine, "all2all"), M.moe(x, w, "local"), dtype)

    # every token to rank 0's experts: rank 1 receives nothing and still answers its (empty) share
    w = weights(E=8, top_k=3, shared=0, dtype=torch.float64)
    el = 8 // world
    router = torch.zeros_like(w.router)
    router[:el] = w.router[:el].abs()
    w = M.MoEWeights(router, w.w13, w.w2, top_k=3)
    x = tokens(9, seed=30 + rank).abs()
    close(M.moe(x, w.shard(rank, world), "all2all"), M.moe(x, w, "local"), torch.float64)
    close(M.moe(x, w.shard(rank, world), "allgather"), M.moe(x, w, "local"), torch.float64)

    # inside fgraph.jit: allgather stays in the FULL graph, all2all is split out (piecewise around it)
    params = moe_params()
    full = params["moe"]
    x = tokens(5, dtype=torch.float32, seed=40 + rank)
    with fgraph.disable_jit():
        ref = moe_step(params, x, "decode", "local")
    for backend, mode in (("allgather", Mode.FULL), ("all2all", Mode.PIECEWISE)):
        p = dict(params, moe=full.shard(rank, world))
        f = fgraph.jit(moe_step, static=["routine", "backend"], batch={"x": Batched()}, mode="FULL", buckets=[8])
        f.capture(p, x, routine="decode", backend=backend, progress=False)
        # (both jit objects of moe_step share one cache, as jax.jit's: this backend's is its own signature)
        (entry,) = [e for e in f.entries.values() if dict(e.sig.statics)["backend"] == backend]
        assert entry.mode is mode, (backend, entry.mode, entry.reason)
        for _ in range(2):
            torch.testing.assert_close(f(p, x, routine="decode", backend=backend), ref)


def _worker(rank, world, store):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=DEADLINE_S - 10)
    )
    try:
        _checks(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    from examples.tp import _exit_cleanly

    _exit_cleanly()  # (see there: a rank that passed every check once aborted in gloo's teardown, in CI)


@pytest.mark.slow
def test_expert_parallel_backends_match_local_over_gloo(tmp_path):
    ctx = mp.start_processes(
        _worker, args=(WORLD, str(tmp_path / "store")), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"2-process gloo MoE test did not finish in {DEADLINE_S} s (a rank is stuck in a collective?)"
                )
    finally:
        for p in ctx.processes:  # only the workers this test started
            if p.is_alive():
                p.kill()
                p.join()


def test_world_of_one_communicates_and_matches_local(tmp_path):
    """With a process group of one the EP backends still run their collectives (the GPU test's NCCL shape)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store1'}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        from fgraph.ops import moe as M
        from tests.ops.test_moe import tokens, weights

        w, x = weights(), tokens(7)
        for backend in ("allgather", "all2all"):
            torch.testing.assert_close(M.moe(x, w, backend), M.moe(x, w, "local"), rtol=0, atol=1e-12)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ EP engine
LENGTHS = ((5, 17, 1, 33, 9, 2, 40, 12), (40, 3, 1, 22, 9))  # rank 0's prompts, the other ranks'


def ep_engine_tokens(t, dtype_name: str, attn_backend: str, modes):
    """On every rank of examples.tp.launch: the tiny MoE model's greedy tokens for this rank's own requests (other
    counts and lengths than the other ranks', so steps differ in N and one rank idles at the end) with full
    weights and moe_backend="local", then with this rank's experts under allgather and all2all, per fgraph mode
    -> every rank's {run: (tokens, capture modes used, steps)}."""
    import gc

    from examples import qwen2_moe

    dev = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(100 + t.rank)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in LENGTHS[min(t.rank, 1)]]

    def run(moe_backend, mode):
        c = qwen2_moe.preset("tiny-moe", mlp_only_layers=(1,), n_layers=3, moe_backend=moe_backend)
        params = qwen2_moe.init_params(c, getattr(torch, dtype_name), dev, seed=0)  # EP: this rank's experts
        eng = qwen2_moe.build(
            c,
            params,
            backend=attn_backend,
            mode=mode,
            max_seqs=8,
            max_seq_len=96,
            max_batch_tokens=64,
            buckets=(1, 8, 64),
        )
        for p in prompts:
            eng.add(p, max_new_tokens=12 if t.rank == 0 else 5)
        report = eng.run(progress=False)
        used = sorted({e.mode.name for e in getattr(eng.step_fn, "entries", {}).values()})
        del eng
        gc.collect()  # graphs go before the next engine (and before the communicator, at the end)
        return report.tokens, used, report.steps

    out = {"local": run("local", "eager")}
    for backend in ("allgather", "all2all"):
        for mode in modes:
            out[backend, mode] = run(backend, mode)
    everyone = [None] * t.world
    dist.all_gather_object(everyone, out)
    return everyone


@pytest.mark.slow
def test_expert_parallel_engine_equals_local_over_gloo():
    """Each rank serves its own requests (other counts and lengths); allgather (inside FULL graphs) and all2all
    (piecewise around it) give the tokens local gives with all the experts: the ranks pad each step to the same
    token count and routine, and the rank that finishes first keeps stepping on padding until the other is done."""
    from examples import tp

    everyone = tp.launch(ep_engine_tokens, WORLD, "float32", "torch", ("eager", "FULL"), timeout_s=DEADLINE_S + 60)
    assert [len(out["local"][0]) for out in everyone] == [len(n) for n in LENGTHS]
    alone = [out["local"][2] for out in everyone]
    assert alone[1] < alone[0]  # on its own, rank 1 needs fewer steps...
    for rank, out in enumerate(everyone):
        want = out["local"][0]
        for backend, want_modes in (("allgather", ["FULL"]), ("all2all", ["PIECEWISE"])):
            assert out[backend, "eager"][0] == want, (rank, backend)
            assert out[backend, "FULL"] == (want, want_modes, alone[0]), (rank, backend)  # ...here it steps with rank 0
