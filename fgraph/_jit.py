"""jit: trace once per signature, split at breaks, capture each signature's graphs, dispatch calls to them."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import operator
import sys
import threading
import time
from collections.abc import Callable
from typing import overload

import torch
import torch.utils._pytree as pytree

from . import _bind as B
from . import _dispatch as D
from . import _graphs as G
from . import _options as O
from . import _trace
from ._config import config
from ._entry import Call, Entry, Stats, Traced
from ._errors import CaptureError, SignatureError
from ._lower import lower
from ._modes import Mode
from ._padding import check_aliases, check_lengths
from ._pytree import check_static_fields, flatten_with_paths, flattener
from ._signature import Signature, batch_specs, bucket_for, check_leaves, device_of, leaf_of, pad_count

log = logging.getLogger("fgraph")


_disabled = False


@contextlib.contextmanager
def disable_jit():
    """Run jitted functions as plain Python (the oracle every captured signature is tested against)."""
    global _disabled
    prev, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = prev


class Jitted:
    """A function traced and captured per signature. Call it like the original; see `jit`."""

    def __init__(
        self,
        fn,
        *,
        static=(),
        donate=(),
        scratch=(),
        batch=None,
        buckets=None,
        mode="FULL_AND_PIECEWISE",
        breaks=None,
        strict=False,
        copy_outputs=True,
        routine="routine",
        warmups=1,
        compile=False,
        static_argnames=(),
        donate_argnames=(),
    ):
        opts = {k: v for k, v in locals().items() if k not in ("self", "fn")}
        static, donate = B.setup(self, fn, dict(opts))
        O.declare(self, static, donate, opts)
        params = self.signature.parameters
        self.entries: dict[Signature, Entry] = {}
        self._names = list(params)
        self._defaults = {k: p.default for k, p in params.items()}
        self._static_sorted = tuple(sorted(self.static))
        # bound -> the statics tuple, in one C call (itemgetter returns a bare value for a single name)
        get = operator.itemgetter(*self._static_sorted) if self._static_sorted else (lambda b: ())
        self._statics_of = get if len(self._static_sorted) != 1 else (lambda b, g=get: (g(b),))
        self._dynamic = [k for k in params if k not in self.static]
        # the fast path's caches (_fast_call): per argument, its flat layout by container identity; per batched
        # argument and structure, its reader; per (statics, bucket, layouts), the entry
        self._flat: dict[str, tuple] = {}
        self._readers: dict[str, list[Callable]] = {}
        self._fast: dict[tuple, Entry] = {}
        self._traces: dict[tuple, list] = {}  # (statics, structure, non-batch shapes) -> traces
        self.sealed = False  # capture() ran: unseen signatures run eagerly (or raise with strict) from now on
        self.pool = None
        self.fallbacks = {"unseen": 0, "oversize": 0, "cap": 0, "oom": 0, "empty": 0}
        self._logged: set = set()  # warnings already logged once
        self._retired: list[Entry] = []
        self._lock = threading.RLock()  # one call at a time: buffers, graphs and outputs are shared per function
        self._owned: dict = {}  # fgraph's buffers for inputs copied per call (Slots.move), shared by signatures
        self._made = 0  # signatures made by calls (not capture()): bounded by config.max_signatures

    __get__ = B.get  # a method: a Jitted of the bound method per instance

    # -- the call path ---------------------------------------------------------------------------------------
    def _bind(self, args, kwargs) -> Call:
        """The slow, thorough path: bind, check statics, flatten with key paths, find N and the bucket."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise SignatureError(f"fgraph.jit({self.name}): {e}", f"call it as {self.name}{self.signature}") from None
        bound.apply_defaults()
        statics, dynamic = {}, {}
        for k, v in bound.arguments.items():
            (statics if k in self.static else dynamic)[k] = v
        for k, v in statics.items():
            try:
                hash(v)
            except TypeError:
                raise SignatureError(
                    f"fgraph.jit({self.name}): static argument {k}={v!r} is unhashable ({type(v).__name__})",
                    "pass a hashable value (a tuple instead of a list, a frozen attrs class instead of a dict)",
                ) from None
        dynamic = B.check_call(self, statics, dynamic)  # + the lifted tensors' current values
        flat, treespec = flatten_with_paths(dynamic)
        paths, leaves = [p for p, _ in flat], [x for _, x in flat]
        check_leaves(self.name, flat)
        specs = batch_specs(self.name, self.batch, dynamic, treespec, leaves)
        n = pad_count(self.name, paths, leaves, specs)
        bucket = bucket_for(self.buckets, max(n, 1)) if n is not None else None
        sig = Signature(
            tuple(sorted(statics.items(), key=lambda kv: kv[0])) + B.context(self),  # + autocast, model.eval(), ...
            bucket,
            treespec,
            tuple(leaf_of(x, s, bucket) for x, s in zip(leaves, specs)),
        )
        return Call(sig, statics, paths, leaves, specs, n, dict(bound.arguments))

    def _fast_call(self, args, kwargs):
        """The replay path. Containers passed again (the same params / state objects) are not re-flattened: their
        flat layout is cached by identity; only batched arguments are flattened and padded. Returns _MISS to
        send the call down the slow path (first sight of anything, errors, fallbacks)."""
        names = self._names
        if len(args) > len(names):
            return _MISS
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in bound or k not in self._defaults:
                return _MISS
            bound[k] = v
        if len(bound) < len(names):
            for k in names:
                if k not in bound:
                    d = self._defaults[k]
                    if d is inspect.Parameter.empty:
                        return _MISS
                    bound[k] = d
        try:
            statics = self._statics_of(bound)
            hash(statics)
        except TypeError:
            return _MISS
        parts, leaves, held, n = [], [], [], None
        for name in self._dynamic:
            v = bound[name]
            if name in self.batch:
                for read in self._readers.get(name, ()):  # known structures of this argument
                    got = read(v)
                    if got is not None:
                        break
                else:
                    return _MISS
                lv, key, m = got
                if m is not None and (n is None or m > n):
                    n = m
                parts.append(key)
                leaves.extend(lv)
            else:
                c = self._flat.get(name)
                if c is None or c[0] is not v or (c[3] is not None and not c[3]()):
                    return _MISS
                parts.append(c[2])
                held.append(c[2])  # the identity-cached containers (not the batched args)
                leaves.extend(c[1])
        bucket = bucket_for(self.buckets, n) if n else None
        if n is not None and bucket is None:  # past the largest bucket, or an empty batch
            return _MISS
        entry = self._fast.get(D.fast_key(statics, bucket, parts))
        if entry is None:
            return _MISS
        # a new tensor where the graphs read another: the slow path copies it. Containers passed again vouch for
        # theirs by identity; tensors inside batched arguments (slots.loose) are flattened afresh and checked
        slots, seen = entry.slots, entry.verified
        if slots is not None:
            same = seen is not None and len(held) == len(seen) and all(map(operator.is_, held, seen))
            if (slots.loose or not same) and slots.diverged(leaves, slots.loose if same else None):
                return _MISS
        out = entry.run(leaves, n, bound, self.copy_outputs)
        entry.verified = held
        return out

    def _remember(self, call: Call, entry: Entry):
        """Teach the fast path this call's layout: per argument, its flat leaves (by container identity) or,
        for batched arguments, the Batched spec of each leaf."""
        parts = []
        for name in self._dynamic:
            v = call.bound[name]
            lv, spec = pytree.tree_flatten(v)
            if name in self.batch:
                readers = self._readers.setdefault(name, [])
                got = next((g for r in readers if (g := r(v)) is not None), None)  # the reader _fast_call picks
                if got is None:
                    specs = batch_specs(
                        self.name, {name: self.batch[name]}, {name: v}, pytree.tree_flatten({name: v})[1], lv
                    )
                    nones = tuple(x is None for x in lv)  # None is a leaf: the same structure with a tensor there
                    spec_id = sum(map(len, self._readers.values()))  # unique among this function's readers
                    readers.append(D.reader(flattener(spec), specs, spec_id, nones))
                    got = readers[-1](v)
                parts.append(got[1])
            else:
                key = D.layout_key(spec, lv)
                c = self._flat.get(name)
                if c is None or c[0] is not v or c[2] != key or (c[3] is not None and not c[3]()):
                    self._flat[name] = c = (v, lv, key, D.guard_for(v, spec))
                parts.append(c[2])
        statics = tuple(call.bound[k] for k in self._static_sorted)
        self._fast[D.fast_key(statics, call.sig.bucket, parts)] = entry

    def __call__(self, *args, **kwargs):
        if _disabled or _trace.tracing.depth:  # called while this thread traces a function: inlined
            return self.fn(*args, **kwargs)
        B.check_transforms(self)  # vmap / grad over a jitted call: an fgraph error
        with self._lock:
            out = self._fast_call(args, kwargs) if self._plain else _MISS
            if out is not _MISS:
                return out
            return self._slow_call(args, kwargs)

    def _slow_call(self, args, kwargs):
        call = D.for_grad_mode(self, self._bind(args, kwargs))
        if (why := self._ungraphed(call)) is not None:  # an empty batch: counted, not logged (nothing to fix)
            return self._fallback(why[0], call, why[1], "raise buckets=[..., N] or split the batch")
        entry = self.entries.get(call.sig)
        if entry is None:
            if self.sealed:
                return self._fallback(
                    "unseen",
                    call,
                    f"signature {call.sig.describe()} was not captured" + self._closest(call.sig),
                    f"add it to {self.name}.capture(...)",
                )
            if self._made >= config.max_signatures:
                return self._fallback(
                    "cap",
                    call,
                    f"{self._made} signatures made by calls already (fgraph.config.max_signatures)"
                    + self._closest(call.sig),
                    "pass values that change per call as tensors, or capture() the signatures you need up front",
                )
            entry = D.make(self, call, self._dummy(call, call.sig.bucket) if call.n is not None else call)
            if entry is None:  # the capture ran out of device memory: freed, this call runs eagerly
                return self._fallback("oom", call, "capturing ran out of device memory", "capture fewer buckets")
            self._made += 1
            D.warn_retraces(self, call)
        elif entry.slots is not None and (moved := entry.slots.diverged(call.leaves)):
            D.recapture(self, entry, call, moved)
        check_lengths(self.name, entry.traced.tied, call.leaves)
        check_aliases(self.name, entry.traced, call.leaves, call.specs)
        out = entry.run(call.leaves, call.n, call.bound, self.copy_outputs, check=True)
        self._remember(call, entry)
        entry.verified = None
        return out

    def _ungraphed(self, call) -> tuple[str, str | None] | None:
        """(kind, what) when no graph serves a call: none traces 0 rows, and none is past the largest bucket."""
        if call.n == 0:
            return "empty", None
        big = call.n is not None and call.sig.bucket is None
        return ("oversize", f"{call.n} tokens exceed the largest bucket {self.buckets[-1]}") if big else None

    def _fallback(self, kind, call, what, fix):
        if self.strict and what is not None:
            raise SignatureError(f"fgraph.jit({self.name}, strict=True): {what}", fix)
        if what is not None and (kind, call.sig.statics) not in self._logged:
            self._logged.add((kind, call.sig.statics))
            log.warning("fgraph.jit(%s): %s; running eagerly (logged once). Fix: %s", self.name, what, fix)
        self.fallbacks[kind] += 1
        device = device_of(self.name, call)
        leaves = [x.to(device) if s is not None else x for x, s in zip(call.leaves, call.specs)]
        return B.invoke(self, pytree.tree_unflatten(leaves, call.sig.treespec), call.statics)

    def _capture(self, entry: Entry, call: Call):
        graphed = entry.mode is not Mode.NONE
        entry.capture(
            call,
            self._pool(entry.device) if graphed else None,
            self.warmups if graphed else 0,
            self.compile if graphed else None,
            config.inputs_in_graph,
        )
        if entry.slots is None and (entry.graphs or entry.full is not None):
            entry.slots = D.Slots(entry, call.leaves, self.donate, tuple(self.batch))
        if config.log_captures and graphed:
            log.warning(
                "fgraph.jit(%s): captured %d %s graph(s) for %s in %.3f s, pool +%.3f GiB",
                self.name,
                len(entry.graphs),
                entry.mode.name,
                entry.sig.describe(),
                entry.capture_seconds,
                entry.pool_bytes / 2**30,
            )

    def _pool(self, device):
        if self.pool is None:
            self.pool = G.new_pool(device)
        return self.pool

    def _new_entry(self, call: Call) -> Entry:
        """An entry for a new signature, on an existing trace when one fits its bucket (one trace per routine
        and structure serves every bucket >= 2), else on a new trace."""
        for k, v in pytree.tree_unflatten(call.leaves, call.sig.treespec).items():
            check_static_fields(v, f"fgraph.jit({self.name}): {k}")
        if config.explain_cache_misses and self.entries:
            log.warning("fgraph.jit(%s): new signature %s%s", self.name, call.sig.describe(), self._closest(call.sig))
        device = device_of(self.name, call)
        family = (  # grad mode apart: a trace that branched on it serves its own mode (below), any other both
            tuple(kv for kv in call.sig.statics if kv[0] != D.GRAD_MODE),
            call.sig.treespec,
            tuple(
                leaf if s is None else leaf._replace(shape=s.family_shape(leaf.shape))
                for leaf, s in zip(call.sig.leaves, call.specs)
            ),
        )
        now = torch.is_grad_enabled()
        fits = (t for t in self._traces.get(family, ()) if t.fits(call.sig.bucket) and t.grad_mode in (None, now))
        traced = next(fits, None)
        new = traced is None
        if new:
            traced = Traced(self, call, device)
            self._traces.setdefault(family, []).append(traced)
            want = self.mode.for_routine(call.statics.get(self.routine) == "decode")
            if traced.mode is not want and ("downgrade", call.sig.statics) not in self._logged:
                self._logged.add(("downgrade", call.sig.statics))
                log.warning("fgraph.jit(%s): %s: %s", self.name, call.sig.describe(), traced.reason)
        entry = Entry(traced, call, device, new)
        self.entries[call.sig] = entry
        return entry

    def _closest(self, sig: Signature) -> str:
        """The nearest known signature and the first thing that differs (JAX's explain_cache_misses)."""
        return D.closest(self.entries, sig)

    # -- capture ---------------------------------------------------------------------------------------------
    def capture(self, *args, buckets=None, progress=True, **kwargs):
        """Trace and capture every signature up front, then seal: later unseen signatures never capture.

        Static keyword arguments may be lists (`routine=["decode", "mixed"]`): every combination is captured, for
        every bucket (largest first, so smaller graphs reuse the pool memory of larger ones). Batched inputs are
        replaced by all-padding dummies, so the padding values must be valid inputs for every kernel.
        """
        choices, rest, todo = O.capture_plan(self, args, kwargs, buckets)
        t0, n0, graphs, device = time.perf_counter(), len(self.entries), 0, None
        from tqdm.auto import tqdm

        with contextlib.ExitStack() as stack:
            for combo in itertools.product(*choices.values()) if choices else [()]:
                statics = dict(zip(choices, combo))
                desc = f"fgraph capture {self.name} {statics or ''}".rstrip()
                bar = tqdm(todo, desc=desc, disable=None if progress else True, leave=False)
                for b in bar:
                    call = D.for_grad_mode(self, self._dummy(self._bind(args, {**rest, **statics}), b))
                    if call.sig in self.entries:
                        continue
                    if device is None:
                        device = device_of(self.name, call)
                        stack.enter_context(G.capture_session(device))
                    entry = D.make(self, call, call)
                    if entry is None:
                        raise CaptureError(
                            f"fgraph.jit({self.name}).capture: {call.sig.describe()} ran out of device memory",
                            "capture fewer buckets (buckets=[...]) or free memory first",
                        )
                    graphs += len(entry.graphs)
                bar.close()
        self.sealed = True
        secs = time.perf_counter() - t0
        gib = sum(e.pool_bytes for e in self.entries.values()) / 2**30
        if progress:
            print(
                f"fgraph: captured {graphs} graphs for {len(self.entries) - n0} signatures of {self.name} in "
                f"{secs:.1f} s, {gib:.2f} GiB",
                file=sys.stderr,
                flush=True,
            )
        return self

    def _dummy(self, call: Call, bucket: int) -> Call:
        """An all-padding call for `bucket`: each batched leaf cut to its `extra` rows (the entry pads it)."""
        specs = call.specs
        leaves = [x if s is None else x.narrow(s.axis, 0, s.extra) for x, s in zip(call.leaves, specs)]
        sig = call.sig._replace(bucket=bucket, leaves=tuple(leaf_of(x, s, bucket) for x, s in zip(leaves, specs)))
        return call._replace(sig=sig, leaves=leaves, n=0)

    # -- introspection ---------------------------------------------------------------------------------------
    lower = lower  # jax.jit(f).lower(*args): this call's signature traced, .as_text() its program

    def stats(self) -> dict:
        """Counters (Stats: traces, captures, warm-ups, replays, eager, calls, padded, copies, copied bytes) per
        signature (keyed by its description, plus the leaves that tell apart signatures described alike)."""
        per = {k: e.stats.as_dict() for k, e in D.stats_keys(self.entries.values())}
        total = {k: sum(d[k] for d in per.values()) for k in Stats.__slots__}
        return {"signatures": per, "total": total, "fallbacks": dict(self.fallbacks)}

    def reset(self):
        """Drop every trace and graph (after replacing params or state with new tensors). Graphs whose outputs the
        caller still holds keep their memory (retired, not freed) until a later reset finds them unused."""
        self._retired = [e for e in [*self._retired, *self.entries.values()] if any(g.in_use() for g in e.graphs)]
        self.entries.clear()
        self._flat.clear(), self._readers.clear(), self._fast.clear(), self._traces.clear()
        self._owned.clear()
        self._made = 0
        self.sealed, self.pool = False, None


