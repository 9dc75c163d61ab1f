"""What index tensors hold, followed through a symbolic trace.

The data flow behind the padding check's rules on indexing along a batch axis (fgraph/padding/_mixing.py).

Two facts per tensor, each only as far as it is cheap to follow and sound:
  - `low`, a lower bound of the values the trace itself makes in a call's rows (constants, aranges, fills and
    what arithmetic makes of them): an index that can be negative counts from the end of the padded axis, a
    padded row. Values from the caller (arguments, lifted tensors) are data the check cannot see at trace time:
    it takes them, and what the trace computes from them, as valid indices (`low` is inf for them).
  - `pad`, what the padding puts in the padded rows along the tensor's batch dim: a fill value, a "ramp" of
    offsets, or row numbers (an arange over the batch), through shifts, casts, slices and views. A scatter by an
    index writes where its padded rows point; unless that is a padded row, padded rows write real ones.
A tensor written in place anywhere in the trace is not followed (its facts are unknown: low -inf, pad None).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from .. import _fx

INF = math.inf


def _num(x):
    """A plain Python number (a bool as an int), or None (a tensor, or a size traced as a symbol)."""
    return int(x) if isinstance(x, bool) else x if isinstance(x, (int, float)) else None


class Pad(NamedTuple):
    """What the padded rows along a tensor's batch dim `dim` hold."""

    kind: str  # "fill": each holds `shift`; "rows": padded row j holds j + shift; "ramp": see `first`
    dim: int
    shift: float = 0
    # "ramp" (a Batched(pad="ramp") offsets leaf, [S+1]: padded row S+i holds min(R + i, B), R its last real value,
    # B the bucket), shifted by `shift`: its padded rows hold the ramp from i = `first` on. 1 for the leaf and its
    # suffixes (`offsets[1:]`); 0 once a slice one row short (`offsets[:-1]`) made the row holding R a padded one
    first: int = 1
    src: str | None = None  # the key path of the Batched leaf whose padding this is (None: the trace's own)


class Fact(NamedTuple):
    low: float  # the trace's own values in a call's rows are >= low; inf: all the caller's; -inf: not known
    pad: Pad | None  # None: not followed (or no batch dim)


