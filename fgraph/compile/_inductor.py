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
from collections.abc import Callable

import sympy
import torch
import torch.fx as fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .._config import config as fgraph_config
from .._errors import SignatureError
from .._fx import own_top_level, share_repeats
from ..kernels import compile_ahead, sdpa_op
from ..trace import fake_slices, split
from . import _sdpa, _small_m
from ._assumed import Compilation, bound_int, input_layout, layout_facts, piece_key, restored


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


class CompileFailed(Exception):
    """Inductor could not compile a graph piece (`piece`: its name); the cause is chained. Under jit's default the
    signature is captured again with uncompiled graphs; a compile= asked for by name is an error."""

    def __init__(self, piece: str, cause: BaseException):
        self.piece = piece
        super().__init__(f"Inductor failed on piece {piece}: {type(cause).__name__}: {str(cause).splitlines()[0]}")


class Compiled(torch.nn.Module):
    """A graph piece as Inductor compiled it: one compiled function per distinct piece, shared.

    The compiled function comes from `compiler` (compiled once for the trace's symbolic batch dims, and shared by
    every signature, routine and layer whose piece is the same graph over inputs of the same avals). At the first
    call it is checked against the call's sizes: where a guard or range Inductor relied on does not hold, this
    signature gets a compilation at its own static shapes."""

    def __init__(self, name: str, module: fx.GraphModule, options: dict, static: bool = False, rewrite: bool = True):
        super().__init__()
        module = with_linear(module) if rewrite else module  # (a part of a piece: rewritten with the piece)
        self.module, self.options, self.static = module, options, static
        self.name = name
        self.fn, self.how = None, None
        cuts = sum(n.target is sdpa_op for n in module.graph.nodes) if fgraph_config.compile_parts else 0
        self.parts = _parts(name, module, options, static) if cuts >= 2 else None
        if self.parts is not None:  # (each part a Compiled of its own)
            self.shared, self.how = None, f"in parts, cut at its {cuts} fgraph::sdpa_decode calls"
            return
        # compiled (or found) now, so capture's bar shows the progress; a static piece compiles at its first call
        self.shared = None if static else _compiling(name, lambda: compiler.symbolic(module, options))
        # a piece that returns one bare tensor (split_module's single output): compiled code returns a 1-list, which
        # the program would hand on as the output itself (a list, never sliced back to N)
        out = next(n for n in reversed(module.graph.nodes) if n.op == "output")
        self.single = not isinstance(out.args[0], (tuple, list))

    def forward(self, *args):
        if self.parts is not None:
            return self.parts(*args)
        if self.fn is None:
            if not self.static and self.shared.holds_for(args):
                self.fn, self.how = self.shared.fn, "symbolic"
            else:
                fn = _compiling(self.name, lambda: compiler.static(self.module, self.options, args))
                self.fn, self.how = fn, "static"
        out = self.fn(*args)
        return out[0] if self.single and isinstance(out, (tuple, list)) else out


def _parts(name: str, module: fx.GraphModule, options: dict, static: bool):
    """The piece cut before and after each of its fgraph::sdpa_decode calls (each a decoder layer's attention), every
    part between compiled as a piece of its own (`Compiled`), the calls run as they are between them. A deep model's
    middle parts (a layer's MLP and the next one's projections) are one graph over other weights: Inductor compiles
    it once (`Compiler.symbolic`'s key), where the piece whole costs it every layer's ops. What the piece computes
    again at every layer (the mask's bias) is computed once, in the first part, and read by the rest, as Inductor
    would do inside one compilation. The piece is cut once (kept in its meta, as `with_linear`'s rewrite is); each
    signature's capture gets a program of its own over the cut, with its own parts."""
    program = module.meta.get("fgraph_parts")
    if program is None:
        cut = fx.GraphModule(module, copy.deepcopy(module.graph))
        compiler.counts["cut"] += 1
        compiler.counts["repeats"] += share_repeats(cut)
        program = module.meta["fgraph_parts"] = split(cut, lambda n: n.target is sdpa_op, {})
    top = own_top_level(program.module)  # (the breaks' modules shared; the parts set below)
    for p in program.pieces:
        if not p.is_break:
            setattr(top, p.name, Compiled(f"{name}.{p.name}", p.module, options, static, rewrite=False))
    return top


def _compiling(name: str, compile: Callable):
    """compile(), its failure a CompileFailed (out of memory aside: that has its own path)."""
    try:
        return compile()
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        compiler.counts["failed"] += 1
        raise CompileFailed(name, e) from e


def with_linear(module: fx.GraphModule) -> fx.GraphModule:
    """The piece with its few-row matmuls as `fgraph::linear` (those over the same rows as `fgraph::linears`), its
    gated activations as `fgraph::linear_glu`, the RMSNorms they read as `fgraph::norm_linear` (fgraph.config.
    small_m_gemv, small_m_group, small_m_glu, small_m_norm) and its one-query SDPA calls as `fgraph::sdpa_decode`
    (fgraph.config.sdpa_decode), made once per piece and setting."""
    c = fgraph_config
    if not (c.small_m_gemv or c.sdpa_decode):
        return module
    key = ("fgraph_linear", c.small_m_gemv, c.small_m_glu, c.small_m_norm, c.small_m_group, c.sdpa_decode)
    got = module.meta.get(key)
    if got is None:
        other = fx.GraphModule(module, copy.deepcopy(module.graph))
        n = 0
        if c.small_m_gemv:
            n = _small_m.rewrite(other, glu=c.small_m_glu, norm=c.small_m_norm, group=c.small_m_group)
            made = _small_m.ops_made(other)
            compiler.counts["linear"] += n
            compiler.counts["glu"] += made["fgraph::linear_glu"]
            compiler.counts["norm"] += made["fgraph::norm_linear"]
            compiler.counts["group"] += made["fgraph::linears"]
        if c.sdpa_decode:
            s = _sdpa.rewrite(other)
            compiler.counts["sdpa"] += s
            n += s
        if n:  # (the kernels the ops' first call compiles, the tuner's candidates too: started now, as Inductor runs)
            compile_ahead(other)
        got = module.meta[key] = other if n else module
    return got


