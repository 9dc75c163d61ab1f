"""Entry: what fgraph keeps per signature (trace, program, mode, graphs, input buffers, counters), and how a
call runs through it: copy inputs in, plan, replay (or run the program), hand outputs back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from . import _graphs as G
from . import _outputs as O
from . import _primitives as P
from ._bind import invoke
from ._buffers import InputBuffers
from ._errors import SignatureError
from ._inductor import Compiled
from ._modes import Mode, resolve_mode
from ._padding import BatchAxes, find_mixing, tied_lengths
from ._pytree import holds, tree_flatten, unflattener
from ._random import random_draws
from ._signature import Signature, aval_of, path_str
from ._split import Program, breaks_filter, split
from ._state import put_back, root_of
from ._trace import _write_targets, base_of, check, trace

log = logging.getLogger("fgraph")


class Call(NamedTuple):
    """One call, flattened, with its bucket found (batched leaves stay unpadded: the entry pads them into its
    input buffers): everything dispatch needs."""

    sig: Signature
    statics: dict[str, Any]
    paths: list  # key path per leaf
    leaves: list  # leaves as passed (batched ones unpadded: the entry pads them into its buffers)
    specs: list  # Batched | None per leaf
    n: int | None  # real tokens
    bound: dict  # argument name -> value, as passed


class Stats:
    # copies: calls that copied non-batched inputs into fgraph's buffers (Slots), copied_bytes: how much in all;
    # written_back: donated batched leaves the program wrote, copied back from fgraph's buffer into the caller's
    __slots__ = tuple("traces captures warmups replays eager calls padded copies copied_bytes written_back".split())

    def __init__(self):
        self.traces = self.captures = self.warmups = self.replays = self.eager = self.calls = self.padded = 0
        self.copies = self.copied_bytes = self.written_back = 0

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}


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

        def flat_fn(*tensors):
            leaves = list(consts)
            for i, t in zip(tensor_ix, tensors):
                leaves[i] = t
            dyn = pytree.tree_unflatten(leaves, call.sig.treespec)
            passed = {name: tree_flatten(v) for name, v in dyn.items()}
            out = invoke(jitted, dyn, call.statics)
            out_leaves, self.out_spec = tree_flatten(out)
            O.refuse_opaque_outputs(fname, out, out_leaves)
            if isinstance(out, tuple):  # `return logits, state`: hand the caller's own `state` back (no unflattening
                # per call) if it holds what was passed; one the function stored into (state["h"] = h) is traced
                held = {k: name for k, o in enumerate(out) for name, v in dyn.items() if o is v}
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
        gm, self.shapes = trace(fname, flat_fn, example, axes, [self.paths[i] for i in tensor_ix])
        self.gm = gm  # the whole program, unsplit (Jitted.lower)
        self.grad_mode = gm.meta["grad_mode"]  # the grad mode the function branched on, else None (serves both)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        ph_paths = {ph: self.paths[i] for ph, i in zip(placeholders, tensor_ix)}
        donated_roots = set(jitted.donate)
        check(fname, gm, ph_paths, lambda ph: root_of(ph_paths[ph]) in donated_roots, device)
        self.random = random_draws(jitted, gm)
        is_break = breaks_filter(jitted.breaks)
        decode = call.statics.get(jitted.routine) == "decode"
        self.mode, self.reason = resolve_mode(fname, jitted.mode, decode, gm, is_break)
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
        writes = {base_of(t) for node in gm.graph.nodes for t in _write_targets(node)}
        self.written = [i for ph, i in zip(placeholders, tensor_ix) if ph in writes and call.specs[i] is None]
        # donated batched leaves it writes: the program writes fgraph's padded buffer, so the caller's rows are
        # copied back after each call (as eager writes the caller's tensor), and their padding is written again
        self.written_batched = {
            i for ph, i in zip(placeholders, tensor_ix) if ph in writes and call.specs[i] is not None
        }
        self.scratch = {i for i in self.written if root_of(self.paths[i]) in jitted.scratch}
        self._padding(jitted, call, gm, ph_paths)
        self.warmed = False  # has a signature of this trace been warmed up (see Entry.capture)
        self._direct: dict[str, fx.GraphModule] = {}

    def direct(self, piece) -> fx.GraphModule:
        """The break piece as run between PIECEWISE graphs (see _direct); made once per trace, shared by every
        signature (a break piece holds no state)."""
        m = self._direct.get(piece.name)
        if m is None:
            m = self._direct[piece.name] = _direct(piece.module)
        return m

    def _padding(self, jitted, call: Call, gm: fx.GraphModule, ph_paths: dict) -> None:
        """What padding can change (logged once per place), the leaves the trace ties to one batch size, and how
        each output is cut back to the unpadded call's shape (symbolic traces only: see fgraph/_padding.py)."""
        self.axes = self.mixing = None
        self.tied = []
        if self.shapes is None:
            return
        batched = [(self.paths[i], i, call.specs[i].axis, call.specs[i]) for i in self.batched_ix]
        self.axes = BatchAxes(self.shapes, batched)
        self.mixing = find_mixing(gm, self.axes, set(jitted.scratch), ph_paths, jitted.buckets)
        self.tied = tied_lengths(self.axes)
        O.refuse_shrinking_outputs(jitted.name, gm, self.axes, set(self.out_passthrough))
        for f in self.mixing:
            if ("padding", f.op, f.line) not in jitted._logged:
                jitted._logged.add(("padding", f.op, f.line))
                log.warning(
                    "fgraph.jit(%s): padding is visible: %s; calls padded to a bucket differ from the unpadded "
                    "call (logged once). Fix: mask the padded rows, or declare Batched(mixes=True) if intended",
                    jitted.name,
                    f,
                )

    def fits(self, bucket: int | None) -> bool:
        return bucket == self.bucket if self.shapes is None else bucket is not None and self.shapes.fits(bucket)

    def size_outputs(self) -> list[tuple]:
        """(output, size(leaves)) per output that is a size computed from the batch (fgraph/_padding.py)."""
        return [] if self.axes is None else O.output_sizes(self.axes, self.outs)

    def batched_outputs(self, bucket: int | None) -> list[tuple]:
        """(output, dim, size) per output dim cut back per call to size(leaves) (None: to N), the unpadded call's
        size. Symbolic traces: every dim sized by a batch symbol; static ones (bucket 1): a first dim equal to the
        bucket. The caller's own tensors never are."""
        if bucket is None:
            return []
        rows = [] if self.axes is None else O.output_rows(self.axes, self.outs, set(self.out_passthrough))
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


