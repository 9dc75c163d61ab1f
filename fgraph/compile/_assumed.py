"""What a compiled piece may rely on about its inputs' sizes (`Compilation.holds_for`), the trace's shape env put back
after a compilation assumed more in it (`restored`), and a piece's key (`piece_key`): two structurally equal pieces
share one compilation."""

from __future__ import annotations

import contextlib
import copy
import types

import sympy
import torch
import torch.fx as fx


class Compilation:
    """One compiled function and everything its code may rely on about its inputs' sizes.

    `layout`: each input as the compilation saw it, with the trace's replacements applied (a symbol the trace fixed,
    as `s0 == 256`, is the number; one it equated with another, that other): per tensor (sizes, strides), per int its
    value, as sympy expressions over the layout's symbols. `guards`: what the trace and Inductor assumed of those
    symbols. `ranges`: their value ranges. Inductor's code asserts every input's sizes and strides and may have
    specialised on any guard, so a call's inputs must satisfy all three (`holds_for`) before the code serves it."""

    def __init__(self, fn, layout: list, guards: list, ranges: dict):
        self.fn, self.layout, self.guards, self.ranges = fn, layout, guards, ranges
        self.uses = 0

    def holds_for(self, args) -> bool:
        """Whether `args` have the sizes and strides the code asserts and satisfy every guard and range it assumed."""
        bound: dict = {}
        for spec, a in zip(self.layout, args):  # the symbols: from the dims that are one
            if isinstance(spec, tuple):
                if not isinstance(a, torch.Tensor) or a.dim() != len(spec[0]):
                    return False
                pairs = zip(spec[0], a.shape)
            else:
                pairs = [(spec, a)] if spec is not None else []
            for e, n in pairs:
                if isinstance(e, sympy.Symbol) and bound.setdefault(e, n) != n:
                    return False
        try:
            for spec, a in zip(self.layout, args):
                if isinstance(spec, tuple):
                    sizes, strides = spec
                    if any(_value(e, bound) != n for e, n in zip(sizes, a.shape)):
                        return False
                    # (as Inductor's assert_size_stride: a dim of size 0 or 1 has any stride)
                    if any(n > 1 and _value(e, bound) != st for e, st, n in zip(strides, a.stride(), a.shape)):
                        return False
                elif spec is not None and (not isinstance(a, int) or _value(spec, bound) != a):
                    return False
            ok = all(bool(g.xreplace(bound)) is True for g in self.guards)
        except TypeError:  # an expression over a symbol no input binds
            return False
        for sym, n in bound.items():
            lo, hi = self.ranges.get(sym, (None, None))
            if (lo is not None and n < lo) or (hi is not None and n > hi):
                return False
        if ok:
            self.uses += 1
        return ok


def _value(e, bound: dict) -> int:
    """An expression of the layout at the bound symbols' values (TypeError where one is unbound)."""
    got = e.xreplace(bound) if isinstance(e, sympy.Basic) else e
    if isinstance(got, sympy.Basic) and not got.is_Integer:
        raise TypeError(f"unbound symbols in {got}")
    return int(got)


def input_layout(inputs: list, env) -> list:
    """Each input as its compilation sees it (Compilation.layout): (sizes, strides) of a tensor, an int's expression,
    None for anything else; every expression with the env's replacements applied."""

    def expr(d):
        e = d.node.expr if isinstance(d, torch.SymInt) else d
        return env.replace(e) if env is not None and isinstance(e, sympy.Basic) else sympy.Integer(int(e))

    out: list = []
    for v in inputs:
        if isinstance(v, torch.Tensor):
            out.append((tuple(map(expr, v.shape)), tuple(map(expr, v.stride()))))
        elif isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
            out.append(expr(v))
        else:
            out.append(None)
    return out


def layout_facts(layout: list, env) -> tuple[list, dict]:
    """(guards, ranges): what the env knows of the layout's symbols, as its replacements leave it (guards over
    other symbols only, such as the trace's other batch axes, cannot shape this piece's code)."""
    syms = _symbols(layout)
    guards = []
    for g in env.guards:
        e = env.replace(g.expr)
        if e.free_symbols and e.free_symbols <= syms and e is not sympy.true:
            guards.append(e)
    ranges = {s: (bound_int(r.lower), bound_int(r.upper)) for s, r in env.var_to_range.items() if s in syms}
    return guards, ranges


