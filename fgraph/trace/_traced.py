"""Traced: one trace of a function, checked and split, shared by every signature its batch dims fit.

It holds its program, its mode and why, what padding changes in it, and how its outputs are cut back and handed out;
every signature (bucket) its symbolic batch dims fit shares it."""

from __future__ import annotations

import time
from typing import NamedTuple

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import _primitives as P
from .. import padding
from .._errors import EscapeError, TraceError
from .._fx import base_of, write_targets
from .._modes import resolve_mode
from .._pytree import flatten_with_paths, holds, static_attrs, tree_flatten
from .._signature import Call, aval_of, path_str
from .._state import root_of
from ._callable import invoke
from ._make import check, trace
from ._split import Program, breaks_filter, split
from ._state_change import state_change


def _fed_by(gm: fx.GraphModule, sources: set) -> set:
    """The tensor nodes whose values depend on `sources` (the batched placeholders' rows): a forward pass over the
    graph. Not through sizes: a value computed from the batch size alone (`len.add_(x.shape[0])`) is no padded row."""
    fed = set(sources)
    for node in gm.graph.nodes:
        if node not in fed and any(n in fed for n in node.all_input_nodes):
            if not isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
                fed.add(node)
    return fed


class Traced:
    """One trace and its split program, shared by every signature (bucket) its symbolic batch dims fit."""

    def __init__(self, jitted, call: Call, device: str):
        fname = self.fname = jitted.name
        tensor_ix = [i for i, x in enumerate(call.leaves) if isinstance(x, torch.Tensor)]
        self.tensor_ix, self.paths = tensor_ix, [path_str(p) for p in call.paths]
        self.batched_ix = [i for i in tensor_ix if call.specs[i] is not None]
        self.address_ix = [i for i in tensor_ix if call.specs[i] is None]
        self.out_spec, self.out_args = None, {}
        consts = list(call.leaves)
        donated = [k for k in jitted.options.donate if k in call.bound]  # arguments (lifted state is not bound)
        grad_names = jitted.lifted.grad_names if jitted.lifted else ()

        def flat_fn(*tensors):
            leaves = list(consts)
            for i, t in zip(tensor_ix, tensors):
                leaves[i] = t
            dyn = pytree.tree_unflatten(leaves, call.sig.treespec)
            for name in grad_names:  # read as data, traced with their flag: torch picks kernels by it (as eager's)
                if isinstance(t := dyn.get(name), torch.Tensor) and not t.requires_grad:
                    t.requires_grad_()
            passed = {name: tree_flatten(v) for name, v in dyn.items()}
            before = {name: (flatten_with_paths(dyn[name])[0], static_attrs(dyn[name])) for name in donated}
            layouts = [_layout(t) for t in tensors]
            out = invoke(jitted, dyn, call.statics)
            _refuse_relayout(fname, tensors, layouts, [self.paths[i] for i in tensor_ix])
            self.state_change = state_change(fname, donated, dyn, before)
            out_leaves, self.out_spec = tree_flatten(out)
            padding.refuse_opaque_outputs(fname, out, out_leaves)
            padding.refuse_formatted_sizes(fname, out, out_leaves)
            # the caller's own donated argument handed back wherever it is returned (`return logits, state`, an HF
            # output's `.cache`; no unflattening per call) if it holds what was passed; one the function stored
            # into (state["h"] = h) is traced. Only donated arguments: any other input returned, lifted tensors
            # included, is a value the program copies
            held = {id(dyn[name]): name for name in donated if holds(dyn[name], *passed[name])}
            if held and any(id(x) in held for x in pytree.tree_leaves(out, is_leaf=lambda x: id(x) in held)):
                self.out_recipe, self.out_spec = _fold_arguments(out, held, passed)
                self.out_args = {k: x for k, x in enumerate(self.out_recipe) if type(x) is str}
            return out_leaves

        t0 = time.perf_counter()
        # batched inputs may come from the host but live on the device inside the program. A first call at bucket 1
        # is traced with static shapes (a symbol traced at 1 would be specialised to it); later buckets, 1 included,
        # reuse a symbolic trace whose guards they satisfy (Shapes.fits)
        example = [
            call.leaves[i]
            if call.specs[i] is None
            else torch.empty(call.sig.leaves[i].shape, dtype=call.leaves[i].dtype, device=device)
            for i in tensor_ix
        ]
        symbolic = call.sig.bucket is not None and call.sig.bucket > 1
        axes = [
            (call.specs[i].axis, call.specs[i].extra) if symbolic and call.specs[i] is not None else None
            for i in tensor_ix
        ]
        reach = (jitted.fn, call.bound)  # where a traced value must not be left: its reach, the caller's args
        self.state_change = None
        try:
            gm, self.shapes = trace(fname, flat_fn, example, axes, [self.paths[i] for i in tensor_ix], reach, device)
        except EscapeError as e:
            # a call that makes a lazily made cache runs eagerly, its trace unused: where every value the trace let
            # out was put back on its module, that eager call makes it for real (transformers' longrope
            # `long_inv_freq`), and the next call lifts it (`rescan`)
            if self.state_change is None or e.left:
                raise
            self.state_change.rescan = True
            raise self.state_change from None
        if self.state_change is not None:  # a lazily made cache: its first call runs eagerly
            raise self.state_change
        self.gm = gm  # the whole program, unsplit (Jitted.lower)
        self.grad_mode = gm.meta["grad_mode"]  # the grad mode the function branched on, else None (serves both)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        ph_paths = {ph: self.paths[i] for ph, i in zip(placeholders, tensor_ix)}
        donated_roots = set(jitted.options.donate)
        check(fname, gm, ph_paths, lambda ph: root_of(ph_paths[ph]) in donated_roots, device)
        self.random = padding.random_draws(gm)
        for f in self.random:
            _visible(
                jitted,
                ("random", f.line),
                f"{f}: a jitted call draws another stream than eager under the same seed (padded rows and warm-up "
                "runs draw too)",
                "draw the noise outside and pass it in",
            )
        # Python values the trace reads but no guard compares (containers too large, objects): baked in, said once
        self.unguarded = list(jitted.lifted.unguarded)
        for name in self.unguarded:
            why = (
                "is a value no guard compares (an object, a set, a long or nested tuple, a scalar of another type "
                "than bool, int, float or str, a container past the scan's depth)"
                if name in jitted.lifted.objects
                else "holds too many Python values to guard one by one"
            )
            _visible(
                jitted,
                ("unguarded", name),
                f"`{name}` {why}: the trace reads it once, and a change to it is not seen",
                "pass the values the function reads as arguments (static= for those that choose the program)",
            )
        is_break = breaks_filter(jitted.options.breaks)
        routine = call.statics.get(jitted.options.routine)
        self.mode, self.reason = resolve_mode(fname, jitted.options.mode, routine, gm, is_break)
        self.program: Program = split(gm, is_break, {ph.name: ph_paths[ph] for ph in placeholders})
        self.seconds = time.perf_counter() - t0
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        ph_pos = {ph: k for k, ph in enumerate(placeholders)}
        self.outs = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in out_node.args[0]]
        outs = [_self_of(o) for o in out_node.args[0]]  # `x.add_(1)` returned is the caller's own x, as in eager
        self.out_passthrough = {
            j: tensor_ix[ph_pos[o]] for j, o in enumerate(outs) if isinstance(o, fx.Node) and o in ph_pos
        }
        self.plans = _plan_sites(gm, ph_pos, tensor_ix, call.specs)
        self.bucket = call.sig.bucket
        # the donated leaves the program writes (put back after warm-up and capture), and of those the ones some write
        # of which takes nothing from the batched rows (scratch= covers only writes of padded rows: below)
        fed = _fed_by(gm, {ph for ph, i in zip(placeholders, tensor_ix) if call.specs[i] is not None})
        writes, unpadded = set(), set()
        for node in gm.graph.nodes:
            for t in write_targets(node):
                writes.add(base := base_of(t))
                if not any(n in fed for n in node.all_input_nodes):
                    unpadded.add(base)
        self.written = [i for ph, i in zip(placeholders, tensor_ix) if ph in writes and call.specs[i] is None]
        # donated batched leaves it writes: the program writes fgraph's padded buffer, so the caller's rows are
        # copied back after each call (as eager writes the caller's tensor), and their padding is written again
        self.written_batched = {
            i for ph, i in zip(placeholders, tensor_ix) if ph in writes and call.specs[i] is not None
        }
        self.written_ix = [*self.written, *sorted(self.written_batched)]  # every leaf the program writes
        # scratch: only the leaves every write of which comes from the batched inputs (padded rows land in the scratch
        # area); one written otherwise (a length counter beside the KV pages) is put back like any donated leaf
        self.scratch = {
            i
            for ph, i in zip(placeholders, tensor_ix)
            if i in self.written and ph not in unpadded and root_of(self.paths[i]) in jitted.options.scratch
        }
        self._padding(jitted, call, gm, ph_paths)
        self.warmed = False  # has a signature of this trace been warmed up (see Entry.capture)
        self._direct: dict[str, fx.GraphModule] = {}

    def direct(self, piece) -> fx.GraphModule:
        """The break piece as run between PIECEWISE graphs (see _direct).

        Made once per trace, shared by every signature (a break piece holds no state)."""
        m = self._direct.get(piece.name)
        if m is None:
            m = self._direct[piece.name] = _direct(piece.module)
        return m

    def _padding(self, jitted, call: Call, gm: fx.GraphModule, ph_paths: dict) -> None:
        """What padding can change, and how the outputs are cut back to the unpadded call's shape.

        Symbolic traces only (see fgraph/padding/): each place padding can change is logged once; also sets the leaves
        the trace ties to one batch size and the indexes padded rows take (checked per bucket: `bounds`)."""
        self.axes = self.mixing = self.flow = None
        self.tied, self.bounds = [], []
        # what the trace assumed of the batch sizes, and the sizes checked against it: None, nothing assumed
        self.size_guards, self.sizes_ok, self._sizes_broken = [], None, {}
        if self.shapes is None:
            return
        batched = [(self.paths[i], i, call.specs[i].axis, call.specs[i]) for i in self.batched_ix]
        self.axes = padding.BatchAxes(self.shapes, batched)
        # indices whose padded rows point past what they index: refused here, before any device runs the program
        specs = {leaf.path: leaf.spec for leaf in self.axes.leaves}
        self.flow = padding.Flow(gm, self.axes, {ph: specs[p] for ph, p in ph_paths.items() if p in specs}, ph_paths)
        self.bounds = padding.index_bounds(gm, self.flow)
        lifted = set(getattr(jitted.lifted, "names", ()))
        padding.check_bounds(jitted.name, self.bounds, self.flow, (call.sig.bucket, call.n), ph_paths, lifted)
        self.mixing = padding.find_mixing(gm, self.axes, set(jitted.options.scratch), ph_paths, jitted.options.buckets)
        self.tied = padding.tied_lengths(self.axes)
        self.size_guards = [g.expr for g in padding.size_guards(self.axes)]
        self.sizes_ok = set() if self.size_guards else None
        padding.refuse_shrinking_outputs(jitted.name, gm, self.axes, set(self.out_passthrough))
        for f in self.mixing:
            _visible(
                jitted,
                ("padding", f.op, f.line),
                f"padding is visible: {f}; calls padded to a bucket differ from the unpadded call",
                "mask the padded rows, or declare Batched(mixes=True) if intended",
            )

    def breaks_at(self, n: int | None) -> str | None:
        """The first of the trace's assumptions on its batch sizes that a call of n rows breaks (eager branches
        otherwise there than at the bucket), else None. Checked once per n: `sizes_ok` holds those that keep them
        all. (The replay path needs no check: it keys each n by a slow call that served it.)"""
        if self.sizes_ok is None or n is None or n in self.sizes_ok:
            return None
        broken = self._sizes_broken.get(n)
        if broken is None:
            broken = next((self.axes.name(e) for e in self.size_guards if self.axes.at(e, n) is sympy.false), None)
            if broken is None:
                self.sizes_ok.add(n)
                return None
            self._sizes_broken[n] = broken
        return broken

    def fits(self, bucket: int | None) -> bool:
        if self.shapes is None:
            return bucket == self.bucket
        # (a bucket where a followed index leaves its tensor gets a trace of its own, which refuses it)
        return bucket is not None and self.shapes.fits(bucket) and padding.holds(self.bounds, self.flow, bucket)

    def size_outputs(self) -> list[tuple]:
        """(output, size(leaves)) per output that is a size computed from the batch (fgraph/padding/_mixing.py)."""
        return [] if self.axes is None else padding.output_sizes(self.axes, self.outs)

    def batched_outputs(self, bucket: int | None) -> list[tuple]:
        """(output, dim, size) per output dim cut back per call to size(leaves) (None: to N), the unpadded call's size.

        Symbolic traces: every dim sized by a batch symbol; static ones (bucket 1): a first dim equal to the
        bucket. The caller's own tensors never are."""
        if bucket is None:
            return []
        rows = [] if self.axes is None else padding.output_rows(self.axes, self.outs, set(self.out_passthrough))
        if self.axes is not None and not self.axes.specialized:
            return rows
        cut = {j for j, _, _ in rows}  # a trace whose batch size a guard fixed (`if N == 8`) has static outputs
        return rows + [
            (j, 0, None)
            for j, v in enumerate(self.outs)
            if j not in self.out_passthrough
            and j not in cut
            and isinstance(v, torch.Tensor)
            and v.dim() > 0
            and isinstance(v.shape[0], int)
            and v.shape[0] == bucket
        ]


