"""The `fgraph::linear` family as torch.library custom ops (what compiled pieces call; `_small_m` rewrites their
matmuls into them), with the fake implementations tracing and Inductor read. The kernels and tuner: `_gemv`."""

from __future__ import annotations

import torch

from ._gemv import linear, linear_glu, linears, norm_linear


@torch.library.custom_op("fgraph::linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return linear(x, w, b)


@_linear_op.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("fgraph::norm_linear", mutates_args=())
def _norm_linear_op(
    x: torch.Tensor,
    r: torch.Tensor | None,
    nw: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    b: torch.Tensor | None,
    glu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_linear(x, r, nw, eps, w, b, glu)


@_norm_linear_op.register_fake
def _(x, r, nw, eps, w, b, glu):
    y = x.new_empty(x.shape[0], w.shape[0] // 2 if glu else w.shape[0])
    return y, (x.new_empty(x.shape) if r is not None else x.new_empty(0))


@torch.library.custom_op("fgraph::linears", mutates_args=())
def _linears_op(x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    return linears(x, ws, bs)


@_linears_op.register_fake
def _(x, ws, bs):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in ws]


@torch.library.custom_op("fgraph::linear_glu", mutates_args=())
def _linear_glu_op(x: torch.Tensor, w: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    return linear_glu(x, w, u)


@_linear_glu_op.register_fake
def _(x, w, u=None):
    return x.new_empty(x.shape[0], w.shape[0] // 2 if u is None else w.shape[0])


op = torch.ops.fgraph.linear.default
glu_op = torch.ops.fgraph.linear_glu.default
norm_op = torch.ops.fgraph.norm_linear.default
group_op = torch.ops.fgraph.linears.default