_OPTIONS = tuple(inspect.signature(Jitted.__init__).parameters)[2:]  # what jit(fn, **options) takes
_MISS = object()  # the fast path's "not here": a jitted function may itself return None


@overload
def jit(fn: Callable, **options) -> Jitted: ...
@overload
def jit(fn: None = None, **options) -> Callable[[Callable], Jitted]: ...
def jit(fn: Callable | None = None, **options) -> Jitted | Callable[[Callable], Jitted]:
    """Trace `fn` once per signature and capture CUDA graphs for it.

    static: argument names that are hashable Python values (a new value is a new signature).
    donate: argument names whose tensors the function may update in place (KV cache, state). What warm-up and
      capture write there is put back: after a call the state is what one eager call leaves.
    scratch: donated argument names whose padded rows, by the function's padding values, write only into a scratch
      area (the KV cache's page 0): not copied and put back around capture (which runs on all-padding inputs).
    batch: {argument name: Batched or a prefix tree of Batched/None}: leaves that carry the token axis.
    buckets: the padded token counts to capture (default vLLM's: 1, 2, 4, 8, ..., 256, 272, ..., 512).
    mode: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE (default); `routine` names the static
      argument whose value "decode" marks uniform decode signatures.
    breaks: primitive names that cut the graph (default: all registered primitives).
    strict: raise instead of running eagerly for unseen signatures or oversize batches, and instead of copying a
      non-batched input that is not the tensor the graphs were captured with (or capturing again for it).
    copy_outputs: return copies (the default: what a caller keeps is never overwritten by a later call). False:
      zero-copy, outputs live in graph memory until the next call of this function (every signature's graphs share
      one pool, so any later replay may write over them): for engines that read outputs before the next step.
    Inputs are values: any non-static tensor may be a new tensor on any call. Tensors the graphs were captured with
    are read in place; a new one is read in place after one recapture, one that moves again is copied into
    fgraph's buffers per call (stats() counts copies; donated ones are copied back). Calls are serialised by a
    lock per jitted function, so threads may share one.
    compile: compile the graph pieces with Inductor before capturing them (fuses elementwise work between
      matmuls; costs compile time per signature, so capture fewer buckets with it). True, or a dict of Inductor
      config options as torch.compile(options=...) takes them, e.g. {"coordinate_descent_tuning": True}: with it,
      Inductor turns one-row matmuls (decode at batch 1) into tuned Triton reductions with the norm fused in.
    """
    O.check_names(options, _OPTIONS)
    if fn is None:
        return lambda f: Jitted(f, **options)
    return Jitted(fn, **options)
