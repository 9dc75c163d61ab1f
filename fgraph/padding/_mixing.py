"""Padding made visible: what a symbolic trace says about the batch axis, used at trace time and per call.

A signature pads every Batched leaf to its bucket. That is invisible only to per-row work; this module finds, on
the trace (batch axes are sympy symbols there), the ops whose result the padded rows can change (reductions,
softmax/sort along the axis, matmuls contracting it, negative indexing and indices computed from its size,
concatenation along it, scatters of its rows into state, writes through a view as long as it into a tensor
without it, layouts that put padded rows before real ones, windows sliding along it, Python branches on its size
that some call padded to a bucket would take differently; index tensors holding negative values along it, and
scatters into it by index rows the padding points at real rows: fgraph/padding/_index_rules.py), and the per-call checks
of batched leaves (tied lengths, memory shared with written state). Outputs are cut back to the unpadded call's in
fgraph/padding/_outputs.py.

Traces made at bucket 1 are static (no symbols): nothing here applies to them, and bucket 1 pads nothing unless
a call has no rows at all. A function first called at bucket 1 is checked at its first trace for a larger bucket.
"""

from __future__ import annotations

import os
import traceback
from typing import NamedTuple

import sympy
import torch
import torch.fx as fx

from .. import _fx
from .. import _primitives as P
from .._errors import SignatureError
from .._state import root_of
from ._index_flow import Flow, _static_numel
from ._index_rules import index_finding
from ._ops import _ALONG, _BATCH_STATS, _CONTRACT, _INDEXES, _READS, _SCATTERS, _SPANS, _VALUES, _VIEWS, _WINDOWS


class Finding(NamedTuple):
    """One place where padding can change the answer."""

    op: str  # "aten.mean", or "branch"
    line: str  # the user's source line
    what: str  # what it does with the batch axis

    def __str__(self):
        return f"{self.op} at {self.line}: {self.what}"


class BatchAxes:
    """The batch symbols of a symbolic trace: one per batched leaf (its length, as traced: `raw`), and the same
    canonicalised through the trace's replacements (tokens and positions traced as s0 and s1 become one symbol
    once an op ties them), with the leaves each stands for."""

    def __init__(self, shapes, leaves: list[tuple[str, int, int, object]]):
        # leaves: per batched tensor leaf, in the order of shapes.syms: (key path, leaf index, axis, Batched)
        self.shapes, self.env, self._syms = shapes, shapes.shape_env, {}
        self.raw = {sym: (i, axis) for (sym, _), (_, i, axis, _) in zip(shapes.syms, leaves)}
        self.leaves = []  # (path, leaf index, axis, spec, canonical symbol, offset): size = symbol + offset
        for (sym, _), (path, i, axis, spec) in zip(shapes.syms, leaves):
            e = self.canon(sym)
            free = list(e.free_symbols)
            off = e - free[0] if len(free) == 1 else None
            off = int(off) if off is not None and off.is_Integer else None
            self.leaves.append((path, i, axis, spec, free[0] if off is not None else None, off))
        self.symbols = {leaf[4] for leaf in self.leaves if leaf[4] is not None}
        # a guard fixed a batch size to a constant (`if x.shape[0] == 8`): that trace serves that bucket only
        self.specialized = any(not getattr(self.canon(sym), "free_symbols", None) for sym in self.raw)

    def canon(self, expr):
        expr = expr.node.expr if isinstance(expr, torch.SymInt) else expr
        return self.env.replace(sympy.sympify(expr)) if isinstance(expr, sympy.Basic) else expr

    def dims(self, val) -> set[int]:
        """The dims of a traced tensor whose size depends on a batch size (a leaf's length)."""
        if not isinstance(val, torch.Tensor):
            return set()
        return {d for d, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and s.node.expr.free_symbols}

    def syms_of(self, size) -> set:
        """The canonical batch symbols a traced size depends on."""
        return self.syms_of_expr(size.node.expr) if isinstance(size, torch.SymInt) else set()

    def syms_of_expr(self, key) -> set:
        got = self._syms.get(key)
        if got is None:  # a model's trace has thousands of tensors over a handful of size expressions
            e = self.canon(key)
            got = self._syms[key] = (e.free_symbols & self.symbols) if isinstance(e, sympy.Basic) else set()
        return got

    def name(self, expr) -> str:
        """A traced size in the user's terms: `8 - Min(8, s0)` -> `8 - Min(8, state.shape[0])`."""
        e = expr.node.expr if isinstance(expr, torch.SymInt) else expr
        if not isinstance(e, sympy.Basic):
            return str(expr)
        names = {sym: sympy.Symbol(f"{leaf[0]}.shape[{leaf[2]}]") for sym, leaf in zip(self.raw, self.leaves)}
        names.update({leaf[4]: names[sym] for sym, leaf in zip(self.raw, self.leaves) if leaf[4] is not None})
        return str(e.xreplace(names))

    def at(self, expr, n: int):
        """A traced size or guard (sympy) in a call of n rows: each leaf's symbol at its length, n + its extra."""
        e = expr.node.expr if isinstance(expr, torch.SymInt) else expr
        sizes = {sym: n + leaf[3].extra for sym, leaf in zip(self.raw, self.leaves)}
        free = e.free_symbols & (set(self.raw) | self.symbols)
        return e.xreplace({sym: sympy.Integer(sizes.get(sym, n)) for sym in free})

    def falls(self, expr) -> bool:
        """Whether a traced size falls as the batch sizes grow (`8 - Min(8, s0)`), checked at a few sizes."""
        for n in (1, 7, 63):
            lo, hi = self.at(expr, n), self.at(expr, n + 1)
            if lo.is_number and hi.is_number and bool(hi < lo):
                return True
        return False

    def intended(self, syms: set) -> bool:
        """Every symbol involved stands for a leaf declared Batched(mixes=True)."""
        return bool(syms) and all(any(leaf[3].mixes for leaf in self.leaves if leaf[4] == s) for s in syms)

    def intended_raw(self, syms) -> bool:
        """The same for symbols as traced (before a guard replaced one with a number)."""
        raw = [self.raw[s][0] for s in syms if s in self.raw]
        return bool(raw) and all(leaf[3].mixes for leaf in self.leaves if leaf[1] in raw)


