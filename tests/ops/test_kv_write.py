"""The one-launch KV append (fgraph/ops/_kv_write.py) writes exactly what the reference's two index_copy_ write."""

import pytest
import torch

from fgraph.ops import _attn_torch as T
from fgraph.ops import _kv_write as W

# (tokens, kv heads, head dim, pages, page size): a decode token of the 8B and 0.5B shapes, a padded mixed batch
SHAPES = [(1, 8, 128, 5, 16), (7, 2, 64, 9, 16), (64, 8, 128, 70, 16), (33, 2, 64, 3, 256)]


def case(N, H, D, P, page, device, dtype=torch.bfloat16, seed=0):
    """k/v as slices of one fused qkv row per token (how the models make them), caches, distinct slots."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, 6 * H * D, generator=g).to(device, dtype)
    k, v = qkv[:, 4 * H * D : 5 * H * D].view(N, H, D), qkv[:, 5 * H * D :].view(N, H, D)
    kc = torch.randn(P, page, H, D, generator=g).to(device, dtype)
    slots = torch.randperm(P * page, generator=g)[:N].to(device)
    return k, v, kc, torch.randn_like(kc), slots


def both(k, v, kc, vc, slots):
    """(reference caches, one-launch caches) after the same write into copies of the same caches."""
    ref = kc.clone(), vc.clone()
    got = kc.clone(), vc.clone()
    T.write_kv(k, v, *ref, slots)
    W.write_kv(k, v, *got, slots)
    return ref, got


def test_on_cpu_the_reference_runs_and_writes_the_same():
    k, v, kc, vc, slots = case(*SHAPES[1], "cpu")
    assert not W.one_launch(k, v, kc, vc)
    (rk, rv), (gk, gv) = both(k, v, kc, vc, slots)
    assert torch.equal(rk, gk) and torch.equal(rv, gv)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_one_launch_equals_two_index_copies_bitwise(shape):
    k, v, kc, vc, slots = case(*shape, "cuda")
    assert W.one_launch(k, v, kc, vc)
    (rk, rv), (gk, gv) = both(k, v, kc, vc, slots)
    assert torch.equal(rk, gk) and torch.equal(rv, gv)


@pytest.mark.gpu
def test_one_launch_inside_a_cuda_graph_writes_the_slots_of_each_replay():
    k, v, kc, vc, slots = case(*SHAPES[2], "cuda")
    W.write_kv(k, v, kc, vc, slots)  # compiles the kernel outside the capture, as fgraph's warm-up does
    ref_k, ref_v = kc.clone(), vc.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        W.write_kv(k, v, kc, vc, slots)
    for seed in (1, 2):  # new tokens and slots in the same memory, as a decode step's inputs
        k2, v2, _, _, s2 = case(*SHAPES[2], "cuda", seed=seed)
        k.copy_(k2), v.copy_(v2), slots.copy_(s2)
        g.replay()
        T.write_kv(k, v, ref_k, ref_v, slots)
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.gpu
def test_rows_that_are_not_contiguous_take_the_reference():
    k, v, kc, vc, slots = case(*SHAPES[0], "cuda")
    kt = k.transpose(1, 2).contiguous().transpose(1, 2)  # [N, H, D] with D not the innermost stride
    assert not W.one_launch(kt, v, kc, vc)
    (rk, rv), (gk, gv) = both(kt, v, kc, vc, slots)
    assert torch.equal(rk, gk) and torch.equal(rv, gv)
