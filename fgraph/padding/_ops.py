"""The padding check's rules (_mixing.py, find_mixing): per aten op, keyed by schema name (`aten.mean.dim`
-> "mean"), whether its padded rows can reach real rows. The op sets name each kind; RULES maps every op to its
kind's rule, rule_of adds the ops known by prefix and the default (a reduction check).

A rule takes the fx node and a Ctx and returns a finding, (batch symbols involved, what the op does with the batch
axis), or None when padded rows stay out of real ones."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from .. import _fx
from .._state import root_of
from ._index_flow import Flow, _static_numel
from ._index_rules import index_finding

# ops that combine rows along their `dim` / `dims` argument (the axis keeps its size). Running ones (cumsum, cummax,
# ...) are not among them: a row's result depends only on the rows before it, and padded rows come after the real
# ones (or something earlier was reported for putting them before)
_ALONG = {
    "_softmax",
    "_log_softmax",
    "softmax",
    "log_softmax",
    "sort",
    "argsort",
    "topk",
    "kthvalue",
    "median",
    "mode",
    "flip",
    "roll",
}
# batch norm in training mode: statistics over every dim but the channels (1): its output keeps the axis
_BATCH_STATS = {"_native_batch_norm_legit", "native_batch_norm", "_batch_norm_with_update", "batch_norm"}
# (op, index of the operand whose dim is contracted, that dim)
_CONTRACT = {"mm": (0, 1), "bmm": (0, 2), "addmm": (1, 1), "baddbmm": (1, 2), "addbmm": (1, 2), "mv": (0, 1)}
_CONTRACT.update({"dot": (0, 0), "vdot": (0, 0), "addmv": (1, 1)})
# ops that read rows by index or only read metadata: they do not combine rows
_READS = {"index", "index_select", "gather", "take", "take_along_dim", "embedding", "select", "slice", "narrow"}
_READS |= {"unbind", "split", "split_with_sizes", "unsafe_split", "chunk", "as_strided", "expand", "copy_", "copy"}
# ops cutting a dim into pieces of given sizes: a piece after one sized by the batch starts at a padded row
_SPLITS = {"split", "split_with_sizes", "unsafe_split", "unsafe_split_with_sizes"}
# layout ops that can put padded rows before real ones along a batch-sized dim (real rows no longer a prefix)
_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias"}
# ops sliding a window along their spatial dims (2 on, after batch and channels)
_WINDOWS = {"convolution", "_convolution", "max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d", "avg_pool3d"}
_WINDOWS |= {"max_pool2d_with_indices", "max_pool3d_with_indices", "_adaptive_avg_pool2d", "adaptive_max_pool2d"}
_SCATTERS = {"index_put", "index_put_", "index_copy", "index_copy_", "index_add", "index_add_", "scatter", "scatter_"}
_SCATTERS |= {"scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "_unsafe_index_put"}
_SCATTERS |= {"index_fill", "index_fill_"}
# ops indexing a tensor by index tensors, whose values fgraph/padding/_index_rules.py checks along the batch axis
_INDEXES = _SCATTERS | {"index", "_unsafe_index", "take"}


# ops that mix rows along the dims these return, for an input of `ndim` dims, though they keep every dim's size
def _last(k):
    return lambda node, ndim: set(range(max(ndim - k, 0), ndim))


def _normalized(node, ndim):
    return set(range(ndim - len(node.args[1]), ndim))  # native_layer_norm(input, normalized_shape, ...)


def _fft_dims(node, ndim):
    return {d % ndim for d in node.args[1]}  # _fft_*(self, dim, ...)


_SPANS = {"native_layer_norm": _normalized, "native_group_norm": lambda node, ndim: set(range(1, ndim))}
_SPANS.update({f"{kind}_pad{k}d": _last(k) for kind in ("replication", "reflection") for k in (1, 2, 3)})
_SPANS.update({name: _fft_dims for name in ("_fft_r2c", "_fft_c2c", "_fft_c2r")})
_SPANS.update({name: _last(2) for name in ("linalg_inv_ex", "_linalg_det", "_linalg_slogdet", "linalg_lu_factor_ex")})
_SPANS.update(
    {"_pdist_forward": lambda node, ndim: {0}, "renorm": lambda node, ndim: set(range(ndim)) - {node.args[2]}}
)
# ops whose scalar arguments are values (`x * x.shape[0]`, `arange(n) == n - 1`, `clamp(max=n - 1)`): a size taken
# there is the bucket's, where shapes (`view(n, -1)`, `arange(n)`) keep the call's rows a prefix
_VALUES = {"mul", "div", "add", "sub", "rsub", "pow", "remainder", "fmod", "floor_divide", "clamp", "clamp_min"}
_VALUES |= {"clamp_max", "eq", "ne", "lt", "le", "gt", "ge", "where", "masked_fill", "fill", "full", "scalar_tensor"}
_VALUES |= {"minimum", "maximum", "lerp", "addcmul", "addcdiv", "mul_", "add_", "sub_", "div_", "fill_"}


class Ctx(NamedTuple):
    """What the rules read beyond the node: the trace's batch axes, and the node's first tensor input."""

    name: str  # the op's schema name ("mean")
    axes: Any  # the trace's BatchAxes (fgraph/padding/_mixing.py)
    flow: Flow  # what index tensors hold (fgraph/padding/_index_flow.py)
    paths: dict  # placeholder -> its key path
    scratch: set  # the key paths whose scatters from padded rows are declared to land in scratch
    ins: list  # the node's fx inputs: its args, then those inside list args
    first: torch.Tensor | None  # the value of ins[0], when a tensor
    dims: set  # first's dims sized by a batch size
    syms: set  # the batch symbols of those dims


Hit = tuple  # (batch symbols, what the op does with the batch axis)
Rule = Callable[[fx.Node, Ctx], "Hit | None"]


def _writes_into_first(node: fx.Node) -> bool:
    """Whether an op writes into its first operand (copy_, add_, ...: `Tensor(a!) self`)."""
    args = node.target._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _after_writes(rule: Rule) -> Rule:
    """`rule`, unless the op writes in place into a batch-sized view of a tensor without the batch axis.

    `state[: x.shape[0]] = x`, `buf[:n].add_(x)`: the view spans the bucket's rows, so padded rows land in rows
    eager leaves alone. That write is the finding (none when the tensor is declared scratch), whatever `rule` says.
    """

    @functools.wraps(rule)
    def checked(node: fx.Node, ctx: Ctx) -> Hit | None:
        if ctx.dims and _writes_into_first(node):
            base = _fx.base_of(node.args[0])
            if not ctx.axes.dims(_fx.val(base)):
                target = ctx.paths.get(base, "a tensor without the batch axis")
                if root_of(target) not in ctx.scratch:
                    return ctx.syms, f"writes a slice as long as the batch into {target}: padded rows write too"
                return None
        return rule(node, ctx)

    return checked


@_after_writes
def reads(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Reads rows by index, or only metadata: no rows combine.

    Only an in-place write through a batch-sized view (copy_ into a slice of state) is reported."""
    return None


