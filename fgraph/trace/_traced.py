"""Traced: one trace of a function, checked and split, shared by every signature its batch dims fit.

Traced: one trace of a function, checked and split, shared by every signature (bucket) its symbolic batch dims fit: its
program, its mode and why, what padding changes in it, how its outputs are cut back and handed out."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import _primitives as P
from .. import padding
from .._fx import base_of, write_targets
from .._modes import resolve_mode
from .._pytree import holds, tree_flatten
from .._signature import Call, aval_of, path_str
from .._state import root_of
from ._callable import invoke
from ._make import check, trace
from ._split import Program, breaks_filter, split


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

        def flat_fn(*tensors):
            leaves = list(consts)
            for i, t in zip(tensor_ix, tensors):
                leaves[i] = t
            dyn = pytree.tree_unflatten(leaves, call.sig.treespec)
            passed = {name: tree_flatten(v) for name, v in dyn.items()}
            out = invoke(jitted, dyn, call.statics)
            out_leaves, self.out_spec = tree_flatten(out)
            padding.refuse_opaque_outputs(fname, out, out_leaves)
            if type(out) is tuple or pytree.is_namedtuple_instance(out):
                # `return logits, state`: hand the caller's own donated `state` back (no unflattening per call) if it
                # holds what was passed; one the function stored into (state["h"] = h) is traced. Only donated
                # arguments: any other input returned, lifted tensors included, is a value the program copies
                held = {k: name for k, o in enumerate(out) for name in donated if o is dyn[name]}
                self.out_args = {k: name for k, name in held.items() if holds(out[k], *passed[name])}
                if self.out_args:
                    self.out_recipe, self.out_spec = _fold_arguments(out, self.out_args)
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
        gm, self.shapes = trace(fname, flat_fn, example, axes, [self.paths[i] for i in tensor_ix], reach)
        self.gm = gm  # the whole program, unsplit (Jitted.lower)
        self.grad_mode = gm.meta["grad_mode"]  # the grad mode the function branched on, else None (serves both)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        ph_paths = {ph: self.paths[i] for ph, i in zip(placeholders, tensor_ix)}
        donated_roots = set(jitted.options.donate)
        check(fname, gm, ph_paths, lambda ph: root_of(ph_paths[ph]) in donated_roots, device)
        self.random = padding.random_draws(gm)
        for f in self.random:
            jitted.log_once(
                ("random", f.line),
                "%s: a jitted call draws another stream than eager under the same seed (padded rows and warm-up runs "
                "draw too; logged once). Fix: draw the noise outside and pass it in",
                f,
            )
        is_break = breaks_filter(jitted.options.breaks)
        decode = call.statics.get(jitted.options.routine) == "decode"
        self.mode, self.reason = resolve_mode(fname, jitted.options.mode, decode, gm, is_break)
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
        # the donated leaves the program writes (put back after warm-up and capture), and those declared scratch
        writes = {base_of(t) for node in gm.graph.nodes for t in write_targets(node)}
        self.written = [i for ph, i in zip(placeholders, tensor_ix) if ph in writes and call.specs[i] is None]
        # donated batched leaves it writes: the program writes fgraph's padded buffer, so the caller's rows are
        # copied back after each call (as eager writes the caller's tensor), and their padding is written again
        self.written_batched = {
            i for ph, i in zip(placeholders, tensor_ix) if ph in writes and call.specs[i] is not None
        }
        self.scratch = {i for i in self.written if root_of(self.paths[i]) in jitted.options.scratch}
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

        What padding can change (logged once per place), the leaves the trace ties to one batch size, and how
        each output is cut back to the unpadded call's shape (symbolic traces only: see fgraph/padding/)."""
        self.axes = self.mixing = None
        self.tied = []
        if self.shapes is None:
            return
        batched = [(self.paths[i], i, call.specs[i].axis, call.specs[i]) for i in self.batched_ix]
        self.axes = padding.BatchAxes(self.shapes, batched)
        self.mixing = padding.find_mixing(gm, self.axes, set(jitted.options.scratch), ph_paths, jitted.options.buckets)
        self.tied = padding.tied_lengths(self.axes)
        padding.refuse_shrinking_outputs(jitted.name, gm, self.axes, set(self.out_passthrough))
        for f in self.mixing:
            jitted.log_once(
                ("padding", f.op, f.line),
                "padding is visible: %s; calls padded to a bucket differ from the unpadded call (logged once). Fix: "
                "mask the padded rows, or declare Batched(mixes=True) if intended",
                f,
            )

    def fits(self, bucket: int | None) -> bool:
        return bucket == self.bucket if self.shapes is None else bucket is not None and self.shapes.fits(bucket)

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


def _self_of(o):
    """The tensor an output is, through in-place ops (aten's `op_` variants return their first argument)."""
    while isinstance(o, fx.Node) and isinstance(o.target, torch._ops.OpOverload) and o.args:
        if not (o.target._schema.name.endswith("_") and isinstance(o.args[0], fx.Node)):
            break
        o = o.args[0]
    return o


def _fold_arguments(out: tuple, out_args: dict[int, str]):
    """Outputs that are the caller's own arguments become one leaf each.

    Returns (recipe, spec), where the recipe lists, per leaf of the folded tree, the index of the graph output to
    use, or the argument name to hand back."""
    recipe, base = [], 0
    for k, o in enumerate(out):
        n = len(pytree.tree_leaves(o))
        recipe.extend([out_args[k]] if k in out_args else range(base, base + n))
        base += n
    items = [None if k in out_args else o for k, o in enumerate(out)]
    return recipe, pytree.tree_flatten(type(out)(*items) if type(out) is not tuple else tuple(items))[1]


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
