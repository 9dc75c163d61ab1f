"""`fgraph::linear`: x [M, K] @ w [N, K]^T (+ b [N]) as one op, for compiled pieces to call at decode sizes.

Not a break primitive: a graph piece keeps it inside. Compiling a piece for CUDA rewrites its matmuls of a
weight's transpose into this op (fgraph/capture/_small_m.py) when `fgraph.config.small_m_gemv` is on; at M <= 16
rows it runs the tuned no-split-K kernel of `_gemv` where that is faster than cuBLAS, and cuBLAS otherwise. Anywhere
else (CPU, float32, more rows) it is torch.mm / torch.addmm, the ops it replaced, bit for bit.
"""

from __future__ import annotations

import torch

from . import _gemv


@torch.library.custom_op("fgraph::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return _gemv.linear(x, w, b)


@linear.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0])


MAX_ROWS = _gemv.MAX_ROWS  # rows the kernel serves
counts = _gemv.counts  # tuned / triton / cublas / untuned keys (see _gemv)
op = torch.ops.fgraph.linear.default