def _symbols(layout: list) -> set:
    out: set = set()
    for spec in layout:
        for e in (spec[0] + spec[1]) if isinstance(spec, tuple) else (spec,) if spec is not None else ():
            out |= getattr(e, "free_symbols", set())
    return out


@contextlib.contextmanager
def restored(env):
    """The trace's shape env as it was before, after what runs inside (a compilation) assumed more in it.

    Inductor records its assumptions in the env (guards, replacements, narrower ranges, runtime asserts) and the
    env caches what it derives from them (`replace`, each SymNode's `expr`) by version counters it bumps only when
    their sizes grow. Putting the old containers back is not enough: a cached `replace(s0) -> 256` from one piece's
    compilation would specialise the next piece compiled in the same env, which then records no assumption of its
    own. So both counters move on, and every derived value is recomputed from the restored state."""
    names = ("guards", "replacements", "var_to_range", "divisible", "axioms")
    saved = {k: copy.copy(getattr(env, k)) for k in names if hasattr(env, k)}
    # (lists per symbol that a compilation appends to: copied one level down)
    saved["deferred_runtime_asserts"] = {k: list(v) for k, v in getattr(env, "deferred_runtime_asserts", {}).items()}
    before = types.SimpleNamespace(**saved)
    try:
        yield before
    finally:
        for k, v in saved.items():
            setattr(env, k, v)
        for counter in ("_replacements_version_counter", "_version_counter"):
            if hasattr(env, counter):
                setattr(env, counter, getattr(env, counter) + 1)
        if hasattr(env, "_prev_cache_key"):
            env._prev_cache_key = env._get_key()


def bound_int(x) -> int | None:
    """A range's bound as an int, None where it is unbounded (sympy's oo, int_oo)."""
    return int(x) if isinstance(x, int) or getattr(x, "is_Integer", False) else None


def piece_key(module: fx.GraphModule, inputs: list, options: dict, facts=([], {})) -> tuple[str, dict]:
    """A piece's graph as text that two structurally equal pieces share: nodes numbered in order, each input's avals
    (dtype, device, shape, strides) as the trace's replacements leave them (a SymInt's `node.expr` applies them) with
    symbols renamed by first appearance, what the trace knows of them (`facts`: guards and ranges, `_facts`), the
    options; constants by value."""
    names: dict = {}

    def expr(x) -> str:
        e = x.node.expr if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) else x
        if isinstance(e, sympy.Basic):
            for s in sorted(e.free_symbols, key=str):
                names.setdefault(s, sympy.Symbol(f"s{len(names)}"))
            return str(e.xreplace(names))
        return repr(e)

    def aval(v) -> str:
        if isinstance(v, (list, tuple)):
            return "(" + ",".join(map(aval, v)) + ")"
        if isinstance(v, torch.Tensor):
            dims = ",".join(map(expr, v.shape))
            strides = ",".join(map(expr, v.stride()))
            return f"{v.dtype}@{v.device}[{dims}]/[{strides}]{'g' if v.requires_grad else ''}"
        return expr(v) if v is not None else "-"

    number = {n: i for i, n in enumerate(module.graph.nodes)}

    def arg(a) -> str:
        if isinstance(a, fx.Node):
            return f"%{number[a]}"
        if isinstance(a, (list, tuple)):
            return "(" + ",".join(map(arg, a)) + ")"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{arg(v)}" for k, v in a.items()) + "}"
        return expr(a) if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) else repr(a)

    lines = [aval(v) for v in inputs]
    guards, ranges = facts
    lines += sorted(f"guard {expr(g)}" for g in guards)
    lines += sorted(f"range {expr(sym)} {lo} {hi}" for sym, (lo, hi) in ranges.items())
    for n in module.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr":  # a constant made while tracing: part of the key by value
            t = getattr(module, n.target)
            small = isinstance(t, torch.Tensor) and t.numel() <= 64
            lines.append(f"const {aval(t)} {t.tolist() if small else id(module)}")
            continue
        target = n.target if n.op in ("call_function", "output") else f"{n.op}:{id(module)}:{n.target}"
        lines.append(f"{n.op} {target} {arg(n.args)} {arg(n.kwargs)} -> {aval(n.meta.get('val'))}")
    lines.append(repr(sorted(options.items())))
    return "\n".join(lines), names
