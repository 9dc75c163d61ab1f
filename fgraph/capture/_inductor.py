"""Inductor: the graph pieces between breaks compiled before capture, and the jit(compile=...) options.

Norms, RoPE, activations and residual adds are fused; breaks stay as they are. One compilation per distinct piece,
symbolic in the batch axis, serves every signature whose piece is the same graph (`Compiler`)."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import time
import types
from collections.abc import Callable

import sympy
import torch
import torch.fx as fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .._config import config as fgraph_config
from .._errors import SignatureError
from . import _small_m


def inductor_options(fname: str, compile) -> dict | None:
    """jit(compile=...) -> None (no Inductor) or the Inductor config options to compile the pieces under."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise SignatureError(
            f"fgraph.jit({fname}): compile={compile!r} is neither a bool nor a dict of Inductor options",
            "pass compile=True, or e.g. compile={'coordinate_descent_tuning': True}",
        )
    from torch._inductor import config as inductor_config

    unknown = [k for k in compile if not isinstance(k, str) or not hasattr(inductor_config, k)]
    if unknown:
        raise SignatureError(
            f"fgraph.jit({fname}): compile= names {unknown}, which are not Inductor config "
            "options (torch._inductor.config)",
            "check the spelling against torch._inductor.list_options()",
        )
    # Inductor's config takes any value at patch time: a string for a bool option would only fail (or, truthy, be
    # read as True) inside a capture on the GPU. Options whose default is None or a container are not checked.
    for k, v in compile.items():
        kind = type(getattr(inductor_config, k))
        if kind in (bool, int, float, str) and not _of_kind(v, kind):
            raise SignatureError(
                f"fgraph.jit({fname}): compile={{{k!r}: {v!r}}}: Inductor's {k} takes a {kind.__name__}",
                f"pass a {kind.__name__}, e.g. compile={{{k!r}: {getattr(inductor_config, k)!r}}}",
            )
    return dict(compile)


def _of_kind(v, kind) -> bool:
    if kind is bool or isinstance(v, bool):  # (a bool is an int, but not a count)
        return kind is bool and isinstance(v, bool)
    return isinstance(v, (int, float)) if kind is float else isinstance(v, kind)


class Compiled(torch.nn.Module):
    """A graph piece as Inductor compiled it: one compiled function per distinct piece, shared.

    The compiled function comes from `compiler` (compiled once for the trace's symbolic batch dims, and shared by
    every signature, routine and layer whose piece is the same graph over inputs of the same avals). At the first
    call it is checked against the call's sizes: where a guard or range Inductor relied on does not hold, this
    signature gets a compilation at its own static shapes."""

    def __init__(self, module: fx.GraphModule, options: dict, static: bool = False):
        super().__init__()
        module = with_linear(module)
        self.module, self.options, self.static = module, options, static
        # compiled (or found) now, so capture's bar shows the progress; a static piece compiles at its first call
        self.shared = None if static else compiler.symbolic(module, options)
        self.fn, self.how = None, None
        # a piece that returns one bare tensor (split_module's single output): compiled code returns a 1-list, which
        # the program would hand on as the output itself (a list, never sliced back to N)
        out = next(n for n in reversed(module.graph.nodes) if n.op == "output")
        self.single = not isinstance(out.args[0], (tuple, list))

    def forward(self, *args):
        if self.fn is None:
            if not self.static and self.shared.holds_for(args):
                self.fn, self.how = self.shared.fn, "symbolic"
            else:
                self.fn, self.how = compiler.static(self.module, self.options, args), "static"
        out = self.fn(*args)
        return out[0] if self.single and isinstance(out, (tuple, list)) else out


def with_linear(module: fx.GraphModule) -> fx.GraphModule:
    """The piece with its few-row matmuls as `fgraph::linear` (those over the same rows as `fgraph::linears`), its
    gated activations as `fgraph::linear_glu` and the RMSNorms they read as `fgraph::norm_linear`
    (fgraph.config.small_m_gemv, small_m_group, small_m_glu, small_m_norm), made once per piece and setting."""
    if not fgraph_config.small_m_gemv:
        return module
    key = ("fgraph_linear", fgraph_config.small_m_glu, fgraph_config.small_m_norm, fgraph_config.small_m_group)
    got = module.meta.get(key)
    if got is None:
        other = fx.GraphModule(module, copy.deepcopy(module.graph))
        n = _small_m.rewrite(
            other, glu=fgraph_config.small_m_glu, norm=fgraph_config.small_m_norm, group=fgraph_config.small_m_group
        )
        made = _small_m.ops_made(other)
        compiler.counts["linear"] += n
        compiler.counts["glu"] += made["fgraph::linear_glu"]
        compiler.counts["norm"] += made["fgraph::norm_linear"]
        compiler.counts["group"] += made["fgraph::linears"]
        got = module.meta[key] = other if n else module
    return got


class Shared:
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