def find_mixing(
    gm: fx.GraphModule, axes: BatchAxes, scratch: set[str], paths: dict[fx.Node, str], buckets=()
) -> list[Finding]:
    """The ops of a symbolic trace that combine rows along a batch axis (so padded rows change real results),
    and the guards the trace took on a batch size. Break primitives (attention, MoE) are excluded: they own their
    padding contract. scratch: the key paths whose scatters from padded rows are declared to land in scratch."""
    found: dict[tuple, Finding] = {}

    def add(node, syms, what):
        # one finding per source line, its first op's: the rest follow from it (`w[n:].sum()`: the slice, not the
        # sum over its rows; `s[:n] += x`: the add_, not the copy_ back)
        line = node.meta.get("line", "<unknown>")
        if axes.intended(syms) or any(f.line == line for f in found.values()):
            return
        f = Finding(f"aten.{_fx.op_name(node)}", line, what)
        found.setdefault((f.op, f.line), f)

    specs = {leaf[0]: leaf[3] for leaf in axes.leaves}
    flow = Flow(gm, axes, {ph: specs[p] for ph, p in paths.items() if p in specs})  # what index tensors hold
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if P.primitive_of(node) is not None:
            continue
        name = _fx.op_name(node)
        if name in _INDEXES:  # negative indices along the batch axis, scatters by padded index rows into it
            hit = index_finding(node, name, flow)
            if hit is not None:
                add(node, *hit)
                continue
        ins = [a for a in node.args if isinstance(a, fx.Node)]
        ins += [x for a in node.args if isinstance(a, (list, tuple)) for x in a if isinstance(x, fx.Node)]
        first = _fx.val(ins[0]) if ins else None
        first = first if isinstance(first, torch.Tensor) else None
        dims = axes.dims(first)
        syms = set().union(*(axes.syms_of(first.shape[d]) for d in dims)) if dims else set()
        if (name in _ALONG or name in _BATCH_STATS) and first is not None:
            if name in _BATCH_STATS and not _fx.arg(node, "training", True):
                continue
            dim = _fx.arg(node, "dims", None) if name in ("flip", "roll") else _fx.arg(node, "dim", None)
            along = [dim] if isinstance(dim, int) else list(dim) if dim else list(range(first.dim()))
            along = [d % first.dim() for d in along] if first is not None and first.dim() else along
            if name in _BATCH_STATS:  # statistics over every dim but the channels
                along = [d for d in range(first.dim()) if d != 1]
            if any(d in dims for d in along):
                add(node, syms, f"{name} along the batch axis: padded rows take part")
            continue
        if name.startswith("_scaled_dot_product") and first is not None and first.dim() - 2 in dims:
            if not _fx.arg(node, "is_causal", False):  # causal: real queries never see the padded keys after them
                add(node, syms, "attends over the batch axis: padded rows are keys of real ones")
            continue
        if name in _SPANS and first is not None and dims & _SPANS[name](node, first.dim()):
            add(node, syms, f"{name} mixes rows along the batch axis: padded rows take part")
            continue
        if name in _VALUES:
            sized = [_fx.val(a) for a in (*node.args, *node.kwargs.values())]
            sized = [v.node.expr for v in sized if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))]
            sized = [e for e in sized if axes.syms_of_expr(e)]
            if sized:
                add(
                    node,
                    axes.syms_of_expr(sized[0]),
                    f"uses {axes.name(sized[0])} as a value: the bucket's, not the call's",
                )
                continue
        if name in _CONTRACT:
            k, d = _CONTRACT[name]
            v = _fx.val(node.args[k]) if k < len(node.args) else None
            if v is not None and d in axes.dims(v):
                add(node, axes.syms_of(v.shape[d]), "contracts the batch axis (a sum over rows): padded rows add in")
            continue
        if name in ("select", "slice") and not dims:
            # rows of a tensor without the batch axis from a start computed from the batch size (`w[x.shape[0]:]`):
            # the padded size's rows, not the call's (an end alone, `w[: x.shape[0]]`, keeps rows aligned)
            start = _fx.val(_fx.arg(node, "index" if name == "select" else "start"))
            if axes.syms_of(start):
                add(node, axes.syms_of(start), f"starts at {axes.name(start)}, computed from the padded batch size")
            continue
        if name in ("select", "slice") and dims:
            d = _fx.arg(node, "dim", 0) % first.dim()
            ends = [_fx.arg(node, "index")] if name == "select" else [_fx.arg(node, "start"), _fx.arg(node, "end")]
            if d not in dims:
                continue
            # a negative index or start reads from the padded end; a negative end alone (`offsets[:-1]`) keeps a
            # prefix, whose rows are the call's own once the output is cut back
            neg = [e for e in ends[:1] if isinstance(e, int) and 0 > e]
            if neg:
                add(node, syms, f"index {neg[0]} counts from the end of the padded batch axis (a padded row)")
            # an index or start computed from the batch size (`x[x.shape[0] - 1]`, `x[n - 2:]`): the padded size,
            # not the call's; an end computed from it (`x[: n - 1]`, `narrow`) keeps a prefix, as above
            whole = axes.canon(first.shape[d])
            sized = [e for e in map(_fx.val, ends[:1]) if axes.syms_of(e) and axes.canon(e) != whole]
            if sized:
                add(node, syms, f"index {axes.name(sized[0])} is computed from the padded batch size (a padded row)")
            continue
        if name == "arange":  # values counted from the batch size (`arange(n - 1, -1, -1)`): from the padded one
            start = _fx.val(_fx.arg(node, "start"))
            if axes.syms_of(start):
                add(node, axes.syms_of(start), f"counts from {axes.name(start)}, the padded batch size")
            continue
        if name == "cat":
            tensors = [_fx.val(t) for t in node.args[0]]
            d = _fx.arg(node, "dim", 0)
            d = d % first.dim() if first is not None and first.dim() else d
            if any(d in axes.dims(t) for t in tensors[:-1]):
                add(node, syms, "concatenates along the batch axis: padded rows land between real ones")
            continue
        if name in _SCATTERS:
            src = [_fx.val(a) for a in ins[1:]]
            if any(axes.dims(v) for v in src) and not axes.dims(first):
                target = paths.get(_fx.base_of(node.args[0]), "a tensor without the batch axis")
                if root_of(target) not in scratch:
                    s = set().union(*(axes.syms_of(v.shape[d]) for v in src for d in axes.dims(v)))
                    add(node, s, f"writes rows of the batch axis into {target}: padded rows write too")
            continue
        if dims and name in _VIEWS:  # (2, N) -> (2N): the second copy's real rows come after the first's padded
            out = _fx.val(node)
            p, q = min(dims), min(axes.dims(out), default=None)
            before_in, before_out = _static_numel(first.shape[:p]), _static_numel(_fx.shape(out)[:q] if q else ())
            if q is not None and None not in (before_in, before_out) and before_in != before_out:
                add(node, syms, f"merges the batch axis under {before_in} outer rows: padded rows land among real ones")
            continue
        if dims and name == "repeat":
            reps = list(_fx.arg(node, "repeats", []))[-first.dim() :]
            if any(d < len(reps) and reps[d] != 1 for d in dims):
                add(node, syms, "repeats along the batch axis: padded rows land among real ones")
            continue
        if dims and name == "constant_pad_nd":
            pads = list(_fx.arg(node, "pad", []))  # (last dim's left, right, the one before's left, right, ...)
            if any(2 * (first.dim() - 1 - d) + 1 < len(pads) and pads[2 * (first.dim() - 1 - d) + 1] for d in dims):
                add(node, syms, "appends after the batch axis's rows: they land after the padded rows")
            continue
        if name in _WINDOWS and any(d >= 2 for d in dims):
            add(node, syms, f"{name} slides along the batch axis: padded rows reach real ones")
            continue
        if dims and _writes_into_first(node):
            # an in-place write into a batch-sized view of a tensor without the batch axis (`state[: x.shape[0]] =
            # x`, `buf[:n].add_(x)`): the view spans the bucket's rows, so padded rows land in rows eager leaves
            base = _fx.base_of(node.args[0])
            if not axes.dims(_fx.val(base)):
                target = paths.get(base, "a tensor without the batch axis")
                if root_of(target) not in scratch:
                    add(node, syms, f"writes a slice as long as the batch into {target}: padded rows write too")
                continue
        if name in _READS or name.startswith("new_") or name.startswith("sym_"):
            continue
        out, most = _fx.val(node), max((len(axes.dims(_fx.val(a))) for a in ins), default=0)
        if isinstance(out, torch.Tensor) and len(axes.dims(out)) < most:
            syms = set().union(*(axes.syms_of(s) for a in ins for s in _fx.shape(_fx.val(a))))
            add(node, syms, "reduces over the batch axis: padded rows take part")
    for g in axes.env.guards:
        expr = g.expr
        if isinstance(expr, sympy.Eq) and all(side.free_symbols for side in expr.args):
            continue  # two batch sizes found equal (tokens and positions): a tie, checked per call (check_lengths)
        line = _guard_line(g) if expr.free_symbols & set(axes.raw) else None
        if line is None and _fixes_a_size(expr, axes):
            # a size computed from the batch size turned into a number inside an op (`x[x.shape[0] - 1]`): the
            # trace is specialised to this bucket, and the number is the padded size's, not the call's
            line = _line_using(gm, expr) or "<inside an op>"
        if line is None:  # a check inside torch or fgraph (topk's k <= size): a consequence of an op reported above
            continue
        if _same_for_every_call(expr, axes, buckets):  # `if N != 1` with bucket 1 traced on its own
            continue
        f = Finding("branch", line, f"Python code depends on the batch size ({expr}), which is the bucket here")
        syms = set().union(*(axes.syms_of_expr(s) for s in expr.free_symbols))
        if not (axes.intended(syms) or axes.intended_raw(expr.free_symbols)):
            found.setdefault((f.op, f.line), f)
    return list(found.values())


