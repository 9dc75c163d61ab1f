"""The `fgraph::linear` family as torch.library custom ops (what compiled pieces call; `_small_m` rewrites their
matmuls into them), with the fake implementations tracing and Inductor read, and what each op's first call will
compile, started ahead (`compile_ahead`). The kernels and tuner: `_gemv`."""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from . import _workers
from ._gemv import ahead, ahead_group, linear, linear_glu, linears, norm_linear

log = logging.getLogger("fgraph")


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

# each op's arguments -> the kernels its first call's tuner compiles, started in the compile workers (`_gemv.ahead`)
_AHEAD = {
    op: lambda x, w, b: ahead(x, w, b),
    glu_op: lambda x, w, u=None: ahead(x, w, None, glu=True, u=u),
    norm_op: lambda x, r, nw, eps, w, b, glu: ahead(x, w, b, glu, (r, nw, eps)),
    group_op: lambda x, ws, bs: ahead_group(x, ws, bs),
}


def compile_ahead(gm: fx.GraphModule) -> int:
    """Start compiling, in the compile workers (fgraph.config.compile_workers), the kernels the tuner will compile at
    the first call of gm's fgraph::linear family, from the trace's values of their arguments; the ops so met. Called
    before Inductor compiles gm: the workers compile while it does. Ops over a symbolic row count are left to the
    tuner (which rows it will meet is known only then), as is anything this raises on (counted: it costs only time)."""
    made = 0
    for node in gm.graph.nodes:
        rule = _AHEAD.get(node.target)
        args = fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
        x = args[0] if rule is not None and args else None
        if not isinstance(x, FakeTensor) or not all(isinstance(d, int) for d in x.shape):
            continue
        try:
            with x.fake_mode:
                rule(*args)
            made += 1
        except Exception:
            _workers.counts["ahead_errors"] += 1
            log.debug("fgraph: compiling %s ahead failed; its tuner compiles it", node.format_node(), exc_info=True)
    return made
