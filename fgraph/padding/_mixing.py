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

import attrs
import sympy
import torch
import torch.fx as fx

from .. import _fx
from .. import _primitives as P
from .._errors import SignatureError
from ._index_flow import Flow
from ._ops import Ctx, rule_of


class Finding(NamedTuple):
    """One place where padding can change the answer."""

    op: str  # "aten.mean", or "branch"
    line: str  # the user's source line
    what: str  # what it does with the batch axis

    def __str__(self):
        return f"{self.op} at {self.line}: {self.what}"


@attrs.frozen(eq=False)
class BatchLeaf:
    """A batched tensor leaf as a trace sizes it: its key path, leaf index, batch axis and Batched spec, and its size
    as `sym + off` (sym: its canonical batch symbol; both None where its size is no symbol plus a constant)."""

    path: str
    index: int
    axis: int
    spec: object
    sym: object
    off: int | None


class BatchAxes:
    """The batch symbols of a symbolic trace: one per batched leaf (its length, as traced: `raw`), and the same
    canonicalised through the trace's replacements (tokens and positions traced as s0 and s1 become one symbol
    once an op ties them), with the leaves each stands for."""

    def __init__(self, shapes, leaves: list[tuple[str, int, int, object]]):
        # leaves: per batched tensor leaf, in the order of shapes.syms: (key path, leaf index, axis, Batched)
        self.shapes, self.env, self._syms = shapes, shapes.shape_env, {}
        self.raw = {sym: (i, axis) for (sym, _), (_, i, axis, _) in zip(shapes.syms, leaves)}
        self.leaves: list[BatchLeaf] = []
        for (sym, _), (path, i, axis, spec) in zip(shapes.syms, leaves):
            e = self.canon(sym)
            free = list(e.free_symbols)
            off = e - free[0] if len(free) == 1 else None
            off = int(off) if off is not None and off.is_Integer else None
            self.leaves.append(BatchLeaf(path, i, axis, spec, free[0] if off is not None else None, off))
        self.symbols = {leaf.sym for leaf in self.leaves if leaf.sym is not None}
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
        names = {sym: sympy.Symbol(f"{leaf.path}.shape[{leaf.axis}]") for sym, leaf in zip(self.raw, self.leaves)}
        names.update({leaf.sym: names[sym] for sym, leaf in zip(self.raw, self.leaves) if leaf.sym is not None})
        return str(e.xreplace(names))

    def at(self, expr, n: int):
        """A traced size or guard (sympy) in a call of n rows: each leaf's symbol at its length, n + its extra."""
        e = expr.node.expr if isinstance(expr, torch.SymInt) else expr
        sizes = {sym: n + leaf.spec.extra for sym, leaf in zip(self.raw, self.leaves)}
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
        return bool(syms) and all(any(leaf.spec.mixes for leaf in self.leaves if leaf.sym == s) for s in syms)

    def intended_raw(self, syms) -> bool:
        """The same for symbols as traced (before a guard replaced one with a number)."""
        raw = [self.raw[s][0] for s in syms if s in self.raw]
        return bool(raw) and all(leaf.spec.mixes for leaf in self.leaves if leaf.index in raw)