def _same_for_every_call(expr, axes: BatchAxes, buckets) -> bool:
    """Whether a guard on the batch size holds for every call this trace serves: for each bucket where it holds
    (the trace serves only those), for every batch size padded up to that bucket. Then eager takes the same branch
    (`N != 1` when bucket 1 has its own trace); `N > 4` with bucket 8 does not."""

    def holds(n: int) -> bool:
        return axes.at(expr, n) is sympy.true

    prev = 0
    for b in sorted(buckets):
        if holds(b) and not all(holds(n) for n in range(prev + 1, b)):
            return False
        prev = b
    return bool(buckets)


def _writes_into_first(node: fx.Node) -> bool:
    """Whether an op writes into its first operand (copy_, add_, ...: `Tensor(a!) self`)."""
    args = node.target._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _fixes_a_size(expr, axes: BatchAxes) -> bool:
    """Whether a guard pins an expression of a batch size to a number (Eq(s - 1, 7))."""
    if not isinstance(expr, sympy.Eq):
        return False
    fixed = [side for side in expr.args if side.free_symbols & set(axes.raw)]
    return len(fixed) == 1 and any(side.is_Number for side in expr.args)


def _line_using(gm: fx.GraphModule, expr) -> str | None:
    """The source line of the first op taking the number a guard pinned a size to, as a plain int argument."""
    value = next((int(side) for side in expr.args if side.is_Number), None)
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(type(a) is int and a == value for a in node.args):
            return node.meta.get("line")
    return None