class Entry:
    """One signature: a trace (shared across buckets), its own copy of the program's top level (so its piece
    runners are its own), its graphs, its input buffers and its counters."""

    def __init__(self, traced: Traced, call: Call, device: str, new_trace: bool):
        self.traced, self.sig, self.stats, self.device = traced, call.sig, Stats(), device
        self.statics = dict(call.statics)  # the signature's static values (what plan hooks see)
        self.stats.traces = int(new_trace)
        self.program, self.mode, self.reason = traced.program, traced.mode, traced.reason
        self.module = _own_top_level(traced.program.module)
        self.tensor_ix = traced.tensor_ix
        self.paths = traced.paths
        self.batched_ix = traced.batched_ix
        self.address_ix = traced.address_ix
        self.out_spec = traced.out_spec
        self.out_args = traced.out_args
        self.out_passthrough = traced.out_passthrough
        self.plans = traced.plans
        self.out_recipe = getattr(traced, "out_recipe", None)
        self.unflatten = unflattener(self.out_spec)
        # outputs that are inputs handed back, minus those inside a folded argument (the caller's own object is
        # returned whole: a decode step's 48-64 cache tensors need no per-call copying into the output list)
        used = (
            set(range(len(traced.outs))) if self.out_recipe is None else {x for x in self.out_recipe if type(x) is int}
        )
        self.passthrough = [(j, i) for j, i in self.out_passthrough.items() if j in used]
        self.out_batched = traced.batched_outputs(call.sig.bucket)
        self.out_sizes = traced.size_outputs()
        self.specs = [call.specs[i] for i in self.batched_ix]
        self.write_back = [(k, i) for k, i in enumerate(self.batched_ix) if i in traced.written_batched]
        self.graphs: list = []
        self.verified = None  # the argument layouts whose addresses were last checked (see Jitted._fast_call)
        self.slots = None  # the inputs its graphs read by address: in place or copied (_dispatch.Slots)
        self.full, self.buffers = None, None
        self.capture_seconds, self.pool_bytes = 0.0, 0

    # -- running ----------------------------------------------------------------------------------------------
    def _args(self, leaves):
        """The program's positional inputs: the static buffers for batched leaves, the caller's tensors otherwise."""
        args = list(leaves)
        for i, b in zip(self.batched_ix, self.buffers.dev):
            args[i] = b
        return [args[i] for i in self.tensor_ix]

    def _plan(self, host: list[torch.Tensor], n: int | None, statics, capturing: bool) -> bool:
        """Run the plan hooks; host: the padded host-side views of the batched leaves (InputBuffers.write). True
        when every hook said the host state its break needs is made (PlanCall): no eager warm-up needed."""
        host = dict(zip(self.batched_ix, host))
        return all(
            [
                P.plan_rules[p](
                    P.PlanCall(
                        p,
                        args,
                        {k: host[i] for k, i in inputs.items()},
                        self.sig.bucket,
                        n or 0,
                        statics,
                        capturing,
                        avals,
                    )
                )
                is True
                for p, args, inputs, avals in self.plans
            ]
        )

    def run(self, leaves: list, n: int | None, bound: dict, copy_outputs: bool, check: bool = False):
        """One call: inputs in, plan, replay (or run the program), outputs out. Dispatch has made sure every
        non-batched tensor is read in place or copied (Slots.diverged is empty); `check` re-verifies that."""
        st = self.stats
        st.calls += 1
        if n is not None:
            st.padded += self.sig.bucket - n
        slots = self.slots
        if check and slots is not None and slots.diverged(leaves):
            raise SignatureError(f"fgraph.jit: an input of {self.sig.describe()} is not where its graphs read it")
        # batched leaves padded into the input buffers; `host`: the padded views plan hooks read (host side)
        in_graph = self.full is not None and self.buffers.graph_mirror is not None  # the graph copies its inputs
        host = self.buffers.write([leaves[i] for i in self.batched_ix], self.specs, in_graph=in_graph)
        args = leaves
        if self.full is None and not self.graphs:
            st.eager += 1
        else:
            st.replays += 1
            if slots is not None and slots.copied:
                slots.copy_in(leaves, st, self.traced.fname)
                args = slots.args(leaves)
        with P.execution(in_graph=in_graph):
            if self.plans:
                self._plan(host, n, self.statics, capturing=False)
            outs = self.full.replay() if self.full is not None else self.module(*self._args(args))
        if args is not leaves:
            slots.copy_back(leaves)
        for k, i in self.write_back:  # the caller's rows of a donated batched leaf the program wrote (padding cut)
            x = leaves[i]
            x.copy_(self.buffers.dev[k][tuple(slice(0, d) for d in x.shape)])
            st.written_back += 1
        return self._outputs(leaves, n, bound, outs, copy_outputs)

    def _outputs(self, leaves, n, bound, outs, copy_outputs: bool):
        outs = list(outs)
        for j, i in self.passthrough:
            outs[j] = leaves[i]
        if n is not None:
            for j, d, rows in self.out_batched:  # cut back to the unpadded call's size (Traced.batched_outputs)
                size = n if rows is None else rows(leaves)
                if outs[j].shape[d] != size:
                    outs[j] = outs[j].narrow(d, 0, size) if 0 <= size <= outs[j].shape[d] else O.cut_error(self, j, d)
            for j, size in self.out_sizes:  # `x.shape[0]` returned: the call's, not the bucket's
                outs[j] = size(leaves)
        if copy_outputs:
            outs = [
                o.clone() if isinstance(o, torch.Tensor) and j not in self.out_passthrough else o
                for j, o in enumerate(outs)
            ]
        if not self.out_args:
            return self.unflatten(iter(outs))
        return self.unflatten(iter([outs[x] if type(x) is int else bound[x] for x in self.out_recipe]))

    # -- capturing -------------------------------------------------------------------------------------------
    def capture(self, call: Call, pool, warmups: int, compile: dict | None = None, inputs_in_graph: bool = False):
        """Warm up, then record this signature's graphs: the pieces (PIECEWISE) or the whole program (FULL).
        With `compile` (Inductor config options; {}: the defaults), Inductor compiles each graph piece first
        (fusing norms, RoPE, activations, residuals); breaks stay as they are. inputs_in_graph (FULL): the graph
        itself copies the batched inputs in (InputBuffers.copy_in_graph)."""
        t0, mem0 = time.perf_counter(), G.pool_bytes(self.device)
        if compile is not None:
            for piece in self.program.pieces:
                if not piece.is_break:
                    setattr(self.module, piece.name, Compiled(piece.module, compile))
        self.buffers = InputBuffers(
            [(self.sig.leaves[i].shape, call.leaves[i].dtype) for i in self.batched_ix],
            self.device,
            written=[k for k, _ in self.write_back],
        )
        host = self.buffers.write([call.leaves[i] for i in self.batched_ix], self.specs)
        args = self._args(call.leaves)
        # donated leaves the program writes go back to their values after warm-up and capture (fgraph/_state.py);
        # scratch ones are left to the function's padding contract when capture runs on all-padding inputs
        touched = [call.leaves[i] for i in self.traced.written if not (call.n == 0 and i in self.traced.scratch)]
        with P.execution() as token, put_back(touched):  # one execution: its plan serves warm-up and capture
            ready = self._plan(host, call.n, call.statics, capturing=True)
            # Warm-up initialises libraries lazily (handles, workspaces) outside the capture: once per trace is enough,
            # unless Inductor compiles each signature's pieces, or a break inside a FULL graph keeps host state per
            # signature that its plan hook did not make (flashinfer's per-bucket wrappers, which its hook makes from
            # the traced shapes: only a hook called without avals leaves them to an eager run). PIECEWISE runs its
            # breaks eagerly in the capture pass itself. An eager run costs a step of the eager model.
            if self.traced.warmed and compile is None and (ready or self.mode is Mode.PIECEWISE):
                warmups = 0
            for _ in range(warmups):
                self.module(*args)
            self.stats.warmups += warmups
            self.traced.warmed = self.traced.warmed or warmups > 0
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            Graph = G.graph_class(self.device)
            if self.mode is Mode.PIECEWISE:
                pieces = self.program.pieces
                runners = [
                    PieceRunner(p, self.traced.direct(p) if p.is_break else getattr(self.module, p.name), Graph, pool)
                    for p in pieces
                ]
                for r in runners:
                    setattr(self.module, r.piece.name, r)
                self.module(*args)  # the runners capture on this first call, replay on later ones
                self.graphs = [r.graph for r in runners if not r.piece.is_break]
            elif self.mode is Mode.FULL:
                self.full = Graph(pool)
                if inputs_in_graph:
                    token.in_graph = True  # breaks capture their own staged inputs' copies too (P.Token)
                    self.full.capture(_after(self.buffers.copy_in_graph(), self.module), *args)
                else:
                    self.full.capture(self.module, *args)
                self.graphs.append(self.full)
        for g in self.graphs:  # only now: the pieces of this signature must not reuse each other's outputs
            g.weaken()
        self.stats.captures += len(self.graphs)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.pool_bytes = G.pool_bytes(self.device) - mem0