class Compiler:
    """Every piece Inductor compiled in this process, by what it is, and counters of the work.

    The key of a piece is its graph with nodes numbered in order and each value's avals written with its symbols
    renamed by first appearance, plus the Inductor options: two layers' middle pieces, or the same piece of the
    decode and the mixed trace, are one key (their weights are inputs). Across processes, Inductor's own FX-graph
    cache serves the compilation (it needs the trace's shape env, given here through a tracing context)."""

    def __init__(self):
        self.shared: dict[str, Compilation] = {}
        # compiled / loaded: compile_fx calls Inductor ran / served from its FX-graph cache (static: those made for
        # one bucket's own shapes); shared: pieces served by a compilation this process already had
        # linear: the fgraph ops the signatures' pieces' matmuls were rewritten into (fgraph::linear, linears,
        # linear_glu, norm_linear); group, glu, norm: those of fgraph::linears, linear_glu, norm_linear
        # (fgraph/compile/_small_m.py)
        # failed: signatures whose pieces Inductor raised on (they ran uncompiled graphs, or the error was raised);
        # cut: pieces compiled in parts, each cut once however many signatures capture it; repeats: the nodes they
        # computed again and now read from the first (`_parts`)
        names = ("compiled", "loaded", "shared", "static", "failed", "linear", "glu", "norm", "group", "sdpa")
        self.counts = dict.fromkeys((*names, "cut", "repeats"), 0)
        self.counts["seconds"] = 0.0

    def symbolic(self, module: fx.GraphModule, options: dict) -> Compilation:
        """The piece compiled for its traced (symbolic) input avals, compiled now or found.

        Found first by the piece itself (every signature of a trace runs the same piece module), then by its key."""
        mine = module.meta.setdefault("fgraph_compiled", {})  # options -> Compilation, for this piece module
        by_options = repr(sorted(options.items()))
        got = mine.get(by_options)
        if isinstance(got, Exception):  # (failed for an earlier signature: every other fails alike)
            raise got
        if got is None:
            inputs = [n.meta.get("val") for n in module.graph.nodes if n.op == "placeholder"]
            mode = next((v.fake_mode for v in inputs if isinstance(v, torch._subclasses.FakeTensor)), None)
            if mode is None or mode.shape_env is None:  # a static trace: a fake mode with a shape env (the cache)
                mode, inputs = _static_fakes(inputs)
            layout = input_layout(inputs, mode.shape_env)
            guards, ranges = layout_facts(layout, mode.shape_env)
            # (what the trace knows of the piece's sizes is part of its key: a trace that fixed a size shares no
            # compilation with one that did not)
            key, names = piece_key(module, inputs, options, (guards, ranges))
            got = self.shared.get(key)
            if got is None:
                try:
                    fn, assumed, now = self._assumed(module, inputs, options, mode, key, names)
                except Exception as e:
                    mine[by_options] = e
                    raise
                got = self.shared[key] = Compilation(fn, layout, guards + assumed, {**ranges, **now})
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
        with restored(env) as before:
            fn = self._compile(module, inputs, options, mode)
            assumed = [g.expr for g in env.guards[len(before.guards) :]]
            assumed += [sympy.Eq(k, v) for k, v in env.replacements.items() if k not in before.replacements]
            now = {s: (bound_int(r.lower), bound_int(r.upper)) for s, r in env.var_to_range.items() if s in names}
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
            got = self.shared[key] = Compilation(
                self._compile(module, inputs, options, mode), input_layout(inputs, None), [], {}
            )
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
            config.patch({**options, "post_grad_custom_post_pass": residual_adds_out_of_gemms()}),
            fake_slices(),  # (the trace's slices, propagated again: sized as the trace sized them)
        ):
            fn = compile_fx(module, inputs)
        loaded = counters["inductor"]["fxgraph_cache_hit"] > hits
        self.counts["loaded" if loaded else "compiled"] += 1
        self.counts["seconds"] += time.perf_counter() - t0
        return fn


compiler = Compiler()


def _static_fakes(values: list) -> tuple[FakeTensorMode, list]:
    """A fake mode with a shape env (Inductor's FX-graph cache needs one), and `values` as its static fakes."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        return mode, [mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v for v in values]


def _assumptions_path(key: str) -> str:
    """Where what a piece's compilation assumes of its symbols is kept: beside Inductor's own cache."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "fgraph", hashlib.sha256(key.encode()).hexdigest() + ".json")


def config_patch(options: dict):
    from torch._inductor import config

    return config.patch(options)


def _same_shape(a, b) -> bool:
    """Whether two traced values have the very same shape, symbol for symbol, asking nothing of the shape env: a
    SymInt compared with `==` guards on its hint (`s0 == 256` at bucket 256, where a weight has 256 columns), and
    the guard would tie the compilation to that bucket."""

    def dims(t):
        return [d.node.expr if isinstance(d, torch.SymInt) else d for d in t.shape]

    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and dims(a) == dims(b)


def residual_adds_out_of_gemms():
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