def _guard_line(guard) -> str | None:
    """The user's file:line that took a guard, or None when torch or fgraph took it."""
    loc = getattr(guard, "sloc", None)
    frame = getattr(loc, "framework_loc", None)
    if isinstance(frame, traceback.FrameSummary) and not frame.filename.startswith(_fx.FRAMEWORK_DIRS):
        return f"{os.path.relpath(frame.filename)}:{frame.lineno}"
    return getattr(loc, "maybe_user_loc", None)


def tied_lengths(axes: BatchAxes) -> list[tuple]:
    """Groups of batched leaves the trace ties to one batch size: [(path, leaf, axis, offset), ...] per symbol."""
    groups: dict = {}
    for path, i, axis, _, sym, off in axes.leaves:
        if sym is not None:
            groups.setdefault(sym, []).append((path, i, axis, off))
    return [g for g in groups.values() if len(g) > 1]


def check_lengths(fname: str, groups: list, leaves: list) -> None:
    """Leaves tied by the trace must have the same batch size in a call (the unpadded function would fail on
    them, or broadcast); padding them to one bucket would hide that."""
    for g in groups:
        sizes = [(path, leaves[i].shape[axis], leaves[i].shape[axis] - off) for path, i, axis, off in g]
        bad = next((s for s in sizes if s[2] != sizes[0][2]), None)
        if bad is not None:
            (p1, n1, _), (p2, n2, _) = sizes[0], bad
            raise SignatureError(
                f"fgraph.jit({fname}): {p1} has {n1} rows along its batch axis but {p2} has {n2}, and the "
                "traced function uses them as one batch (padding both to the bucket would hide the mismatch)",
                f"pass {p1} and {p2} with the same number of rows",
            )