def _visible(jitted, key, what: str, fix: str) -> None:
    """A way the jitted call's answer differs from the plain function's: a TraceError under strict=True, else a
    warning logged once per place."""
    if jitted.options.strict:
        raise TraceError(f"fgraph.jit({jitted.name}, strict=True): {what}", fix)
    jitted.log_once(key, "%s (logged once). Fix: %s", what, fix)


def _self_of(o):
    """The tensor an output is, through in-place ops (aten's `op_` variants return their first argument)."""
    while isinstance(o, fx.Node) and isinstance(o.target, torch._ops.OpOverload) and o.args:
        if not (o.target._schema.name.endswith("_") and isinstance(o.args[0], fx.Node)):
            break
        o = o.args[0]
    return o


def _fold_arguments(out, held: dict[int, str], passed: dict):
    """Outputs that are the caller's own donated arguments become one leaf each, wherever they are in the output.

    Returns (recipe, spec), where the recipe lists, per leaf of the folded tree, the index of the graph output to
    use, or the argument name to hand back."""
    recipe, base = [], 0
    folded, spec = pytree.tree_flatten(out, is_leaf=lambda x: id(x) in held)
    for x in folded:
        if id(x) in held:
            recipe.append(held[id(x)])
            base += len(passed[held[id(x)]][0])
        else:
            recipe.append(base)
            base += 1
    return recipe, spec