def _layout(inputs: list, env) -> list:
    """Each input as its compilation sees it (Shared.layout): (sizes, strides) of a tensor, an int's expression,
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


def _facts(layout: list, env) -> tuple[list, dict]:
    """(guards, ranges): what the env knows of the layout's symbols, as its replacements leave it (guards over
    other symbols only, such as the trace's other batch axes, cannot shape this piece's code)."""
    syms = _symbols(layout)
    guards = []
    for g in env.guards:
        e = env.replace(g.expr)
        if e.free_symbols and e.free_symbols <= syms and e is not sympy.true:
            guards.append(e)
    ranges = {s: (_bound(r.lower), _bound(r.upper)) for s, r in env.var_to_range.items() if s in syms}
    return guards, ranges


def _symbols(layout: list) -> set:
    out: set = set()
    for spec in layout:
        for e in (spec[0] + spec[1]) if isinstance(spec, tuple) else (spec,) if spec is not None else ():
            out |= getattr(e, "free_symbols", set())
    return out


class Compiler:
    """Every piece Inductor compiled in this process, by what it is, and counters of the work.

    The key of a piece is its graph with nodes numbered in order and each value's avals written with its symbols
    renamed by first appearance, plus the Inductor options: two layers' middle pieces, or the same piece of the
    decode and the mixed trace, are one key (their weights are inputs). Across processes, Inductor's own FX-graph
    cache serves the compilation (it needs the trace's shape env, given here through a tracing context)."""

    def __init__(self):
        self.shared: dict[str, Shared] = {}
        # compiled / loaded: compile_fx calls Inductor ran / served from its FX-graph cache (static: those made for
        # one bucket's own shapes); shared: pieces served by a compilation this process already had
        # linear: the fgraph ops the signatures' pieces' matmuls were rewritten into (fgraph::linear, linears,
        # linear_glu, norm_linear); group, glu, norm: those of fgraph::linears, linear_glu, norm_linear
        # (fgraph/capture/_small_m.py)
        self.counts = dict.fromkeys(("compiled", "loaded", "shared", "static", "linear", "glu", "norm", "group"), 0)
        self.counts["seconds"] = 0.0

    def symbolic(self, module: fx.GraphModule, options: dict) -> Shared:
        """The piece compiled for its traced (symbolic) input avals, compiled now or found.

        Found first by the piece itself (every signature of a trace runs the same piece module), then by its key."""
        mine = module.meta.setdefault("fgraph_compiled", {})  # options -> Shared, for this piece module
        by_options = repr(sorted(options.items()))
        got = mine.get(by_options)
        if got is None:
            inputs = [n.meta.get("val") for n in module.graph.nodes if n.op == "placeholder"]
            mode = next((v.fake_mode for v in inputs if isinstance(v, torch._subclasses.FakeTensor)), None)
            if mode is None or mode.shape_env is None:  # a static trace: a fake mode with a shape env (the cache)
                mode, inputs = _static_fakes(inputs)
            layout = _layout(inputs, mode.shape_env)
            guards, ranges = _facts(layout, mode.shape_env)
            # (what the trace knows of the piece's sizes is part of its key: a trace that fixed a size shares no
            # compilation with one that did not)
            key, names = piece_key(module, inputs, options, (guards, ranges))
            got = self.shared.get(key)
            if got is None:
                fn, assumed, now = self._assumed(module, inputs, options, mode, key, names)
                got = self.shared[key] = Shared(fn, layout, guards + assumed, {**ranges, **now})
                mine[by_options] = got
                return got
            mine[by_options] = got
        self.counts["shared"] += 1
        return got

    def _assumed(self, module, inputs, options, mode, key: str, names: dict):
        """(fn, guards, ranges): the compilation and what it assumes of the symbols.

        Inductor records its assumptions (guards, narrower ranges, replacements) in the trace's shape env: they are
        kept for holds_for and taken back out of the env, whose guards decide which buckets the trace itself serves
        (Shapes.fits). A compilation loaded from Inductor's FX-graph cache records none, so they are also written
        beside it (by the piece's key) when it is made and read back when it is loaded; a load without them is
        compiled again, with the cache off, to learn them."""
        env = mode.shape_env
        loaded0 = self.counts["loaded"]
        with _restored(env) as before:
            fn = self._compile(module, inputs, options, mode)
            assumed = [g.expr for g in env.guards[len(before.guards) :]]
            assumed += [sympy.Eq(k, v) for k, v in env.replacements.items() if k not in before.replacements]
            now = {s: (_bound(r.lower), _bound(r.upper)) for s, r in env.var_to_range.items() if s in names}
        assumed = [env.replace(g) for g in assumed]  # over the layout's symbols, as the trace's replacements leave them
        path = _assumptions_path(key)
        if self.counts["loaded"] == loaded0:  # compiled here: what it assumed goes beside the cached compilation
            record = {
                "guards": [str(g.xreplace(names)) for g in assumed],
                "ranges": {str(names[s]): [lo, hi] for s, (lo, hi) in now.items()},
            }
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as fh:
                    json.dump(record, fh)
            return fn, assumed, now
        try:
            with open(path) as fh:
                record = json.load(fh)
        except (OSError, ValueError):  # loaded, but its assumptions are unknown: learn them from a compilation
            with config_patch({"fx_graph_cache": False}):
                return self._assumed(module, inputs, options, mode, key, names)
        back = {c: s for s, c in names.items()}
        local = {str(c): c for c in back}
        assumed = [sympy.sympify(g, locals=local).xreplace(back) for g in record["guards"]]
        now = {back[local[c]]: (lo, hi) for c, (lo, hi) in record["ranges"].items()}
        return fn, assumed, now

    def static(self, module: fx.GraphModule, options: dict, args) -> Callable:
        """The piece compiled for these arguments' own static shapes (where the symbolic compilation's assumptions
        fail); shared by calls of the same avals."""
        mode, inputs = _static_fakes(args)
        key, _ = piece_key(module, inputs, options)  # the key of a static trace's piece of these avals too
        got = self.shared.get(key)
        if got is None:
            self.counts["static"] += 1
            got = self.shared[key] = Shared(self._compile(module, inputs, options, mode), _layout(inputs, None), [], {})
        return got.fn

    def _compile(self, module, inputs, options, mode):
        from torch._dynamo.utils import counters
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        t0, hits = time.perf_counter(), counters["inductor"]["fxgraph_cache_hit"]
        # compile_fx rewrites the module it is given (its graph made to return a list, post-grad passes): give it a
        # copy, since the piece belongs to a trace that other signatures run after this one
        module = fx.GraphModule(module, copy.deepcopy(module.graph))
        with (
            tracing(TracingContext(mode)),
            config.patch({**options, "post_grad_custom_post_pass": _residual_adds_out_of_gemms()}),
        ):
            fn = compile_fx(module, inputs)
        loaded = counters["inductor"]["fxgraph_cache_hit"] > hits
        self.counts["loaded" if loaded else "compiled"] += 1
        self.counts["seconds"] += time.perf_counter() - t0
        return fn


compiler = Compiler()


@contextlib.contextmanager
def _restored(env):
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


def _static_fakes(values: list) -> tuple[FakeTensorMode, list]:
    """A fake mode with a shape env (Inductor's FX-graph cache needs one), and `values` as its static fakes."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        return mode, [mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v for v in values]


def _bound(x) -> int | None:
    """A range's bound as an int, None where it is unbounded (sympy's oo, int_oo)."""
    return int(x) if isinstance(x, int) or getattr(x, "is_Integer", False) else None


def _assumptions_path(key: str) -> str:
    """Where what a piece's compilation assumes of its symbols is kept: beside Inductor's own cache."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "fgraph", hashlib.sha256(key.encode()).hexdigest() + ".json")


