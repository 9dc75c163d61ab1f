"""GPU: fgraph.jit with no compile= compiles a CUDA function's pieces with Inductor (its few-row matmuls as
fgraph::linear), says so in `explain`, and every call of any size is close to eager's (assert_close: other kernels,
so not bit for bit); compile=False gives eager's bits."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph.compile import compiler

pytestmark = pytest.mark.gpu
bf16 = torch.bfloat16


def block(p, x):
    """A pre-norm gated MLP with its residual, as a decoder layer's second half: x [N, 256] bf16."""
    h = F.rms_norm(x, (x.shape[-1],), p["nw"], 1e-6)
    return x + (F.silu(h @ p["wg"].t()) * (h @ p["wu"].t())) @ p["wd"].t()


@functools.cache
def params():
    g = torch.Generator().manual_seed(0)
    shapes = {"nw": (256,), "wg": (344, 256), "wu": (344, 256), "wd": (256, 344)}
    return {k: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to("cuda", bf16) for k, s in shapes.items()}


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6))
@settings(max_examples=12, deadline=None)
def test_the_default_compiles_on_cuda_and_every_call_is_close_to_eager(ns):
    before = fgraph.config.compile_cuda
    fgraph.config.compile_cuda = True  # (fgraph's default; the suite turns it off: conftest.py)
    try:
        j = fgraph.jit(block, batch={"x": fgraph.Batched()}, buckets=[4, 16, 48])
        for n in ns:
            x = torch.randn(n, 256, generator=torch.Generator().manual_seed(n)).to("cuda", bf16)
            torch.testing.assert_close(j(params(), x), block(params(), x), atol=3e-2, rtol=3e-2)
        assert all(e.compiled and e.uncompiled is None for e in j.entries.values())
        assert "  compile: Inductor (the default on CUDA" in str(fgraph.explain(j))
    finally:
        fgraph.config.compile_cuda = before


def test_compile_false_on_cuda_is_eager_bit_for_bit_and_compiles_nothing():
    compiled = compiler.counts["compiled"] + compiler.counts["loaded"] + compiler.counts["shared"]
    j = fgraph.jit(block, batch={"x": fgraph.Batched()}, buckets=[4, 16], compile=False)
    for n in (1, 3, 16):
        x = torch.randn(n, 256, generator=torch.Generator().manual_seed(n)).to("cuda", bf16)
        assert torch.equal(j(params(), x), block(params(), x))
    assert compiler.counts["compiled"] + compiler.counts["loaded"] + compiler.counts["shared"] == compiled
    assert "  compile: uncompiled graphs (compile=False)" in str(fgraph.explain(j))