def check_aliases(fname: str, traced, leaves: list, specs: list) -> None:
    """No leaf may share memory with another leaf the program writes in place. Eager reads that write through it;
    the jitted call does not: a batched leaf is read from a padded copy made before the call, and any tensor the
    graphs were not captured with is copied into fgraph's buffers (a written one copied back after). Checked on the
    slow path, where a call's layout is first seen and wherever a tensor the graphs read changes; the replay path
    does not re-check (tests/test_footguns.py)."""
    written = [*traced.written, *sorted(traced.written_batched)]
    if not written:
        return
    by_storage: dict[int, list[int]] = {}
    for w in written:
        by_storage.setdefault(leaves[w].untyped_storage().data_ptr(), []).append(w)
    for b, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        for w in by_storage.get(x.untyped_storage().data_ptr(), ()):
            if w != b and _overlap(x, leaves[w]):
                pb, pw = traced.paths[b], traced.paths[w]
                how = (
                    f"{pb} is batched, so the jitted call reads it from a padded copy made before the call"
                    if specs[b] is not None
                    else "the jitted call reads a copy of its own of either one whenever a call passes tensors the "
                    "graphs were not captured with"
                )
                raise SignatureError(
                    f"fgraph.jit({fname}): {pb} shares memory with {pw}, which the function writes in place; {how}, "
                    "and would then not see that write (eager would)",
                    f"pass a copy ({pb}.clone()), or read {pw} inside the function instead of passing it twice",
                )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges overlap (same device and storage, overlapping bytes)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        lo = t.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