@_after_writes
def reduces(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Any other op: a reduction over the batch axis when its output has fewer batch-sized dims than an input.

    The default for ops of no kind, and where a kind's rule finds nothing of its own to say about the node."""
    axes = ctx.axes
    out, most = _fx.val(node), max((len(axes.dims(_fx.val(a))) for a in ctx.ins), default=0)
    if isinstance(out, torch.Tensor) and len(axes.dims(out)) < most:
        syms = set().union(*(axes.syms_of(s) for a in ctx.ins for s in _fx.shape(_fx.val(a))))
        return syms, "reduces over the batch axis: padded rows take part"
    return None


def along(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Combines rows along its `dim` / `dims` (softmax, sort, flip, ...): reported when that is a batch dim.

    The axis keeps its size, so the reduction check would not see it; every row of it takes part."""
    first = ctx.first
    if ctx.name == "roll":  # shifted by a batch size: the bucket's, not the call's (`x.roll(n)`, any dim)
        shifts = [_fx.val(a) for a in _fx.arg(node, "shifts", ())]
        sized = [v.node.expr for v in shifts if isinstance(v, torch.SymInt) and ctx.axes.syms_of_expr(v.node.expr)]
        if sized:
            return ctx.axes.syms_of_expr(sized[0]), f"shifts by {ctx.axes.name(sized[0])}: the bucket's, not the call's"
    if first is None:
        return reduces(node, ctx)
    dim = _fx.arg(node, "dims", None) if ctx.name in ("flip", "roll") else _fx.arg(node, "dim", None)
    over = [dim] if isinstance(dim, int) else list(dim) if dim else list(range(first.dim()))
    over = [d % first.dim() for d in over] if first.dim() else over
    if any(d in ctx.dims for d in over):
        return ctx.syms, f"{ctx.name} along the batch axis: padded rows take part"
    return None


def batch_stats(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Batch norm in training mode: its statistics span every dim but the channels (1), a batch dim among them.

    In eval mode it reads running statistics only: per row."""
    first = ctx.first
    if first is None:
        return reduces(node, ctx)
    if not _fx.arg(node, "training", True):
        return None
    if any(d in ctx.dims for d in range(first.dim()) if d != 1):
        return ctx.syms, f"{ctx.name} along the batch axis: padded rows take part"
    return None


def attends(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Attention with the batch axis as its sequence (dim -2): padded rows are keys every real query sees.

    Causal attention is exempt: real queries never see the padded keys after them."""
    first = ctx.first
    if first is None or first.dim() - 2 not in ctx.dims:
        return reduces(node, ctx)
    if not _fx.arg(node, "is_causal", False):
        return ctx.syms, "attends over the batch axis: padded rows are keys of real ones"
    return None


def spans(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Mixes rows along the dims _SPANS gives for it (layer norm, padding modes, FFTs, ...), keeping their sizes.

    Reported when one of them is a batch dim."""
    first = ctx.first
    if first is not None and ctx.dims & _SPANS[ctx.name](node, first.dim()):
        return ctx.syms, f"{ctx.name} mixes rows along the batch axis: padded rows take part"
    return reduces(node, ctx)


def values(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Takes a batch size as a value (`x * x.shape[0]`, `clamp(max=n - 1)`): the bucket's, not the call's.

    Without one, the op is checked as any other."""
    axes = ctx.axes
    sized = [_fx.val(a) for a in (*node.args, *node.kwargs.values())]
    sized = [v.node.expr for v in sized if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))]
    sized = [e for e in sized if axes.syms_of_expr(e)]
    if sized:
        return axes.syms_of_expr(sized[0]), f"uses {axes.name(sized[0])} as a value: the bucket's, not the call's"
    return reduces(node, ctx)


def contracts(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Contracts a batch dim (mm, bmm, ...: the operand and dim from _CONTRACT): a sum over rows.

    Padded rows add into every real result."""
    k, d = _CONTRACT[ctx.name]
    v = _fx.val(node.args[k]) if k < len(node.args) else None
    if v is not None and d in ctx.axes.dims(v):
        return ctx.axes.syms_of(v.shape[d]), "contracts the batch axis (a sum over rows): padded rows add in"
    return None


def selects(node: fx.Node, ctx: Ctx) -> Hit | None:
    """select / slice: an index or start computed from the batch size, or a negative one along a batch dim.

    Either is the padded size's row, not the call's. An end alone (`w[: x.shape[0]]`, `offsets[:-1]`, `x[: n -
    1]`) keeps a prefix, whose rows are the call's own once the output is cut back."""
    axes, name, first = ctx.axes, ctx.name, ctx.first
    if not ctx.dims:  # rows of a tensor without the batch axis from a start computed from it (`w[x.shape[0]:]`)
        start = _fx.val(_fx.arg(node, "index" if name == "select" else "start"))
        if axes.syms_of(start):
            return axes.syms_of(start), f"starts at {axes.name(start)}, computed from the padded batch size"
        return None
    d = _fx.arg(node, "dim", 0) % first.dim()
    ends = [_fx.arg(node, "index")] if name == "select" else [_fx.arg(node, "start"), _fx.arg(node, "end")]
    if d not in ctx.dims:
        return None
    neg = [e for e in ends[:1] if isinstance(e, int) and 0 > e]
    if neg:
        return ctx.syms, f"index {neg[0]} counts from the end of the padded batch axis (a padded row)"
    # an index or start computed from the batch size (`x[x.shape[0] - 1]`, `x[n - 2:]`), but not the whole size
    whole = axes.canon(first.shape[d])
    sized = [e for e in map(_fx.val, ends[:1]) if axes.syms_of(e) and axes.canon(e) != whole]
    if sized:
        return ctx.syms, f"index {axes.name(sized[0])} is computed from the padded batch size (a padded row)"
    return None


def splits(node: fx.Node, ctx: Ctx) -> Hit | None:
    """split along a batch dim into pieces whose sizes are computed from the batch size (`x.chunk(2)`,
    `x.split(n // 2)`): every piece after the first starts at the bucket's row, not the call's.

    A constant size (`x.split(2)`) keeps each piece's rows the call's; its count is a branch on N (a guard)."""
    first = ctx.first
    if first is None or not ctx.dims:
        return reads(node, ctx)
    d = _fx.arg(node, "dim", 0) % first.dim()
    if d not in ctx.dims:
        return reads(node, ctx)
    size = _fx.arg(node, "split_sizes" if "sizes" in ctx.name else "split_size")
    before = list(size)[:-1] if isinstance(size, (list, tuple)) else [size]  # sizes that place a later piece
    before = [_fx.val(s) if isinstance(s, fx.Node) else s for s in before]  # (a size traced as a node: its value)
    whole = ctx.axes.canon(first.shape[d])
    sized = [s for s in before if ctx.axes.syms_of(s) and ctx.axes.canon(s) != whole]
    if sized:
        return ctx.syms, f"splits at {ctx.axes.name(sized[0])}, computed from the padded batch size (a padded row)"
    return reads(node, ctx)


def counts(node: fx.Node, ctx: Ctx) -> Hit | None:
    """arange from a start computed from the batch size (`arange(n - 1, -1, -1)`): it counts from the padded one.

    A batch-sized end (`arange(n)`) is a shape: its first rows are the call's."""
    start = _fx.val(_fx.arg(node, "start"))
    if ctx.axes.syms_of(start):
        return ctx.axes.syms_of(start), f"counts from {ctx.axes.name(start)}, the padded batch size"
    return None


def concatenates(node: fx.Node, ctx: Ctx) -> Hit | None:
    """cat along a batch dim of any tensor but the last: padded rows land between real ones.

    The last tensor's padded rows come after every real row, where cutting the output back drops them."""
    first = ctx.first
    tensors = [_fx.val(t) for t in node.args[0]]
    d = _fx.arg(node, "dim", 0)
    d = d % first.dim() if first is not None and first.dim() else d
    if any(d in ctx.axes.dims(t) for t in tensors[:-1]):
        return ctx.syms, "concatenates along the batch axis: padded rows land between real ones"
    return None


def scatters(node: fx.Node, ctx: Ctx) -> Hit | None:
    """Scatters rows of a batch axis into a tensor without one (state): padded rows write too.

    Not reported into a tensor declared scratch, where writes from padded rows are expected."""
    axes, first = ctx.axes, ctx.first
    src = [_fx.val(a) for a in ctx.ins[1:]]
    if any(axes.dims(v) for v in src) and not axes.dims(first):
        target = ctx.paths.get(_fx.base_of(node.args[0]), "a tensor without the batch axis")
        if root_of(target) not in ctx.scratch:
            s = set().union(*(axes.syms_of(v.shape[d]) for v in src for d in axes.dims(v)))
            return s, f"writes rows of the batch axis into {target}: padded rows write too"
    return None


def views(node: fx.Node, ctx: Ctx) -> Hit | None:
    """A reshape merging a batch dim under static outer rows ((2, N) -> (2N)): padded rows land among real ones.

    The second copy's real rows then come after the first's padded ones, so real rows are no longer a prefix."""
    if not ctx.dims:
        return reduces(node, ctx)
    out = _fx.val(node)
    p, q = min(ctx.dims), min(ctx.axes.dims(out), default=None)
    before_in, before_out = _static_numel(ctx.first.shape[:p]), _static_numel(_fx.shape(out)[:q] if q else ())
    if q is not None and None not in (before_in, before_out) and before_in != before_out:
        return ctx.syms, f"merges the batch axis under {before_in} outer rows: padded rows land among real ones"
    return None


def repeats(node: fx.Node, ctx: Ctx) -> Hit | None:
    """repeat along a batch dim: each copy's padded rows land before the next copy's real ones."""
    if not ctx.dims:
        return reduces(node, ctx)
    reps = list(_fx.arg(node, "repeats", []))[-ctx.first.dim() :]
    if any(d < len(reps) and reps[d] != 1 for d in ctx.dims):
        return ctx.syms, "repeats along the batch axis: padded rows land among real ones"
    return None


def pads(node: fx.Node, ctx: Ctx) -> Hit | None:
    """constant_pad_nd appending after a batch dim's rows: they land after the padded rows, not the real ones.

    Padding before the rows shifts real and padded rows alike: they stay in order."""
    if not ctx.dims:
        return reduces(node, ctx)
    pad, n = list(_fx.arg(node, "pad", [])), ctx.first.dim()  # (last dim's left, right, the one before's left, ...)
    if any(2 * (n - 1 - d) + 1 < len(pad) and pad[2 * (n - 1 - d) + 1] for d in ctx.dims):
        return ctx.syms, "appends after the batch axis's rows: they land after the padded rows"
    return None


def windows(node: fx.Node, ctx: Ctx) -> Hit | None:
    """A convolution or pooling with a batch dim among its spatial dims (2 on): padded rows reach real ones.

    Along batch (0) or channels (1) it works per row, and is checked as any other op."""
    if any(d >= 2 for d in ctx.dims):
        return ctx.syms, f"{ctx.name} slides along the batch axis: padded rows reach real ones"
    return reduces(node, ctx)


def _indexed(rule: Rule) -> Rule:
    """`rule`, after the check of the op's index tensors (fgraph/padding/_index_rules.py), whose hit is the finding.

    That check finds negative indices along the batch axis, and scatters into it by index rows the padding points
    at real rows."""

    @functools.wraps(rule)
    def checked(node: fx.Node, ctx: Ctx) -> Hit | None:
        hit = index_finding(node, ctx.name, ctx.flow)
        return hit if hit is not None else rule(node, ctx)

    return checked


# each op's rule, by kind; where an op is of two kinds, the later entry wins (select and slice are reads, but
# `selects` checks them), and ops indexed by index tensors (_INDEXES) have that checked first
RULES: dict[str, Rule] = {
    **dict.fromkeys(_READS, reads),
    **dict.fromkeys(_WINDOWS, windows),
    "constant_pad_nd": pads,
    "repeat": repeats,
    **dict.fromkeys(_VIEWS, views),
    **dict.fromkeys(_SCATTERS, scatters),
    "cat": concatenates,
    "arange": counts,
    "select": selects,
    "slice": selects,
    **dict.fromkeys(_SPLITS, splits),
    **dict.fromkeys(_CONTRACT, contracts),
    **dict.fromkeys(_VALUES, values),
    **dict.fromkeys(_SPANS, spans),
    **dict.fromkeys(_BATCH_STATS, batch_stats),
    **dict.fromkeys(_ALONG, along),
}
RULES.update({name: _indexed(RULES.get(name, reduces)) for name in _INDEXES})
# ops known by a prefix of their name: attention's variants, the new_* factories and sym_* size reads
PREFIXES: dict[str, Rule] = {"_scaled_dot_product": attends, "new_": reads, "sym_": reads}


def _numbers(rule: Rule) -> Rule:
    """`rule`, after a check of the op's Scalar arguments (`number` in its schema: a fill value, `alpha`, `value`):
    a batch size passed there is a value, the bucket's (`x.new_full((2,), n)`, `x.index_fill(1, i, n)`,
    `torch.addmm(x, a, b, alpha=n)`), whatever kind the op is of; its shape arguments (`SymInt`) are not values."""

    @functools.wraps(rule)
    def checked(node: fx.Node, ctx: Ctx) -> Hit | None:
        schema = getattr(node.target, "_schema", None)
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            if "number" not in str(a.type) or a.kwarg_only and a.name not in node.kwargs:
                continue
            v = _fx.val(node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name))
            e = v.node.expr if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) else None
            if e is not None and ctx.axes.syms_of_expr(e):
                return ctx.axes.syms_of_expr(e), f"uses {ctx.axes.name(e)} as a value: the bucket's, not the call's"
        return rule(node, ctx)

    return checked


def rule_of(name: str) -> Rule:
    """The rule for an op: its own, else its prefix's, else `values` (a batch size passed as a scalar argument is
    a value: `linspace(0, n, k)`, `full_like(x, n)`, `ones << n`), then `reduces`. Every op's Scalar arguments are
    checked first (_numbers), but arange's, whose end is a shape (`arange(n)`: `counts`)."""
    rule = _RULES_OF.get(name)
    if rule is None:
        rule = RULES.get(name)
        if rule is None:
            rule = next((r for p, r in PREFIXES.items() if name.startswith(p)), values)
        rule = _RULES_OF[name] = rule if name == "arange" or rule is values else _numbers(rule)
    return rule


_RULES_OF: dict[str, Rule] = {}
