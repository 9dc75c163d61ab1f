"""Entry: what fgraph keeps per signature, and how a call runs through it.

It keeps the trace, program, mode, graphs, input buffers and counters. A call copies its inputs in, plans, replays (or
runs the program) and hands its outputs back."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable

import torch
import torch.fx as fx
from tqdm.auto import tqdm

from .. import _primitives as P
from .. import padding
from .._config import config
from .._errors import SignatureError
from .._fx import own_top_level
from .._modes import Mode
from .._pytree import unflattener
from .._signature import Call
from .._state import put_back
from ..compile import Compiled
from . import _graphs as G
from ._buffers import InputBuffers
from ._slots import Slots


class Stats:
    # fast: calls the replay path served (FastPath: no binding, flattening or checks beyond its proofs);
    # copies: calls that copied non-batched inputs into fgraph's buffers (Slots), copied_bytes: how much in all;
    # written_back: donated batched leaves the program wrote, copied back from fgraph's buffer into the caller's;
    # adopted: donated tensors passed anew set onto fgraph's buffer (one copy each; read in place after: Slots)
    __slots__ = (
        *"traces captures warmups replays eager calls fast padded".split(),
        *"copies copied_bytes written_back adopted".split(),
    )

    def __init__(self):
        self.traces = self.captures = self.warmups = self.replays = self.eager = self.calls = self.fast = 0
        self.padded = 0
        self.copies = self.copied_bytes = self.written_back = self.adopted = 0

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}


class Entry:
    """One signature: its trace, program, graphs, input buffers and counters.

    One signature: a trace (shared across buckets), its own copy of the program's top level (so its piece runners
    are its own), its graphs, its input buffers and its counters."""

    def __init__(self, traced, call: Call, device: str, new_trace: bool):
        self.traced, self.sig, self.stats, self.device = traced, call.sig, Stats(), device
        self.statics = dict(call.statics)  # the signature's static values (what plan hooks see)
        self.stats.traces = int(new_trace)
        self.program, self.mode, self.reason = traced.program, traced.mode, traced.reason
        self.module = own_top_level(traced.program.module)
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
        # the outputs copied (copy_outputs): those handed back, inputs handed back as themselves aside
        self.copied_outs = sorted(used - set(self.out_passthrough))
        self.out_batched = traced.batched_outputs(call.sig.bucket)
        self.out_sizes = traced.size_outputs()
        self.specs = [call.specs[i] for i in self.batched_ix]
        self.write_back = [(k, i) for k, i in enumerate(self.batched_ix) if i in traced.written_batched]
        self.graphs: list = []
        # the argument layouts whose addresses were last checked (set after a replay, read by FastPath.find)
        self.verified = None
        self.slots = None  # the inputs its graphs read by address: in place or copied (Slots)
        self.full, self.buffers = None, None
        self.sole = None  # a PIECEWISE program that is one graph piece returned as it is: that graph (_sole_graph)
        self.capture_seconds, self.pool_bytes = 0.0, 0
        self.compiled: dict = {}  # piece name -> its Compiled (compile=...): `how` says symbolic (shared) or static
        self.uncompiled = None  # why Inductor did not serve where it was to (CompileFailed's text), else None

    # -- running ----------------------------------------------------------------------------------------------
    def _args(self, leaves):
        """The program's positional inputs: the static buffers for batched leaves, the caller's tensors otherwise."""
        args = list(leaves)
        for i, b in zip(self.batched_ix, self.buffers.dev):
            args[i] = b
        return [args[i] for i in self.tensor_ix]

    def _plan(self, host: list[torch.Tensor], n: int | None, statics, capturing: bool) -> bool:
        """Run the plan hooks; host: the padded host-side views of the batched leaves (InputBuffers.write).

        True when every hook said the host state its break needs is made (PlanCall): no eager warm-up needed."""
        host = dict(zip(self.batched_ix, host))
        return all(
            [
                P.plan_rules[site.primitive](
                    P.PlanCall(
                        site.primitive,
                        site.args,
                        {k: host[i] for k, i in site.inputs.items()},
                        self.sig.bucket,
                        n or 0,
                        statics,
                        capturing,
                        site.avals,
                    )
                )
                is True
                for site in self.plans
            ]
        )

    def run(self, leaves: list, n: int | None, bound: dict, copy_outputs: bool, check: bool = False):
        """One call: inputs in, plan, replay (or run the program), outputs out.

        Dispatch has made sure every non-batched tensor is read in place or copied (Slots.diverged is empty);
        `check` re-verifies that."""
        st = self.stats
        st.calls += 1
        st.fast += not check
        if n is not None:
            st.padded += self.sig.bucket - n
        slots = self.slots
        if check and slots is not None and slots.diverged(leaves):
            raise SignatureError(f"fgraph.jit: an input of {self.sig.describe()} is not where its graphs read it")
        # batched leaves padded into the input buffers; `host`: the padded views plan hooks read (host side)
        in_graph = self.full is not None and self.buffers.graph_mirror is not None  # the graph copies its inputs
        host = self.buffers.write([leaves[i] for i in self.batched_ix], self.specs, in_graph=in_graph)
        args, copied = leaves, ()
        graph = self.full if self.full is not None else self.sole  # replayed alone: it reads no arguments
        if self.full is None and not self.graphs:
            st.eager += 1
        else:
            st.replays += 1
            if slots is not None and slots.copied:
                copied = slots.copy_in(leaves, st, self.traced.fname)
                args = slots.args(leaves) if graph is None else leaves
        try:
            with P.execution(in_graph=in_graph):
                if self.plans:
                    self._plan(host, n, self.statics, capturing=False)
                outs = graph.replay() if graph is not None else self.module(*self._args(args))
            if copied:
                slots.copy_back(leaves, copied)
        finally:
            if copied:
                slots.restore()
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
                    outs[j] = (
                        outs[j].narrow(d, 0, size) if 0 <= size <= outs[j].shape[d] else padding.cut_error(self, j, d)
                    )
            for j, size in self.out_sizes:  # `x.shape[0]` returned: the call's, not the bucket's
                outs[j] = size(leaves)
        if copy_outputs:
            for j in self.copied_outs:
                if isinstance(o := outs[j], torch.Tensor):
                    outs[j] = o.clone()
        if not self.out_args:
            return self.unflatten(iter(outs))
        return self.unflatten(iter([outs[x] if type(x) is int else bound[x] for x in self.out_recipe]))

    # -- capturing -------------------------------------------------------------------------------------------
    def capture(
        self,
        call: Call,
        pool,
        warmups: int,
        compile: dict | None = None,
        inputs_in_graph: bool = False,
        donate: tuple = (),
        batched: tuple = (),
    ):
        """Warm up, then record this signature's graphs: the pieces (PIECEWISE) or the whole program (FULL).

        With `compile` (Inductor config options; {}: the defaults), Inductor compiles each graph piece first
        (fusing norms, RoPE, activations, residuals); breaks stay as they are. inputs_in_graph (FULL): the graph
        itself copies the batched inputs in (InputBuffers.copy_in_graph). donate, batched: the argument names
        whose tensors are donated and batched, for the Slots of a first capture."""
        t0, mem0 = time.perf_counter(), G.pool_bytes(self.device)
        if compile is not None:  # one compilation per distinct piece, shared (Compiled): most are found, not made
            graph_pieces = [p for p in self.program.pieces if not p.is_break]
            self.compiled = {}
            static = self.sig.bucket is not None and self.sig.bucket <= config.compile_static_max
            for piece in tqdm(graph_pieces, desc=f"fgraph compile {self.sig.describe()}", disable=None, leave=False):
                self.compiled[piece.name] = c = Compiled(piece.name, piece.module, compile, static)
                setattr(self.module, piece.name, c)
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
        with P.execution() as token, put_back(touched) as restore:  # one execution: its plan serves both
            ready = self._plan(host, call.n, call.statics, capturing=True)
            # Warm-up initialises libraries lazily (handles, workspaces) outside the capture: once per trace is enough,
            # unless Inductor compiles each signature's pieces, or a break inside a FULL graph keeps host state per
            # signature that its plan hook did not make (flashinfer's per-bucket wrappers, which its hook makes from
            # the traced shapes: only a hook called without avals leaves them to an eager run). PIECEWISE runs its
            # breaks eagerly in the capture pass itself. An eager run costs a step of the eager model.
            if self.traced.warmed and compile is None and (ready or self.mode is Mode.PIECEWISE):
                warmups = 0
            for _ in range(warmups):  # each run from the call's state: a counter-indexed write stays in bounds
                G.run(self.module, *args)
                restore()
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
                self.sole = _sole_graph(self.module.graph, runners)
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
        if self.slots is None and self.graphs:
            self.slots = Slots(self, call.leaves, donate, batched)

    def uncapture(self) -> None:
        """Let go of the graphs, buffers and compiled pieces, for a capture again: the program's top level is made
        afresh."""
        self.release()
        self.module, self.compiled = own_top_level(self.traced.program.module), {}
        self.verified = None

    def release(self) -> None:
        """Let go of the graphs and input buffers (a dropped or recaptured signature)."""
        self.graphs, self.full, self.buffers, self.sole = [], None, None, None


def _after(first: Callable[[], None], fn: Callable) -> Callable:
    """fn, with `first()` run before it (captured first, when captured)."""

    def run(*args):
        first()
        return fn(*args)

    return run


def _sole_graph(top: fx.Graph, runners: list):
    """The graph of a program that is one graph piece whose outputs its top level returns as they are, else None.

    A run of such a program is that graph's replay (PieceRunner.forward), so a call replays it alone: no top-level
    call of hundreds of arguments (an HF model's parameters) and no module call of the piece. Anything else at the
    top level (an input or constant returned, an output twice, reordered or left out) keeps the program's run."""
    if len(runners) != 1 or runners[0].piece.is_break:
        return None
    graph, name = runners[0].graph, runners[0].piece.name
    nodes = [n for n in top.nodes if n.op != "placeholder"]
    n = len(graph.out) if isinstance(graph.out, (tuple, list)) else -1
    if len(nodes) != n + 2:  # the piece's call, a getitem per output, the output
        return None
    call, out = nodes[0], nodes[-1]
    if call.op != "call_module" or call.target != name or out.op != "output":
        return None
    got = out.args[0]
    same = isinstance(got, (tuple, list)) and len(got) == n
    same = same and all(
        isinstance(g, fx.Node) and g.op == "call_function" and g.target is operator.getitem and g.args == (call, j)
        for j, g in enumerate(got)
    )
    return graph if same else None


class PieceRunner(torch.nn.Module):
    """Stands in for one piece of the program: captures it on its first call and replays it after.

    A break piece is not captured: it runs eagerly every time and copies any tensors it returns into stable buffers."""

    def __init__(self, piece, module, Graph, pool):
        super().__init__()
        self.piece, self.module, self.graph, self.out, self.write = piece, module, None, None, None
        self._Graph, self._pool = Graph, pool

    def forward(self, *args):
        if self.piece.is_break:  # (eager: on the CPU, as every piece is, it runs the program)
            out = G.run(self.module, *args) if self._Graph is G.HostGraph else self.module(*args)
            if self.out is None:
                self.out, self.write = out, G.refiller(out)
            else:
                self.write(out)
            return self.out
        if self.graph is None:
            self.graph = self._Graph(self._pool)
            return self.graph.capture(self.module, *args)
        return self.graph.replay()