def config_patch(options: dict):
    from torch._inductor import config

    return config.patch(options)


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


def _same_shape(a, b) -> bool:
    """Whether two traced values have the very same shape, symbol for symbol, asking nothing of the shape env: a
    SymInt compared with `==` guards on its hint (`s0 == 256` at bucket 256, where a weight has 256 columns), and
    the guard would tie the compilation to that bucket."""

    def dims(t):
        return [d.node.expr if isinstance(d, torch.SymInt) else d for d in t.shape]

    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and dims(a) == dims(b)


def _residual_adds_out_of_gemms():
    """An Inductor post-grad pass for the pieces.

    Inductor folds `x + a @ b` into addmm(x, a, b) when the sum has a non-pointwise user, and a piece's residual
    stream always has one: the piece's output (the next piece's input, across a break). cuBLAS's addmm then first
    copies x into its output: a device copy per residual add, 2 per layer (a measurable share of a decode step:
    docs/performance.md), which torch.compile of the whole step, having no boundary there, does not make. Undone
    here for full-size addends (biases keep their GEMM epilogue): a plain mm, and the add as a pointwise op Inductor
    fuses into the neighbouring norm kernel."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    aten = torch.ops.aten

    class ResidualAddsOutOfGemms(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for node in list(graph.nodes):
                if node.op != "call_function" or node.target is not aten.addmm.default or len(node.args) != 3:
                    continue
                inp, a, b = node.args
                val = node.meta.get("val")
                if (
                    node.kwargs.get("beta", 1) != 1
                    or node.kwargs.get("alpha", 1) != 1
                    or val is None
                    or not isinstance(inp, fx.Node)
                    or not _same_shape(inp.meta.get("val"), val)
                ):
                    continue
                with graph.inserting_before(node):
                    mm = graph.call_function(aten.mm.default, (a, b))
                    add = graph.call_function(aten.add.Tensor, (inp, mm))
                mm.meta.update(node.meta)
                add.meta.update(node.meta)
                node.replace_all_uses_with(add)
                graph.erase_node(node)

        def uuid(self):
            return "fgraph.residual_adds_out_of_gemms.v1"

    return ResidualAddsOutOfGemms()
