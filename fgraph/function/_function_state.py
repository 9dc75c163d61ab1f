"""FunctionState: what a jitted function keeps, one per function object and options, for every jit object of them,
and the policy of a call the replay path did not serve (make, fall back, seal, cap).

jax.jit caches per function and options: `for _ in range(3): fgraph.jit(f)(x)` traces f once. Each jit object of
one function object and equal options is a view of one FunctionState, found in a process-wide map held weakly
(`_shared`): it goes away with the function.

What is shared never gives another answer than a jit object of its own would: the key is the function object itself
(a closure made again is a new function: its own state) and options compared by value; the tensors a call reads
(arguments, lifted parameters, closed-over and global tensors) are read per call by the jit object called, as
without sharing. What a trace freezes (Python values the function reads) is frozen for every view, as under jax.jit:
`.reset()` on any view traces again for all.

A FunctionState holds no reference to the function (the map's weak key would never die): the jit object that calls
is passed to what traces or runs it (`call`, Cache.make, Cache.probe).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree

from .. import trace as T
from .._config import config
from .._errors import EscapeError, FgraphError, SignatureError
from .._pytree import is_seen_into, see_into
from .._signature import Call, device_of, static_key, undeclared_batched
from ..padding import check_aliases, check_lengths, declare_fix
from ._cache import Cache
from ._fastpath import FastPath, layout_key

log = logging.getLogger("fgraph")


class Ungraphed(NamedTuple):
    """A call no graph serves: its fallback kind (`empty`, `oversize`) and what to log (None: nothing to fix)."""

    kind: str
    what: str | None


class FunctionState:
    """One function's jit state, for given options, and the policy that changes it: what every jit object of them
    is a view of. It owns the Cache (signatures' entries, traces, the graph pool), the replay path's FastPath,
    whether capture() sealed it, the fallback counts, the calls that make donated state, the warnings logged once
    and the lock; a view replays what the fast path finds and hands every other call to `call`."""

    def __init__(self, name: str, signature, options):
        self.name, self.options = name, options
        self.fastpath = FastPath(name, signature, options.static, options.batch, options.buckets)
        self.cache = Cache(self, self.fastpath)
        self.sealed = False  # capture() ran: unseen signatures run eagerly (or raise with strict) from now on
        self.fallbacks = {"unseen": 0, "oversize": 0, "cap": 0, "oom": 0, "empty": 0, "init": 0, "branch": 0}
        self.logged: set = set()  # warnings already logged once
        self.initialising: set = set()  # signatures whose calls make donated state's tensors: run eagerly
        # the same calls by `_call_key`: found again without binding (which reads every lifted tensor: costly for an
        # HF model's prefill, where generate makes a new cache each call)
        self.initialising_calls: set = set()
        # signatures whose first call ran eagerly because donated objects said they held no tensors (`first_makes`)
        self.probed: set = set()
        self.lock = threading.RLock()  # one call at a time: buffers, graphs and outputs are shared per function

    def log_once(self, key, fmt: str, *args) -> None:
        """Log a warning about this function once per key."""
        if key not in self.logged:
            self.logged.add(key)
            log.warning("fgraph.jit(%s): " + fmt, self.name, *args)

    def reset(self) -> None:
        self.cache.reset()
        self.sealed = False

    def note_initialising(self, jitted, args: tuple, kwargs: dict) -> None:
        """Remember a call whose signature makes donated state (before it runs: its state not yet made). Not with
        batched arguments: their fallback pads and moves them, which the plain function would not."""
        if self.options.batch:
            return
        key = self._call_key(jitted, args, kwargs)
        if key is not None:
            self.initialising_calls.add(key)

    def initialises(self, jitted, args: tuple, kwargs: dict) -> bool:
        """Whether a call is keyed as one noted by `note_initialising`."""
        key = self._call_key(jitted, args, kwargs)
        return key is not None and key in self.initialising_calls

    def _call_key(self, jitted, args: tuple, kwargs: dict):
        """A key of a call cheaper than its signature: the statics by type and value, each other argument's
        structure and leaves' abstract values, torch's settings and the lifted modules' training flags; not the
        lifted tensors themselves. Two calls of one key make donated state alike. None where a part is unhashable."""
        bound = self.fastpath.binder.arguments(args, kwargs)
        if bound is None:
            return None
        parts = []
        try:
            for k, v in sorted(bound.items()):  # (by name: however the call passed them)
                if k in self.options.static:
                    parts.append((k, static_key(v)))
                    continue
                if k in self.options.donate:  # (a plain object seen into, as binding sees it)
                    see_into(v)
                leaves, spec = pytree.tree_flatten(v)
                parts.append((k, layout_key(spec, leaves)))  # (the replay path's key of an argument's layout)
            key = (T.context(jitted.lifted), tuple(parts))
            hash(key)
        except TypeError:
            return None
        return key

    # -- the call policy -------------------------------------------------------------------------------------
    def call(self, view, args, kwargs):
        """A call the replay path did not serve, by `view` (the jit object called): bound, its signature found or
        made (traced and captured), or run eagerly where the policy says (a call that makes donated state, lazy
        parameters, no bucket, a sealed function's unseen signature, the signature cap, out of memory)."""
        # a call like one that made donated state: eagerly, without binding (a backward refusal needs the binding)
        if self.initialising_calls and not torch.is_grad_enabled() and self.initialises(view, args, kwargs):
            self.fallbacks["init"] += 1
            return view.fn(*args, **kwargs)
        try:
            call = self.cache.for_grad_mode(view.bind(args, kwargs))
        except T.LazyParameters as e:  # this call makes them: eagerly, as the module would
            if self.options.strict:
                raise SignatureError(f"fgraph.jit({self.name}, strict=True): {e.what}", e.fix) from None
            self.log_once(("lazy",), "%s (logged once). Fix: %s", e.what, e.fix)
            self.fallbacks["init"] += 1
            return view.fn(*args, **kwargs)
        if (why := self.ungraphed(call)) is not None:  # an empty batch: counted, not logged (nothing to fix)
            return self.fallback(view, why.kind, call, why.what, "raise buckets=[..., N] or split the batch")
        entry = self.cache.entries.get(call.sig)
        if entry is None and call.sig in self.initialising:
            self.note_initialising(view, args, kwargs)
            return self.fallback(view, "init", call, None, None)
        if entry is None:
            if self.sealed:
                return self.fallback(
                    view,
                    "unseen",
                    call,
                    f"signature {call.sig.describe()} was not captured" + self.cache.closest(call.sig),
                    f"add it to {self.name}.capture(...)"
                    + (  # torch's settings are the caller's: capture() takes no argument for them
                        f", called under the same torch settings ({settings})"
                        if (settings := dict(call.sig.statics).get("<torch>")) is not None
                        else ""
                    ),
                )
            new_family = not self.cache.traces.get(self.cache.family(call))
            if new_family and self.cache.made >= config.max_signatures:
                return self.fallback(
                    view,
                    "cap",
                    call,
                    f"{self.cache.made} signatures made by calls already (fgraph.config.max_signatures)"
                    + self.cache.closest(call.sig),
                    "pass values that change per call as tensors, or capture() the signatures you need up front",
                )
            donated = {k: call.bound[k] for k in self.options.donate if k in call.bound}
            if not self.options.strict and call.sig not in self.probed and (lazy := T.uninitialised(donated)):
                return self.first_makes(view, args, kwargs, call, donated, lazy)
            try:
                with self.padded_meets_unbatched(view, call):
                    entry = self.cache.make(
                        view, call, call.padding_only(call.sig.bucket) if call.n is not None else call
                    )
            except T.InitialisesState as e:  # a lazily made cache: this call makes its tensors, eagerly
                self.initialising.add(call.sig)
                self.note_initialising(view, args, kwargs)
                if e.rescan:  # it may make a module's tensors too (its trace's were put back): lifted next call
                    view.lifted.rescanned = False
                return self.fallback(view, "init", call, e.what, e.fix)
            except EscapeError as e:  # put back on its module: what a later call finds there is lifted then
                if not getattr(e, "left", True):
                    view.lifted.rescanned = False
                raise
            if entry is None:  # the capture ran out of device memory: freed, this call runs eagerly
                return self.fallback(view, "oom", call, "capturing ran out of device memory", "capture fewer buckets")
            if new_family:
                self.cache.made += 1
                self.cache.warn_retraces(call)
        elif entry.slots is not None and (moved := entry.slots.diverged(call.leaves)):
            self.cache.recapture(entry, call, moved)
        if (broken := entry.traced.breaks_at(call.n)) is not None:  # eager branches otherwise at this N: its answer
            return self.fallback(view, "branch", call, *branch_why(call, broken))
        check_lengths(self.name, entry.traced.tied, call.leaves)
        check_aliases(self.name, entry.traced, call.leaves, call.specs)
        first = contextlib.nullcontext() if entry.stats.calls else self.padded_meets_unbatched(view, call, False)
        with first:
            out = entry.run(call.leaves, call.n, call.bound, self.options.copy_outputs, check=True)
        view.learn(call, entry)
        entry.verified = None
        return T.refuse_backward(self.name, view.lifted, out, view.donated(call))

    def first_makes(self, view, args, kwargs, call, donated: dict, lazy: list[str]):
        """A new signature's call whose donated objects say they hold no tensors yet (`lazy`, key paths: a cache
        generate made, before its prefill): run eagerly, untraced, since a trace of a call that makes donated state is
        thrown away (`InitialisesState`: seconds of a first generate). Where it made their tensors, later calls like it
        run eagerly too, as a trace would have found; where it did not, the next call of its signature is traced.
        Under strict=True the trace finds it and raises."""
        self.probed.add(call.sig)
        key = None if self.options.batch else self._call_key(view, args, kwargs)  # (before the call makes them)
        out = self.fallback(view, "init", call, None, None)
        view.lifted.rescanned = False  # (the call may make a module's tensors too, which the next call lifts)
        if len(T.uninitialised(donated)) < len(lazy):
            self.initialising.add(call.sig)
            if key is not None:
                self.initialising_calls.add(key)
            e = T.initialises(f"the call makes the tensors of donated `{lazy[0]}`", lazy)
            self.log_once(("init", call.sig.statics), "%s; running eagerly (logged once). Fix: %s", e.what, e.fix)
        return out

    @contextlib.contextmanager
    def padded_meets_unbatched(self, view, call: Call, tracing: bool = True):
        """A padded call whose trace, capture or first run fails, while an input not declared Batched has the call's
        N rows along a dim: that input is named, with the fix (the padded batched rows have no row of it).

        tracing: the function's own exceptions come through as themselves (callers may catch them), with a note."""
        try:
            yield
        except Exception as e:
            if isinstance(e, (SignatureError, EscapeError)) or call.n is None or call.sig.bucket in (None, call.n):
                raise
            found = undeclared_batched(call, set(view.lifted.names) if view.lifted else set())
            if not found:
                raise
            (path, shape, axis), *more = found
            what = (
                f"fgraph.jit({self.name}): {path} {shape} is not declared Batched, but its dim {axis} has this call's "
                f"N={call.n} rows while the batched inputs are padded to the bucket {call.sig.bucket}: where they "
                "meet, the padded rows have no row of it"
                + (f" (so do {', '.join(f'{p} {s} dim {a}' for p, s, a in more)})" if more else "")
            )
            fix = declare_fix(path, axis)
            if tracing and not isinstance(e, FgraphError):
                e.add_note(f"{what}\nFix: {fix}")
                raise
            raise SignatureError(f"{what} ({type(e).__name__}: {getattr(e, 'what', e)})", fix) from e

    def ungraphed(self, call) -> Ungraphed | None:
        """Why no graph serves a call, if none does: none traces 0 rows, and none is past the largest bucket."""
        if call.n == 0:
            return Ungraphed("empty", None)
        if call.n is not None and call.sig.bucket is None:
            return Ungraphed("oversize", f"{call.n} tokens exceed the largest bucket {self.options.buckets[-1]}")
        return None

    def fallback(self, view, kind, call, what, fix):
        if self.options.strict and what is not None:
            raise SignatureError(f"fgraph.jit({self.name}, strict=True): {what}", fix)
        if what is not None:
            self.log_once((kind, call.sig.statics), "%s; running eagerly (logged once). Fix: %s", what, fix)
        self.fallbacks[kind] += 1
        device = device_of(self.name, call, strict=False)
        leaves = [x.to(device) if s is not None else x for x, s in zip(call.leaves, call.specs)]
        tree = pytree.tree_unflatten(leaves, call.sig.treespec)
        for k in self.options.donate:  # the caller's own donated objects, which the call may initialise
            if k in tree and is_seen_into(call.bound.get(k)):
                tree[k] = call.bound[k]
        # the plain function, as eager runs it; under grad mode with tensors that require grad, on their detached
        # values (a jitted call is inference: no autograd history, in its outputs or in state it makes)
        out = T.invoke(view, tree, call.statics, install=torch.is_grad_enabled() and view.lifted.grads)
        return T.refuse_backward(self.name, view.lifted, out, view.donated(call))


def branch_why(call, broken: str) -> tuple[str, str]:
    """What and fix of a call run eagerly because its N breaks what its bucket's trace assumed of the batch size."""
    return (
        f"a call of N={call.n} rows breaks what its bucket {call.sig.bucket}'s trace assumed of the batch size "
        f"({broken}): Python code (the function's or an op's) takes another branch there",
        f"add {call.n} to buckets=[...] (a trace of its own), or compute with tensors instead of Python on the size",
    )