def find_mixing(
    gm: fx.GraphModule, axes: BatchAxes, scratch: set[str], paths: dict[fx.Node, str], buckets=()
) -> list[Finding]:
    """The ops of a symbolic trace that combine rows along a batch axis (so padded rows change real results),
    and the guards the trace took on a batch size. Break primitives (attention, MoE) are excluded: they own their
    padding contract. scratch: the key paths whose scatters from padded rows are declared to land in scratch. Each
    op's rule is in fgraph/padding/_ops.py (RULES), by its kind."""
    found: dict[tuple, Finding] = {}

    def add(node, syms, what):
        # one finding per source line, its first op's: the rest follow from it (`w[n:].sum()`: the slice, not the
        # sum over its rows; `s[:n] += x`: the add_, not the copy_ back)
        line = node.meta.get("line", "<unknown>")
        if axes.intended(syms) or any(f.line == line for f in found.values()):
            return
        f = Finding(f"aten.{_fx.op_name(node)}", line, what)
        found.setdefault((f.op, f.line), f)

    specs = {leaf.path: leaf.spec for leaf in axes.leaves}
    flow = Flow(gm, axes, {ph: specs[p] for ph, p in paths.items() if p in specs})  # what index tensors hold
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if P.primitive_of(node) is not None:
            continue
        name = _fx.op_name(node)
        ins = [a for a in node.args if isinstance(a, fx.Node)]
        ins += [x for a in node.args if isinstance(a, (list, tuple)) for x in a if isinstance(x, fx.Node)]
        first = _fx.val(ins[0]) if ins else None
        first = first if isinstance(first, torch.Tensor) else None
        dims = axes.dims(first)
        syms = set().union(*(axes.syms_of(first.shape[d]) for d in dims)) if dims else set()
        hit = rule_of(name)(node, Ctx(name, axes, flow, paths, scratch, ins, first, dims, syms))
        if hit is not None:
            add(node, *hit)
    for g in size_guards(axes):
        expr = g.expr
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
        found.setdefault((f.op, f.line), f)
    return list(found.values())


def size_guards(axes: BatchAxes) -> list:
    """What a symbolic trace assumed of its batch sizes: its guards on them (`.expr`), from the user's code or torch's
    (`N > 4`, `len(x)`'s N == 8, an even N for `tensor_split`), but ties between two sizes (tokens and positions:
    checked per call, check_lengths) and what Batched(mixes=True) says is intended. find_mixing reports those the
    user's code took. The trace holds at each bucket it serves; a call of N rows padded up to one is answered by it
    only where every one also holds at N: elsewhere eager takes another branch (FunctionState runs it eagerly)."""
    out = []
    for g in axes.env.guards:
        expr = g.expr
        if isinstance(expr, sympy.Eq) and all(side.free_symbols for side in expr.args):
            continue  # a tie
        if not expr.free_symbols & (set(axes.raw) | axes.symbols):
            continue
        syms = set().union(*(axes.syms_of_expr(s) for s in expr.free_symbols))
        if not (axes.intended(syms) or axes.intended_raw(expr.free_symbols)):
            out.append(g)
    return out


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
    for leaf in axes.leaves:
        if leaf.sym is not None:
            groups.setdefault(leaf.sym, []).append((leaf.path, leaf.index, leaf.axis, leaf.off))
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


def check_aliases(fname: str, traced, leaves: list, specs: list | None, only=None) -> None:
    """No leaf may share memory with another leaf the program writes in place. Eager reads that write through it;
    the jitted call does not: a batched leaf is read from a padded copy made before the call, and any tensor the
    graphs were not captured with is copied into fgraph's buffers (a written one copied back after). Checked on the
    slow path, where a call's layout is first seen and wherever a tensor the graphs read changes; the replay path
    does not re-check the tensors a container passed again vouches for (tests/test_footguns.py). only: the leaves
    to check (the replay path's fresh ones; default all); specs None: none batched."""
    written = traced.written_ix
    if not written:
        return
    by_storage: dict[int, list[int]] = {}
    for w in written:
        by_storage.setdefault(leaves[w].untyped_storage().data_ptr(), []).append(w)
    for b in range(len(leaves)) if only is None else only:
        x = leaves[b]
        if not isinstance(x, torch.Tensor):
            continue
        for w in by_storage.get(x.untyped_storage().data_ptr(), ()):
            if w != b and _overlap(x, leaves[w]):
                pb, pw = traced.paths[b], traced.paths[w]
                how = (
                    f"{pb} is batched, so the jitted call reads it from a padded copy made before the call"
                    if specs is not None and specs[b] is not None
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
