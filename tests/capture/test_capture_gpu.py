"""The core on a real GPU: CUDA graphs replay the toy model bitwise like eager; breaks run where the mode says."""

import pytest
import torch

import fgraph
from fgraph.capture import CudaGraph
from tests import toys
from tests.toys import jitted, step

pytestmark = pytest.mark.gpu


def make_cuda(n=7, d=64):
    g = torch.Generator().manual_seed(0)
    params = {"w": (torch.randn(d, d, generator=g) / d**0.5).cuda()}
    state = {"count": torch.zeros((), dtype=torch.int64, device="cuda")}
    return params, state, {"x": torch.randn(n, d, generator=g)}  # batch on the host: fgraph copies it over


def eager(params, x, routine):
    with fgraph.disable_jit():
        return step(params, {"count": torch.zeros((), dtype=torch.int64, device="cuda")}, {"x": x}, routine)[0]


@pytest.mark.parametrize("mode, graphs_per_sig", [("PIECEWISE", 3), ("FULL", 1)])
def test_replay_is_bitwise_eager(mode, graphs_per_sig):
    f = jitted(mode=mode, buckets=[1, 2, 4, 8, 16, 32, 64, 128])
    params, state, batch = make_cuda()
    f.capture(params, state, batch, routine=["decode", "mixed"], progress=False)
    assert f.stats()["total"]["captures"] == 16 * graphs_per_sig
    assert all(isinstance(g, CudaGraph) and g.pool is f.cache.pool for e in f.entries.values() for g in e.graphs)
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 8, 25, 64, 123):
        for routine in ("decode", "mixed"):
            x = torch.randn(n, 64, generator=g)
            out, _ = f(params, state, {"x": x}, routine=routine)
            # padded rows don't change real rows (row-wise math), so the same kernels on the same bucket agree bitwise
            ref = eager(params, toys_pad(x, f), routine)[:n]
            assert torch.equal(out, ref), (n, routine)
    assert not any(f.stats()["fallbacks"].values()), f.stats()["fallbacks"]


def toys_pad(x, f):
    from fgraph._signature import bucket_for

    b = bucket_for(f.options.buckets, x.shape[0])
    return torch.cat([x, x.new_zeros(b - x.shape[0], x.shape[1])]).cuda()


def test_breaks_run_between_pieces_in_piecewise_and_inside_the_graph_in_full():
    params, state, batch = make_cuda()
    for mode, per_call in [("PIECEWISE", 2), ("FULL", 0)]:
        f = jitted(mode=mode, buckets=[8])
        f.capture(params, state, batch, routine="decode", progress=False)
        before = toys.calls["scale"]
        for _ in range(3):
            out, _ = f(params, state, batch, routine="decode")
        torch.cuda.synchronize()
        assert toys.calls["scale"] - before == 3 * per_call, mode  # FULL: the break's kernels replay, Python doesn't
        assert torch.equal(out, eager(params, toys_pad(batch["x"], f), "decode")[:7])


def test_one_pool_for_all_graphs_of_a_function():
    f = jitted(mode="FULL_AND_PIECEWISE", buckets=[4, 8])
    params, state, batch = make_cuda()
    f.capture(params, state, batch, routine=["decode", "mixed"], progress=False)
    pools = {id(g.pool) for e in f.entries.values() for g in e.graphs}
    assert len(pools) == 1
    modes = sorted(
        (dict(e.sig.statics)["routine"], e.sig.bucket, e.mode.name, len(e.graphs)) for e in f.entries.values()
    )
    assert modes == [
        ("decode", 4, "FULL", 1),
        ("decode", 8, "FULL", 1),
        ("mixed", 4, "PIECEWISE", 3),
        ("mixed", 8, "PIECEWISE", 3),
    ]


def test_donated_state_updates_in_place_across_replays():
    f = jitted(mode="FULL", buckets=[8])
    params, state, batch = make_cuda()
    f.capture(params, state, batch, routine="decode", progress=False)
    start = state["count"].item()
    for _ in range(5):
        _, st = f(params, state, batch, routine="decode")
    assert st["count"] is state["count"] and state["count"].item() == start + 5


def wide(x, w):
    return (x[:, :1] * w,)  # [N, 256K] float32: 1 MiB per row