UNKNOWN = Fact(-INF, None)
# ops whose value is their first operand's, dtype aside
_SAME = {"clone", "_to_copy", "lift_fresh_copy", "alias", "detach", "contiguous", "to", "type_as"}
# ops that move dims without changing a row's values; the reshapes must keep the rows before the batch dim
_MOVES = {"unsqueeze", "squeeze", "expand", "expand_as", "permute", "transpose", "t", "movedim"}
_RESHAPES = {"view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "reshape_as"}
# ops reading values of their first operand (by index or in bulk): their values are among its values
_GATHERS = {"index", "_unsafe_index", "index_select", "gather", "take", "take_along_dim", "embedding"}
_GATHERS |= {"narrow", "diagonal", "flip", "roll", "repeat", "amax", "amin", "max", "min", "sort", "unbind", "split"}
_GATHERS |= {"split_with_sizes", "chunk", "unsafe_split", "cummax", "cummin"}
# ops whose values are positions or counts: never negative
_COUNTS = {"argmax", "argmin", "argsort", "searchsorted", "bucketize", "nonzero", "bincount", "count_nonzero"}
_COUNTS |= {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "isnan"}
_COUNTS |= {"isin", "isinf", "isfinite", "signbit"}
# multi-output ops whose second output is indices (sort's, topk's, max.dim's)
_INDICES_SECOND = {"sort", "topk", "kthvalue", "mode", "median", "max", "min", "cummax", "cummin", "nanmedian"}
# tensors of one value: that value, or the argument that holds it
_FILLS = {"zeros": 0, "ones": 1, "zeros_like": 0, "ones_like": 1, "new_zeros": 0, "new_ones": 1}
_FILLS.update({"full": "fill_value", "full_like": "fill_value", "new_full": "fill_value", "scalar_tensor": "s"})
_FILLS["fill"] = "value"


class Flow:
    """Facts of the tensors of one trace, computed on demand (most of a model's trace is never an index).

    specs: placeholder -> its Batched spec (batched leaves only); paths: placeholder -> its key path."""

    def __init__(self, gm: fx.GraphModule, axes, specs: dict, paths: dict | None = None):
        self.gm, self.axes, self.specs, self._facts = gm, axes, specs, {}
        self.paths = paths or {}
        self._written: set | None = None  # the tensors written in place anywhere (found at the first question)

    def fact(self, node) -> Fact:
        """The facts of a node's tensor (post-order over its inputs, without recursion: chains can be long)."""
        if not isinstance(node, fx.Node):
            n = _num(node)
            return Fact(n if n is not None else -INF, None)
        if self._written is None:
            self._written = {_fx.base_of(t) for n in self.gm.graph.nodes for t in _fx.write_targets(n)}
        stack = [node]
        while stack:
            n = stack[-1]
            if n in self._facts:
                stack.pop()
                continue
            todo = [a for a in n.all_input_nodes if a not in self._facts]
            if todo:
                stack.extend(todo)
                continue
            self._facts[n] = UNKNOWN if _root(n) in self._written else self._transfer(n)
            stack.pop()
        return self._facts[node]

    def _transfer(self, n: fx.Node) -> Fact:
        if n.op == "placeholder":
            spec, v = self.specs.get(n), _fx.val(n)
            if spec is None or not isinstance(v, torch.Tensor):
                return Fact(INF, None)
            src = self.paths.get(n)
            if isinstance(spec.pad, str):  # "ramp"
                return Fact(INF, Pad("ramp", spec.axis, src=src))
            return Fact(INF, Pad("fill", spec.axis, _num(spec.pad), src=src) if _num(spec.pad) is not None else None)
        if n.op == "get_attr":  # a constant the function made (`torch.tensor([-1])`): its values are known
            t = getattr(self.gm, n.target, None)
            if isinstance(t, torch.Tensor) and t.numel() and not t.is_complex():
                return Fact(float(t.min()), None)
            return Fact(INF, None)
        if n.op != "call_function":
            return UNKNOWN
        if n.target is operator.getitem:
            src, i = n.args[0], n.args[1]
            if isinstance(src, fx.Node) and isinstance(src.target, torch._ops.OpOverload):
                if i == 1 and _fx.op_name(src) in _INDICES_SECOND:
                    return Fact(0, None)
                first = src.args[0] if src.args else None
                if _fx.op_name(src) in _GATHERS or _fx.op_name(src) in _INDICES_SECOND:
                    return Fact(self.fact(first).low, None)
            return UNKNOWN
        if not isinstance(n.target, torch._ops.OpOverload):
            return UNKNOWN
        out = _fx.val(n)
        if not isinstance(out, torch.Tensor):  # a size (non-negative), or a number computed from sizes
            return Fact(0, None) if n.target is torch.ops.aten.sym_size.int else UNKNOWN
        return self._op(n, _fx.op_name(n), out)

    def _op(self, n: fx.Node, name: str, out) -> Fact:
        args = n.args
        x = self.fact(args[0]) if args and isinstance(args[0], fx.Node) else None
        if name in _SAME:
            return Fact(x.low, self._cast(x.pad, out))
        if name in _MOVES or name in _RESHAPES:
            return Fact(x.low, self._moved(x.pad, _fx.val(args[0]), out, name in _RESHAPES))
        if name == "slice":
            return Fact(x.low, self._sliced(n, x.pad))
        if name == "select":  # one row along a dim: the pad's dim moves down past it, or is gone
            d, p = _fx.arg(n, "dim") % _fx.val(args[0]).dim(), x.pad
            return Fact(x.low, None if p is None or d == p.dim else p._replace(dim=p.dim - (d < p.dim)))
        if name in ("max", "min") and n.target._overloadname == "other":
            name = "maximum" if name == "max" else "minimum"  # elementwise, of two tensors
        elif name in _GATHERS:
            return Fact(x.low, None)
        if name in _COUNTS:
            return Fact(0, None)
        if name in ("abs", "relu"):
            return Fact(
                INF if x.low == INF else 0, _mapped(x.pad, lambda v: max(v, -v) if name == "abs" else max(v, 0))
            )
        if name == "arange":
            return self._arange(n, out)
        if name in _FILLS:
            v = _num(_fx.arg(n, _FILLS[name])) if isinstance(_FILLS[name], str) else _FILLS[name]
            return Fact(v if v is not None else -INF, self._filled(v, out))
        if name in ("cat", "stack"):
            return Fact(min((self.fact(t).low for t in args[0]), default=INF), None)
        return self._arith(n, name, x, out)

    def _arith(self, n: fx.Node, name: str, x: Fact | None, out) -> Fact:
        """Elementwise arithmetic: a bound through shifts and scales by numbers, a fill through any number op."""
        if x is None:
            return UNKNOWN
        other = n.args[1] if len(n.args) > 1 else None
        c = _num(other) if not isinstance(other, fx.Node) else None
        y = self.fact(other) if isinstance(other, fx.Node) else None
        alpha = _num(_fx.arg(n, "alpha", 1)) or 0
        if name in ("add", "sub") and c is not None:
            d = c * alpha if name == "add" else -c * alpha
            return Fact(x.low + d, _shifted(x.pad, d))
        if name == "add" and y is not None:
            if INF in (x.low, y.low) or alpha == 0:
                return Fact(INF if INF in (x.low, y.low) else x.low, None)
            return Fact(x.low + alpha * y.low if alpha > 0 else -INF, None)
        if name in _SCALED and c is not None:
            f = functools.partial(_SCALED[name], c=c, rounding=_fx.arg(n, "rounding_mode"))
            return Fact(_scaled_low(name, x.low, c, f), _scaled_pad(name, x.pad, c, f))
        if name == "neg" or (name == "rsub" and c is not None):
            pad = _mapped(x.pad, (lambda v: -v) if name == "neg" else (lambda v: c - alpha * v))
            return Fact(INF if x.low == INF else -INF, pad)
        if name in ("clamp", "clamp_min", "clamp_max"):  # max(x, lo) >= lo; min(x, hi) >= the least hi
            lo = _fx.arg(n, "min") if name != "clamp_max" else None
            hi = _fx.arg(n, "max") if name != "clamp_min" else None
            low = max(x.low, self.fact(lo).low) if lo is not None else x.low
            low = min(low, self.fact(hi).low) if hi is not None else low
            lo, hi = (-INF if lo is None else _num(lo)), (INF if hi is None else _num(hi))
            return Fact(low, _mapped(x.pad, lambda v: min(max(v, lo), hi)) if None not in (lo, hi) else None)
        if name in ("where", "masked_fill", "maximum", "minimum"):
            parts = n.args[1:] if name == "where" else n.args[::2] if name == "masked_fill" else n.args
            lows = [self.fact(a).low for a in parts]
            return Fact(max(lows) if name == "maximum" else min(lows), None)
        if name in ("sum", "cumsum"):  # sums of non-negative values
            return Fact(INF if x.low == INF else 0 if x.low >= 0 else -INF, None)
        inputs = [self.fact(a).low for a in n.all_input_nodes]
        return Fact(INF if inputs and all(v == INF for v in inputs) else -INF, None)

    def _arange(self, n: fx.Node, out) -> Fact:
        start, end, step = _fx.arg(n, "start", 0), _fx.arg(n, "end"), _num(_fx.arg(n, "step", 1))
        s = _num(start)
        if step is None or s is None:
            return UNKNOWN  # a start computed from the batch size is reported by its own rule
        low = s if step > 0 else _num(end) if _num(end) is not None else -INF
        dims = self.axes.dims(out)
        return Fact(low, Pad("rows", 0, s) if step == 1 and dims == {0} else None)

    def _filled(self, v, out) -> Pad | None:
        dims = self.axes.dims(out)
        return Pad("fill", next(iter(dims)), v) if v is not None and len(dims) == 1 else None

    def _cast(self, pad: Pad | None, out) -> Pad | None:
        if pad is None or pad.kind != "fill" or not isinstance(out, torch.Tensor) or out.is_floating_point():
            return pad
        # a cast to an integer type truncates the fill value, one to bool makes it 0 or 1
        return pad._replace(shift=int(bool(pad.shift)) if out.dtype == torch.bool else int(pad.shift))

    def _moved(self, pad: Pad | None, x, out, reshape: bool) -> Pad | None:
        """A pad through a view.

        The batch dim is where the output has its one batch-sized dim, of the same size; a reshape must also
        keep the rows before it (a [2, N] -> [2N] view interleaves padded and real rows)."""
        if pad is None or not isinstance(out, torch.Tensor):
            return None
        dims = self.axes.dims(out)
        if len(dims) != 1 or len(self.axes.dims(x)) != 1:
            return None
        d = next(iter(dims))
        if self.axes.canon(out.shape[d]) != self.axes.canon(x.shape[pad.dim]):
            return None
        if reshape and _static_numel(x.shape[: pad.dim]) != _static_numel(out.shape[:d]):
            return None
        return pad._replace(dim=d)

    def _sliced(self, n: fx.Node, pad: Pad | None) -> Pad | None:
        """A pad through x[start:end] along its batch dim.

        Rows shift by start; the padded rows are the source's when the slice runs to the end, and take its last
        real rows when the end is short of it by a few."""
        if pad is None:
            return None
        x, dim = _fx.val(n.args[0]), _fx.arg(n, "dim", 0) % _fx.val(n.args[0]).dim()
        if dim != pad.dim:
            return pad
        # (bounds computed from sizes are nodes of the trace: their traced values are SymInts)
        start, end, step = (
            _fx.val(a) if isinstance(a, fx.Node) else a
            for a in (_fx.arg(n, "start"), _fx.arg(n, "end"), _fx.arg(n, "step", 1))
        )
        start = 0 if start is None else start
        if step != 1 or not isinstance(start, int) or start < 0:  # (a start from the batch size is reported)
            return None
        if end is None or (isinstance(end, int) and end >= 2**62):
            short = 0
        elif isinstance(end, int):
            short = end if end < 0 else None  # a static end: the result has no batch dim
        else:
            diff = self.axes.canon(end) - self.axes.canon(x.shape[dim])
            short = int(diff) if getattr(diff, "is_Integer", False) and diff <= 0 else None
        if short is None:
            return None
        if pad.kind == "rows":
            return pad._replace(shift=pad.shift + start)
        if short == 0:
            return pad
        return pad._replace(first=pad.first - 1) if pad.kind == "ramp" and short == -1 and pad.first == 1 else None


def _root(n: fx.Node):
    """The tensor a node's memory belongs to, through views and in-place ops (`x[1:].add_(1)` -> x)."""
    while True:
        b = _fx.base_of(n)
        t = getattr(b, "target", None)
        rets = t._schema.returns if isinstance(t, torch._ops.OpOverload) else ()
        if rets and rets[0].alias_info is not None and rets[0].alias_info.is_write and b.args:
            n = b.args[0]
            continue
        return b


def _static_numel(sizes) -> int | None:
    """The product of sizes, or None if one is symbolic."""
    n = 1
    for x in sizes:
        if not isinstance(x, int):
            return None
        n *= x
    return n


def _shifted(pad: Pad | None, d) -> Pad | None:
    return pad._replace(shift=pad.shift + d) if pad is not None else None


def _mapped(pad: Pad | None, f) -> Pad | None:
    """A fill through a function of its value; other pads are not followed through anything but shifts."""
    return pad._replace(shift=f(pad.shift)) if pad is not None and pad.kind == "fill" else None


# number ops applied to a value (a fill, or a bound: each is non-decreasing in it for c > 0)
_SCALED = {
    "mul": lambda v, c, rounding: v * c,
    "div": lambda v, c, rounding: (
        v / c if rounding is None else math.floor(v / c) if rounding == "floor" else math.trunc(v / c)
    ),
    "floor_divide": lambda v, c, rounding: v // c,
    "remainder": lambda v, c, rounding: v % c,
}


def _scaled_low(name: str, low: float, c, f) -> float:
    if low == INF:  # the caller's values, scaled: still the caller's
        return INF
    if c <= 0:
        return 0 if name == "mul" and c == 0 else -INF
    if name == "remainder":  # Python's sign: that of the divisor
        return 0
    return low if low == -INF else f(low)


def _scaled_pad(name: str, pad: Pad | None, c, f) -> Pad | None:
    if name == "mul" and c == 1:
        return pad
    return _mapped(pad, f) if c != 0 or name == "mul" else None
