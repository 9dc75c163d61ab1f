"""Cache: what one jitted function keeps per signature, and the only code that changes it.

One per function and options (FunctionState, fgraph/function/_function_state.py), shared by every jit object of them.

Its signatures' entries, the traces they share (one per routine, structure and non-batch shapes, serving every
bucket its symbols fit), the graph pool every signature captures into, fgraph's buffers for inputs copied per call,
and the graphs a caller still holds outputs of. `make` traces and captures a new signature (nothing of it is kept
when that fails), `recapture` captures one again for new tensors, `drop` forgets one, `reset` forgets all.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._config import config
from .._errors import CaptureError, EscapeError, FgraphError, RunError, SignatureError
from .._modes import Mode
from .._pytree import check_static_fields
from .._signature import Call, Signature, device_of, path_str
from .._state import outside_inference_mode
from ..capture import Entry, new_pool, ran
from ..compile import CompileFailed
from ..trace import InitialisesState, Traced
from ._fastpath import FastPath

log = logging.getLogger("fgraph")

GRAD_MODE = "<grad mode>"  # the signature entry naming the grad mode, for traces that branched on it


class Cache:
    """Per jitted function: its entries by signature, traces by family, the graph pool, copied-input buffers.

    `owner`: the function's Shared state (name, options, log_once). It holds no reference to the function: the jit
    object that calls traces with (make, probe) is passed in."""

    def __init__(self, owner, fastpath: FastPath):
        self.owner, self.fastpath = owner, fastpath
        self.entries: dict[Signature, Entry] = {}
        self.traces: dict[tuple, list[Traced]] = {}  # (statics, structure, non-batch shapes) -> traces
        self.pool = None
        self.retired: list = []  # entries (or graphs) replaced while a caller still held their outputs
        self.owned: dict = {}  # fgraph's buffers for inputs copied per call (Slots.move), shared by signatures
        # signatures of new families made by calls (not capture()): bounded by config.max_signatures. Another bucket
        # of a known family is not counted: the buckets declared bound those, and they retrace nothing
        self.made = 0

    # -- finding -----------------------------------------------------------------------------------------------
    def for_grad_mode(self, call: Call) -> Call:
        """A trace that branched on torch.is_grad_enabled() serves only the grad mode it was traced in.

        Under the other, the call's signature names the grad mode too (a trace of its own). Functions that never
        read it are not keyed by it, so a capture under torch.no_grad() still serves calls made with grad on."""
        entry, now = self.entries.get(call.sig), torch.is_grad_enabled()
        if entry is None or entry.traced.grad_mode in (None, now):
            return call
        return call._replace(sig=call.sig._replace(statics=call.sig.statics + ((GRAD_MODE, now),)))

    def closest(self, sig: Signature) -> str:
        """The nearest known signature and the first thing that differs (JAX's explain_cache_misses)."""
        return closest(self.entries, sig)

    def probe(self, jitted, call: Call) -> Entry:
        """The entry serving `call`, traced now (by `jitted`) if new but neither captured nor kept (explain, lower)."""
        e = self.entries.get(call.sig)
        if e is None:
            device = device_of(self.owner.name, call)
            e = Entry(Traced(jitted, call, device), call, device, True)
        return e

    # -- making ------------------------------------------------------------------------------------------------
    def make(self, jitted, call: Call, capture_call: Call) -> Entry | None:
        """A new signature's entry, traced (by `jitted`, the jit object called) and captured.

        Nothing of it is kept when that fails or is interrupted (KeyboardInterrupt included): the next call
        makes it again. Returns None when the capture ran out of device memory (what it made is freed; the
        caller runs the call eagerly)."""
        try:
            entry = self._new_entry(
                jitted, call
            )  # tracing: its errors are the trace's own (TraceError, the function's)
        except BaseException:
            self.drop(call.sig, None)
            raise
        try:
            self.capture(entry, capture_call)
            return entry
        except BaseException as e:
            self.drop(call.sig, entry)
            if isinstance(e, torch.OutOfMemoryError):
                return None
            if isinstance(e, FgraphError) or not isinstance(e, Exception):
                raise
            what = f"the warm-up or capture of signature {call.sig.describe()} failed: {type(e).__name__}: {e}"
            if _fake_in(e):  # a value that escaped a trace, read where the trace could not see it: not eager's error
                raise EscapeError(
                    f"fgraph.jit({self.owner.name}): {what}; a fake tensor (a value that escaped a trace, no data) "
                    "reached it",
                    "return values from jitted functions instead of storing them outside (jitted functions are pure); "
                    "the signature was dropped and the next call tries again",
                ) from e
            if ran(e):  # the program itself failed on real tensors: nothing was being captured
                where = (
                    "the warm-up before its capture"
                    if entry.device.startswith("cuda")
                    else ("its first run (on the CPU nothing is captured: the traced program runs eagerly)")
                )
                raise RunError(
                    f"fgraph.jit({self.owner.name}): the traced program of signature {call.sig.describe()} failed in "
                    f"{where}: {type(e).__name__}: {e}",
                    "run the function eagerly on these inputs to debug (fgraph.disable_jit()), where a failure of "
                    "its own shows; the signature was dropped and the next call tries again",
                ) from e
            raise CaptureError(
                f"fgraph.jit({self.owner.name}): {what}",
                "run the function eagerly on these inputs to debug (fgraph.disable_jit()), where a failure of its "
                "own shows; the signature was dropped and the next call tries again",
            ) from e

    @staticmethod
    def family(call: Call) -> tuple:
        """What a signature shares with the signatures of its other buckets (the key of their traces): the statics,
        grad mode apart (a trace that branched on it serves its own mode, any other both), the structure, and each
        leaf with its batch axis at its family's size."""
        return (
            tuple(kv for kv in call.sig.statics if kv[0] != GRAD_MODE),
            call.sig.treespec,
            tuple(
                leaf if s is None else leaf._replace(shape=s.family_shape(leaf.shape))
                for leaf, s in zip(call.sig.leaves, call.specs)
            ),
        )

    def _new_entry(self, jitted, call: Call) -> Entry:
        """An entry for a new signature, on an existing trace when one fits its bucket, else on a new trace.

        One trace per routine and structure serves every bucket >= 2."""
        for k, v in pytree.tree_unflatten(call.leaves, call.sig.treespec).items():
            check_static_fields(v, f"fgraph.jit({jitted.name}): {k}")
        if config.explain_cache_misses:  # the first miss too, as jax says "never seen function"
            why = self.closest(call.sig) if self.entries else "; the first of this function (none made before)"
            log.warning("fgraph.jit(%s): new signature %s%s", jitted.name, call.sig.describe(), why)
        try:
            device = device_of(jitted.name, call)
        except SignatureError as split_devices:  # unless this call is the one that moves them (a lazily made cache)
            try:
                Traced(jitted, call, device_of(jitted.name, call, strict=False))
            except InitialisesState:
                raise
            except Exception as e:
                raise split_devices from e
            raise
        family = self.family(call)
        now = torch.is_grad_enabled()
        fits = (t for t in self.traces.get(family, ()) if t.fits(call.sig.bucket) and t.grad_mode in (None, now))
        traced = next(fits, None)
        new = traced is None
        if new:
            traced = Traced(jitted, call, device)
            self.traces.setdefault(family, []).append(traced)
            opts = self.owner.options
            want = opts.mode.for_routine(call.statics.get(opts.routine) == "decode")
            if traced.mode is not want:
                self.owner.log_once(("downgrade", call.sig.statics), "%s: %s", call.sig.describe(), traced.reason)
        entry = Entry(traced, call, device, new)
        self.entries[call.sig] = entry
        return entry

    def capture(self, entry: Entry, call: Call) -> None:
        """Warm up and capture `entry` on `call` (a graphless mode only runs it), into the function's pool."""
        opts = self.owner.options
        graphed = entry.mode is not Mode.NONE
        compile = opts.compile_for(entry.device) if graphed else None
        try:
            self._capture(entry, call, compile)
        except CompileFailed as e:
            if not opts.compile_default:  # asked for by name: the user's to change
                raise CaptureError(
                    f"fgraph.jit({self.owner.name}, compile={compile or True!r}): {entry.sig.describe()}: {e}",
                    "leave compile= out (the default runs such a signature as uncompiled graphs) or pass compile=False",
                ) from e.__cause__
            self.owner.log_once(
                ("uncompiled", e.piece),
                "%s: %s; it runs uncompiled graphs (logged once). Fix: compile=False to skip compiling",
                entry.sig.describe(),
                e,
            )
            entry.uncapture()
            self._capture(entry, call, None)
            entry.uncompiled = str(e)
        if config.log_captures and graphed:
            log.warning(
                "fgraph.jit(%s): captured %d %s graph(s) for %s in %.3f s, pool +%.3f GiB",
                self.owner.name,
                len(entry.graphs),
                entry.mode.name,
                entry.sig.describe(),
                entry.capture_seconds,
                entry.pool_bytes / 2**30,
            )

    def _capture(self, entry: Entry, call: Call, compile: dict | None) -> None:
        opts, graphed = self.owner.options, entry.mode is not Mode.NONE
        entry.capture(  # in the call's grad and inference modes (its signature's): it writes the caller's state
            call,
            self._pool(entry.device) if graphed else None,
            opts.warmups if graphed else 0,
            compile,
            config.inputs_in_graph,
            donate=opts.donate,
            batched=tuple(opts.batch),
        )

    def _pool(self, device):
        if self.pool is None:
            self.pool = new_pool(device)
        return self.pool

    def recapture(self, entry: Entry, call: Call, moved: list[int]) -> None:
        """Capture the signature again because positions `moved` of the entry's address inputs got new tensors.

        The new tensors are read in place or from fgraph's buffers (Slots.move). Counted in stats() as captures."""
        if self.owner.options.strict:
            paths = [entry.paths[entry.slots.ix[k]] for k in moved]
            raise SignatureError(
                f"fgraph.jit({self.owner.name}, strict=True): {', '.join(paths)} is not the tensor the graphs of "
                f"signature {entry.sig.describe()} read (strict: no input copies)",
                "pass the same tensors each call (update them in place), or call .reset() after replacing them",
            )
        old = entry.graphs
        with outside_inference_mode():  # buffers shared by signatures of either inference mode: writable by both
            entry.slots.move(moved, self.owned, call.leaves)
        c = call._replace(leaves=entry.slots.args(call.leaves))
        entry.uncapture()
        # warm-up and capture run the function: Entry.capture puts back the donated tensors they write
        try:
            self.capture(entry, c.padding_only(c.sig.bucket) if c.n is not None else c)
        except BaseException:
            self.drop(call.sig, entry)
            raise
        self.retired.extend([_Held(g) for g in old if g.in_use()])

    def drop(self, sig: Signature, entry: Entry | None) -> None:
        """Forget a signature and anything half made for it: its entry, a trace made for it, replay keys, graphs."""
        self.entries.pop(sig, None)
        if entry is None:
            return
        self.fastpath.forget(entry)
        if entry.stats.traces:  # the trace was made for this entry: drop it too (it may be half warmed)
            for family in self.traces.values():
                if entry.traced in family:
                    family.remove(entry.traced)
        entry.release()
        if entry.device.startswith("cuda"):
            with contextlib.suppress(Exception):  # the error being handled is the one to report
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

    def reset(self) -> None:
        """Drop every trace and graph.

        Graphs whose outputs the caller still holds keep their memory (retired, not freed) until a later reset
        finds them unused."""
        self.retired = [e for e in [*self.retired, *self.entries.values()] if any(g.in_use() for g in e.graphs)]
        self.entries.clear()
        self.traces.clear()
        self.owned.clear()
        self.fastpath.clear()
        self.made, self.pool = 0, None

    # -- reporting ---------------------------------------------------------------------------------------------
    def warn_retraces(self, call: Call) -> None:
        """Once a function has made config.warn_signatures signatures by itself, say so once, with what differs."""
        if self.made != config.warn_signatures + 1:
            return
        scalars = [
            f"{path_str(p)}={x!r}"
            for p, x in zip(call.paths, call.leaves)
            if isinstance(x, (int, float, bool)) and not isinstance(x, torch.Tensor)
        ]
        axes = self._shape_axes(call)
        fix = (
            "pass values that change per call as tensors (torch.tensor(step)), or declare them static= and capture() "
            "the ones you need"
        )
        if axes:  # a size that changes per call cannot be passed as a tensor: it is a shape axis, padded to buckets
            fix = (
                f"declare {' and '.join(f'{p} Batched(axis={d})' for p, d, _ in axes)} in batch= with buckets=[...]: "
                "each call is padded to the smallest bucket that fits, one trace serving every bucket"
                + "".join(
                    f" ({p} is Batched(axis={s.axis}) now: one axis is padded, so keep its size fixed, or pad it "
                    "yourself)"
                    for p, _, s in axes[:1]
                    if s is not None
                )
            )
        log.warning(
            "fgraph.jit(%s): %d signatures made by calls%s%s%s (logged once; past fgraph.config.max_signatures=%d new "
            "ones run eagerly). Fix: %s",
            self.owner.name,
            self.made,
            closest({k: e for k, e in self.entries.items() if k != call.sig}, call.sig),
            f"; Python scalars are part of the signature, by value: {', '.join(scalars)}" if scalars else "",
            "; tensor sizes differ per call, along "
            + ", ".join(f"dim {d} of {p}" for p, d, _ in axes)
            + " (a shape is part of the signature)"
            if axes
            else "",
            config.max_signatures,
            fix,
        )

    def _shape_axes(self, call: Call) -> list[tuple[str, int, Any]]:
        """(key path, dim, its Batched or None) of the tensor leaves whose size along a dim (not their batch axis)
        differs between the signatures made so far and this call's: shape axes that vary per call."""
        out = []
        for i, (path, leaf, spec) in enumerate(zip(call.paths, call.sig.leaves, call.specs)):
            if leaf.shape is None:
                continue
            differ = set()
            for sig in self.entries:
                if sig.treespec != call.sig.treespec or len(sig.leaves) != len(call.sig.leaves):
                    continue
                other = sig.leaves[i].shape
                if other is not None and len(other) == len(leaf.shape):
                    differ.update(d for d, (a, b) in enumerate(zip(other, leaf.shape)) if a != b)
            differ.discard(spec.axis if spec is not None else None)  # (its batch axis: padded to the buckets)
            if differ:
                out.append((path_str(path), min(differ), spec))
        return out

    def stats(self) -> dict[str, dict]:
        """Counters per signature, keyed by its description (plus the leaves that tell apart ones described alike)."""
        return {k: e.stats.as_dict() for k, e in stats_keys(self.entries.values())}


def _fake_in(e: BaseException) -> bool:
    """Whether an exception (or one in its chain) is about a fake tensor: its message names one."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if "FakeTensor" in str(e) or "fake tensor" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


class _Held:
    """Graphs replaced by a recapture whose outputs a caller still holds (kept, like reset()'s retired entries)."""

    def __init__(self, graph):
        self.graphs = [graph]


def closest(entries: dict, sig) -> str:
    """The nearest known signature and the first thing that differs (JAX's explain_cache_misses)."""
    if not entries:
        return ""

    def diff(a: Signature, b: Signature):
        if a.statics != b.statics:
            return 3, f"static arguments {dict(b.statics)} vs {dict(a.statics)}"
        if a.treespec != b.treespec:
            return 2, "the tree structure of the arguments"
        if a.bucket != b.bucket:
            return 1, f"bucket {b.bucket} vs {a.bucket}"
        some = next(((i, x, y) for i, (x, y) in enumerate(zip(a.leaves, b.leaves)) if x != y), None)
        return 0, f"leaf #{some[0]}: {some[2]} vs {some[1]}" if some else "nothing"

    entry = min(entries.values(), key=lambda e: diff(sig, e.sig)[0])
    what = diff(sig, entry.sig)[1]
    if what.startswith("leaf #"):
        i = int(what[6 : what.index(":")])
        what = f"{entry.paths[i]}: {sig.leaves[i]} (captured {entry.sig.leaves[i]})"
    return f"; closest captured signature {entry.sig.describe()} differs in {what}"


def stats_keys(entries) -> list[tuple[str, Any]]:
    """(key, entry) per signature: its description, plus, where signatures share one, the leaves that differ."""
    groups: dict[str, list] = {}
    for e in entries:
        groups.setdefault(e.sig.describe(), []).append(e)
    out = []
    for d, es in groups.items():
        if len(es) == 1:
            out.append((d, es[0]))
            continue
        for e in es:
            if any(o.sig.treespec != e.sig.treespec or len(o.sig.leaves) != len(e.sig.leaves) for o in es):
                diff = [f"structure #{es.index(e)}"]
            else:
                differ = [i for i in range(len(e.sig.leaves)) if len({o.sig.leaves[i] for o in es}) > 1]
                diff = [f"{e.paths[i]}: {e.sig.leaves[i]}" for i in differ]
            out.append((f"{d} {{{', '.join(diff)}}}", e))
    return out
