"""The `fgraph::linear` family as torch.library custom ops (what compiled pieces call; `_small_m` rewrites their
matmuls into them), with the fake implementations tracing and Inductor read, and what each op's first call will
compile, started ahead (`compile_ahead`). The kernels and tuner: `_gemv`."""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from .._config import config
from . import _sdpa, _workers
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
    the first call of gm's fgraph::linear family, and those fgraph::sdpa_decode's first call launches, from the
    trace's values of their arguments; the ops so met. Called before Inductor compiles gm: the workers compile while
    it does. A batch axis is a symbol whose hint is the bucket the trace was made for, the rows the first call will
    meet; an op with an unhinted size, or one this raises on (counted: it costs only time), is left to the first
    call. Nothing without workers (their count 0)."""
    if not config.compile_workers:
        return 0
    made, mode = 0, FakeTensorMode()
    for node in gm.graph.nodes:
        rule = _AHEAD.get(node.target) or _sdpa.AHEAD.get(node.target)
        if rule is None:
            continue
        traced = fx.node.map_arg(node.args, lambda a: a.meta.get("val"))
        try:
            args = fx.node.map_aggregate(traced, lambda v: _concrete(v, mode))
        except _Unhinted:
            continue
        if not isinstance(args[0], torch.Tensor):
            continue
        try:
            with mode:
                rule(*args)
            made += 1
        except Exception:
            _workers.counts["ahead_errors"] += 1
            log.debug("fgraph: compiling %s ahead failed; its tuner compiles it", node.format_node(), exc_info=True)
    return made


class _Unhinted(Exception):
    pass


def _concrete(v, mode: FakeTensorMode):
    """A fake tensor like the trace's value v, sized and strided as the trace was made (a symbol: its hint)."""
    if not isinstance(v, torch.Tensor):
        return v
    size, stride = ([d if isinstance(d, int) else d.node.hint for d in ds] for ds in (v.shape, v.stride()))
    if None in size or None in stride:
        raise _Unhinted
    with mode:
        return torch.empty_strided(size, stride, dtype=v.dtype, device=v.device)