def _self_of(o):
    """The tensor an output is, through in-place ops (aten's `op_` variants return their first argument)."""
    while isinstance(o, fx.Node) and isinstance(o.target, torch._ops.OpOverload) and o.args:
        if not (o.target._schema.name.endswith("_") and isinstance(o.args[0], fx.Node)):
            break
        o = o.args[0]
    return o


def _after(first: Callable[[], None], fn: Callable) -> Callable:
    """fn, with `first()` run before it (captured first, when captured)."""

    def run(*args):
        first()
        return fn(*args)

    return run


def _own_top_level(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the program's top level with its own submodule table (piece runners are set per signature) that
    shares the generated code: fx.GraphModule(gm, graph) would regenerate and recompile every piece's Python,
    which was half of capture time (~0.2 s per signature on 0.5B)."""
    m = object.__new__(type(gm))
    m.__dict__.update(gm.__dict__)
    m.__dict__["_modules"] = dict(gm._modules)
    return m


def _fold_arguments(out: tuple, out_args: dict[int, str]):
    """Outputs that are the caller's own arguments become one leaf each: (recipe, spec), where the recipe lists,
    per leaf of the folded tree, the index of the graph output to use, or the argument name to hand back."""
    recipe, base = [], 0
    for k, o in enumerate(out):
        n = len(pytree.tree_leaves(o))
        recipe.extend([out_args[k]] if k in out_args else range(base, base + n))
        base += n
    return recipe, pytree.tree_flatten(tuple(None if k in out_args else o for k, o in enumerate(out)))[1]


class PieceRunner(torch.nn.Module):
    """Stands in for one piece of the program: captures a graph piece on its first call and replays it after;
    a break piece runs eagerly every time and copies any tensors it returns into stable buffers."""

    def __init__(self, piece, module, Graph, pool):
        super().__init__()
        self.piece, self.module, self.graph, self.out = piece, module, None, None
        self._Graph, self._pool = Graph, pool

    def forward(self, *args):
        if self.piece.is_break:
            out = self.module(*args)
            if self.out is None:
                self.out = out
            else:
                for old, new in zip(pytree.tree_leaves(self.out), pytree.tree_leaves(out)):
                    if isinstance(old, torch.Tensor) and old is not new:
                        old.copy_(new)
            return self.out
        if self.graph is None:
            self.graph = self._Graph(self._pool)
            return self.graph.capture(self.module, *args)
        return self.graph.replay()


def _direct(module: fx.GraphModule) -> fx.GraphModule:
    """A break piece that calls its primitives' eager rules as plain Python functions: the same call, minus the
    dispatcher and torch.library's wrapper around it (tens of µs per break, paid by every eager break of every
    PIECEWISE step). Only for running outside a graph: under capture the op goes through the dispatcher."""
    graph = fx.Graph()
    env = {}
    for node in module.graph.nodes:
        env[node] = new = graph.node_copy(node, lambda n: env[n])
        p = P.primitive_of(node)
        if p is not None:
            new.target = P.eager_rules[p]
    return fx.GraphModule(module, graph)


def _plan_sites(gm, ph_pos, tensor_ix, specs):
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
        sites.setdefault(key, (p, args, inputs, avals))
    return list(sites.values())
