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
  params = {"w": (torch.randn(d, d, generator=g) / d ** 0.5).cuda()}
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
  assert all(isinstance(g, CudaGraph) and g.pool is f.pool for e in f.entries.values() for g in e.graphs)
  g = torch.Generator().manual_seed(1)
  for n in (1, 7, 8, 25, 64, 123):
    for routine in ("decode", "mixed"):
      x = torch.randn(n, 64, generator=g)
      out, _ = f(params, state, {"x": x}, routine=routine)
      # padded rows don't change real rows (row-wise math), so the same kernels on the same bucket agree bitwise
      ref = eager(params, toys_pad(x, f), routine)[:n]
      assert torch.equal(out, ref), (n, routine)
  assert f.stats()["fallbacks"] == {"unseen": 0, "oversize": 0}


def toys_pad(x, f):
  from fgraph._signature import bucket_for
  b = bucket_for(f.buckets, x.shape[0])
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
  modes = sorted((dict(e.sig.statics)["routine"], e.sig.bucket, e.mode.name, len(e.graphs)) for e in f.entries.values())
  assert modes == [("decode", 4, "FULL", 1), ("decode", 8, "FULL", 1), ("mixed", 4, "PIECEWISE", 3),
                   ("mixed", 8, "PIECEWISE", 3)]


def test_donated_state_updates_in_place_across_replays():
  f = jitted(mode="FULL", buckets=[8])
  params, state, batch = make_cuda()
  f.capture(params, state, batch, routine="decode", progress=False)
  start = state["count"].item()
  for _ in range(5):
    _, st = f(params, state, batch, routine="decode")
  assert st["count"] is state["count"] and state["count"].item() == start + 5