def _direct(module: fx.GraphModule) -> fx.GraphModule:
    """A break piece that calls its primitives' eager rules as plain Python functions.

    The same call, minus the dispatcher and torch.library's wrapper around it (host time paid by every eager break
    of every PIECEWISE step: docs/performance.md). Only for running outside a graph: under capture the op goes
    through the dispatcher."""
    graph = fx.Graph()
    env = {}
    for node in module.graph.nodes:
        env[node] = new = graph.node_copy(node, lambda n: env[n])
        p = P.primitive_of(node)
        if p is not None:
            new.target = P.eager_rules[p]
    return fx.GraphModule(module, graph)


class PlanSite(NamedTuple):
    """One plan hook to run per call: a call site of a primitive that has a plan rule."""

    primitive: P.Primitive
    args: dict  # its non-tensor arguments
    inputs: dict[str, int]  # argument name -> index of the batched leaf passed there
    avals: dict  # argument name -> Aval, as traced


def _plan_sites(gm, ph_pos, tensor_ix, specs) -> list[PlanSite]:
    """Plan hooks to run per call: one per distinct (primitive, constant args, batched inputs, tensor avals)."""
    sites = {}
    for node in gm.graph.nodes:
        p = P.primitive_of(node)
        if p is None or p not in P.plan_rules:
            continue
        args = P.constant_args(node)
        if p in P.plan_filters and not P.plan_filters[p](args):
            continue
        tensors = {k: v for k, v in P.node_args(node).items() if isinstance(v, fx.Node)}
        inputs = {
            k: tensor_ix[ph_pos[v]]
            for k, v in tensors.items()
            if v in ph_pos and specs[tensor_ix[ph_pos[v]]] is not None
        }
        avals = {k: aval_of(v.meta["val"]) for k, v in tensors.items() if isinstance(v.meta.get("val"), torch.Tensor)}
        key = (p, repr(sorted(args.items())), tuple(sorted(inputs.items())), tuple(avals.items()))
        sites.setdefault(key, PlanSite(p, args, inputs, avals))
    return list(sites.values())


def _layout(t: torch.Tensor) -> tuple:
    """An input's memory and metadata: its storage, shape, strides and offset."""
    return t.untyped_storage()._cdata, tuple(t.shape), t.stride(), t.storage_offset()


def _refuse_relayout(fname: str, tensors, layouts: list, paths: list[str]) -> None:
    """Refuse a call that changed an input's memory or metadata in place (`w.data = u`, `w.set_(u)`, `w.t_()`,
    `w.unsqueeze_(0)`, `w.resize_(n)`).

    make_fx records none of `.data =` and traces the rest as ops over the placeholder, while a graph reads and writes
    the tensor's memory as captured: the jitted call would hand back the input as it was, and compute with it."""
    for t, was, path in zip(tensors, layouts, paths):
        if _layout(t) != was:
            raise TraceError(
                f"fgraph.jit({fname}): the function changes the memory, shape or strides of {path} in place "
                "(`.data =`, set_, resize_, t_, unsqueeze_, ...), which a captured graph cannot replay: it reads and "
                "writes the tensor as passed",
                "compute a new tensor and return it (w = w.t(), w = u) instead of changing the input in place",
            )