W = None


def jit_wide(mode, buckets):
    """`wide` jitted: x comes from the host (Batched), w lives on the GPU (it makes the signature's device). Zero-copy
    outputs (copy_outputs=False, as the engine): these tests are about graph output memory."""
    global W
    W = torch.ones(1, 1 << 18, device="cuda") if W is None else W
    f = fgraph.jit(wide, batch={"x": fgraph.Batched()}, mode=mode, buckets=buckets, copy_outputs=False)
    return lambda x: f(x, W), f


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_signatures_share_output_memory(mode):
    # Without weak outputs every signature would keep its own outputs alive in the pool: 1+2+...+64 MiB.
    buckets = [1, 2, 4, 8, 16, 32, 64]
    call, f = jit_wide(mode, buckets)
    torch.cuda.synchronize()
    f.capture(torch.ones(1, 4), W, progress=False)
    pool = sum(e.pool_bytes for e in f.entries.values())
    assert pool < 2 * 64 * 2**20 + 16 * 2**20, pool / 2**20  # ~ the largest signature's, not the sum (127 MiB)
    for n in (3, 50, 1, 64):
        x = torch.arange(n, dtype=torch.float32).view(n, 1).repeat(1, 4)
        (out,) = call(x)
        assert out.is_cuda and out.shape == (n, 1 << 18) and torch.equal(out[:, -1].cpu(), x[:, 0]), n


def test_footgun_outputs_valid_until_the_next_call_of_any_signature():
    call, f = jit_wide("FULL", [8, 64])
    f.capture(torch.ones(1, 4), W, progress=False)
    (a,) = call(torch.full((50, 4), 1.0))
    (b,) = call(torch.full((8, 4), 2.0))  # another signature: it may write over `a`'s memory
    # the 8-bucket graph was captured after the 64-bucket one gave its output block back to the pool: the
    # allocator hands the same block out again, so `a` now shows `b`'s values
    assert b.data_ptr() == a.data_ptr(), "the pool did not reuse the block (allocator policy changed?)"
    assert a[0, 0].item() == 2.0  # should be 1.0! clone what you keep (or keep copy_outputs=True)


def test_reset_keeps_memory_of_outputs_still_held():
    call, f = jit_wide("FULL", [64])
    (kept,) = call(torch.full((64, 4), 5.0))
    f.reset()  # the graph is retired, not freed: `kept` still points into its pool
    assert len(f.cache.retired) == 1
    (other,) = call(torch.full((64, 4), 7.0))  # a new capture in a new pool
    torch.cuda.empty_cache()
    assert kept.sum().item() == 5.0 * 64 * (1 << 18) and other[0, 0].item() == 7.0
    del kept
    f.reset()
    assert len(f.cache.retired) == 1  # only the second graph (`other` is still held)


@pytest.fixture
def inputs_in_graph():
    prev, fgraph.config.inputs_in_graph = fgraph.config.inputs_in_graph, True
    yield
    fgraph.config.inputs_in_graph = prev


def test_full_graphs_copy_their_inputs_in_and_calls_never_overwrite_a_pending_copy(inputs_in_graph):
    """fgraph.config.inputs_in_graph: a FULL graph's first step copies the batched inputs from its own pinned
    mirror. Calls queued behind a busy GPU must not rewrite that mirror before the previous replay has copied it
    (each call waits for the event the graph records after its copy): every output equals eager."""
    f = jitted(mode="FULL", buckets=[8, 32])
    params, state, batch = make_cuda()
    f.capture(params, state, batch, routine=["decode", "mixed"], progress=False)
    assert all(e.buffers.graph_mirror is not None for e in f.entries.values())
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, 64, generator=g) for n in (7, 25, 8, 3, 25, 7)]
    torch.cuda._sleep(50_000_000)  # ~25 ms of GPU spin: the calls below queue up behind it
    outs = [f(params, state, {"x": x}, routine=r)[0].clone() for x, r in zip(xs, ["decode", "mixed"] * 3)]
    for x, r, out in zip(xs, ["decode", "mixed"] * 3, outs):
        assert torch.equal(out, eager(params, toys_pad(x, f), r)[: x.shape[0]]), (x.shape[0], r)
