"""jit: trace once per signature, split at breaks, capture each signature's graphs, dispatch calls to them."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import operator
import sys
import time
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from . import _graphs as G
from . import _primitives as P
from ._entry import Call, Entry, Stats, Traced, _device_of
from ._errors import SignatureError
from ._inductor import inductor_options
from ._modes import Mode
from ._pytree import check_static_fields, flatten_with_paths, flattener
from ._signature import Signature, batch_specs, bucket_for, default_buckets, leaf_of, pad_count

log = logging.getLogger("fgraph")


class config:
    """Process-wide switches (JAX's jax_explain_cache_misses / jax_log_compiles are the models)."""

    explain_cache_misses = False  # log, for each new signature, the closest previous one and what differs
    log_captures = False  # log every graph captured
    # FULL graphs copy their batched inputs in themselves (InputBuffers.copy_in_graph): a call pads into pinned
    # memory and replays, with no copy or event of its own: two CUDA calls fewer per call, tens of us of host time
    # each on a busy GPU (docs/performance.md). False: each call copies its inputs and records an event.
    inputs_in_graph = True


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
        batch=None,
        buckets=None,
        mode="FULL_AND_PIECEWISE",
        breaks=None,
        strict=False,
        copy_outputs=False,
        routine="routine",
        warmups=1,
        compile=False,
    ):
        self.fn, self.name = fn, getattr(fn, "__name__", repr(fn))
        self.signature = inspect.signature(fn)
        params = self.signature.parameters
        for kind, names in (("static", static), ("donate", donate), ("batch", list(batch or {}))):
            for a in names:
                if a not in params:
                    raise SignatureError(
                        f"fgraph.jit({self.name}): {kind}= names {a!r}, which is not a parameter of "
                        f"{self.name}{self.signature}",
                        f"use one of {list(params)}",
                    )
        self.static = tuple(static)
        self.donate = tuple(donate)
        self.batch = dict(batch or {})
        self.buckets = tuple(sorted(buckets)) if buckets is not None else default_buckets()
        try:
            self.mode = Mode(mode.upper() if isinstance(mode, str) else mode)
        except ValueError:
            raise SignatureError(
                f"fgraph.jit({self.name}): unknown mode {mode!r}", f"use one of {[m.value for m in Mode]}"
            ) from None
        unknown = [b for b in breaks or () if b not in P.registry]
        if unknown:
            raise SignatureError(
                f"fgraph.jit({self.name}): breaks= names unknown primitives {unknown}",
                f"registered primitives are {sorted(P.registry)}",
            )
        self.breaks = breaks
        self.strict = strict
        self.copy_outputs = copy_outputs
        self.routine = routine
        self.warmups = warmups
        self.compile = inductor_options(self.name, compile)
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
        self._specs: dict[tuple, Callable] = {}
        self._readers: dict[str, list[Callable]] = {}
        self._fast: dict[tuple, Entry] = {}
        self._traces: dict[tuple, list] = {}  # (statics, structure, non-batch shapes) -> traces
        self.sealed = False  # capture() ran: unseen signatures run eagerly (or raise with strict) from now on
        self.pool = None
        self.fallbacks = {"unseen": 0, "oversize": 0}
        self._logged: set = set()  # warnings already logged once
        self._retired: list[Entry] = []
        functools.update_wrapper(self, fn)

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
        flat, treespec = flatten_with_paths(dynamic)
        paths, leaves = [p for p, _ in flat], [x for _, x in flat]
        specs = batch_specs(self.name, self.batch, dynamic, treespec, len(leaves))
        n = pad_count(self.name, paths, leaves, specs)
        bucket = bucket_for(self.buckets, max(n, 1)) if n is not None else None
        sig = Signature(
            tuple(sorted(statics.items(), key=lambda kv: kv[0])),
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
                if c is None or c[0] is not v:
                    return _MISS
                parts.append(c[2])
                held.append(c[2])  # the identity-cached containers (not the batched args)
                leaves.extend(c[1])
        bucket = bucket_for(self.buckets, n if n > 1 else 1) if n is not None else None
        if n is not None and bucket is None:
            return _MISS
        entry = self._fast.get((statics, bucket, tuple(parts)))
        if entry is None:
            return _MISS
        check = (
            entry.verified is None
            or len(held) != len(entry.verified)
            or not all(map(operator.is_, held, entry.verified))
        )
        out = entry.run(leaves, n, bound, self.copy_outputs, check)
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
                read = self._specs.get((name, spec))
                if read is None:
                    specs = batch_specs(
                        self.name, {name: self.batch[name]}, {name: v}, pytree.tree_flatten({name: v})[1], len(lv)
                    )
                    read = self._specs[name, spec] = _reader(flattener(spec), specs, len(self._specs))
                    self._readers.setdefault(name, []).append(read)
                parts.append(read(v)[1])
            else:
                key = _Key((spec, tuple(leaf_of(x) for x in lv)))
                c = self._flat.get(name)
                if c is None or c[0] is not v or c[2] != key:
                    self._flat[name] = c = (v, lv, key)
                parts.append(c[2])
        statics = tuple(call.bound[k] for k in self._static_sorted)
        self._fast[(statics, call.sig.bucket, tuple(parts))] = entry

    def __call__(self, *args, **kwargs):
        if _disabled:
            return self.fn(*args, **kwargs)
        out = self._fast_call(args, kwargs)
        if out is not _MISS:
            return out
        call = self._bind(args, kwargs)
        if call.n is not None and call.sig.bucket is None:
            return self._fallback(
                "oversize",
                call,
                f"{call.n} tokens exceed the largest bucket {self.buckets[-1]}",
                "raise buckets=[..., N] or split the batch",
            )
        entry = self.entries.get(call.sig)
        if entry is None:
            if self.sealed:
                return self._fallback(
                    "unseen",
                    call,
                    f"signature {call.sig.describe()} was not captured" + self._closest(call.sig),
                    f"add it to {self.name}.capture(...)",
                )
            entry = self._new_entry(call)
            self._capture(entry, self._dummy(call, call.sig.bucket) if call.n is not None else call)
        out = entry.run(call.leaves, call.n, call.bound, self.copy_outputs, check=True)
        self._remember(call, entry)
        entry.verified = None
        return out

    def _fallback(self, kind, call, what, fix):
        if self.strict:
            raise SignatureError(f"fgraph.jit({self.name}, strict=True): {what}", fix)
        if (kind, call.sig.statics) not in self._logged:
            self._logged.add((kind, call.sig.statics))
            log.warning("fgraph.jit(%s): %s; running eagerly (logged once). Fix: %s", self.name, what, fix)
        self.fallbacks[kind] += 1
        device = _device_of(self.name, call)
        leaves = [x.to(device) if s is not None else x for x, s in zip(call.leaves, call.specs)]
        return self.fn(**pytree.tree_unflatten(leaves, call.sig.treespec), **call.statics)

    def _capture(self, entry: Entry, call: Call):
        graphed = entry.mode is not Mode.NONE
        entry.capture(
            call,
            self._pool(entry.device) if graphed else None,
            self.warmups if graphed else 0,
            self.compile if graphed else None,
            config.inputs_in_graph,
        )
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
        device = _device_of(self.name, call)
        family = (
            call.sig.statics,
            call.sig.treespec,
            tuple(leaf._replace(shape=None) if s is not None else leaf for leaf, s in zip(call.sig.leaves, call.specs)),
        )
        traced = next((t for t in self._traces.get(family, ()) if t.fits(call.sig.bucket)), None)
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
        if not self.entries:
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

        entry = min(self.entries.values(), key=lambda e: diff(sig, e.sig)[0])
        what = diff(sig, entry.sig)[1]
        if what.startswith("leaf #"):
            i = int(what[6 : what.index(":")])
            what = f"{entry.paths[i]}: {sig.leaves[i]} (captured {entry.sig.leaves[i]})"
        return f"; closest captured signature {entry.sig.describe()} differs in {what}"

    # -- capture ---------------------------------------------------------------------------------------------
    def capture(self, *args, buckets=None, progress=True, **kwargs):
        """Trace and capture every signature up front, then seal: later unseen signatures never capture.

        Static keyword arguments may be lists (`routine=["decode", "mixed"]`): every combination is captured, for
        every bucket (largest first, so smaller graphs reuse the pool memory of larger ones). Batched inputs are
        replaced by all-padding dummies, so the padding values must be valid inputs for every kernel.
        """
        choices = {k: (v if isinstance(v, list) else [v]) for k, v in kwargs.items() if k in self.static}
        rest = {k: v for k, v in kwargs.items() if k not in self.static}
        todo = sorted(buckets or self.buckets, reverse=True)
        t0, n0, graphs, device = time.perf_counter(), len(self.entries), 0, None
        from tqdm.auto import tqdm

        with contextlib.ExitStack() as stack:
            for combo in itertools.product(*choices.values()) if choices else [()]:
                statics = dict(zip(choices, combo))
                bar = tqdm(
                    todo,
                    desc=f"fgraph capture {self.name} {statics or ''}".rstrip(),
                    disable=None if progress else True,
                    leave=False,
                )
                for b in bar:
                    call = self._dummy(self._bind(args, {**rest, **statics}), b)
                    if call.sig in self.entries:
                        continue
                    entry = self._new_entry(call)
                    if device is None:
                        device = entry.device
                        stack.enter_context(G.capture_session(device))
                    self._capture(entry, call)
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
    def stats(self) -> dict:
        """Counters (Stats: traces, captures, warm-ups, replays, eager, calls, padded) per signature and totals."""
        per = {e.sig.describe(): e.stats.as_dict() for e in self.entries.values()}
        total = {k: sum(d[k] for d in per.values()) for k in Stats.__slots__}
        return {"signatures": per, "total": total, "fallbacks": dict(self.fallbacks)}

    def reset(self):
        """Drop every trace and graph (after replacing params or state with new tensors). Graphs whose outputs the
        caller still holds keep their memory (retired, not freed) until a later reset finds them unused."""
        self._retired = [e for e in [*self._retired, *self.entries.values()] if any(g.in_use() for g in e.graphs)]
        self.entries.clear()
        self._flat.clear(), self._specs.clear(), self._readers.clear(), self._fast.clear(), self._traces.clear()
        self.sealed, self.pool = False, None


_MISS = object()  # the fast path's "not here": a jitted function may itself return None


def _reader(flatten, specs, spec_id: int):
    """A batched argument's reader for the fast path: `tree -> (leaves, key, n)`, or None for another structure.
    key: the structure's id and each leaf's (dtype, device, shape) as passed (unpadded: each token count met gets its
    own key, after one call down the slow path; Python leaves by value); n: the largest real token count among its
    Batched leaves (None if none). Generated per structure as one tuple display (a loop of small tuples cost ~2 us)."""
    env = {"flatten": flatten, "_T": torch.Tensor, "_leaf": leaf_of}
    names = [f"a{i}" for i in range(len(specs))]
    key = "".join(f"({a}.dtype, {a}.device, {a}.shape) if isinstance({a}, _T) else _leaf({a}), " for a in names)
    rows = [f"{a}.shape[{s.axis}] - {s.extra}" for a, s in zip(names, specs) if s is not None]
    n = "None" if not rows else rows[0] if len(rows) == 1 else f"max({', '.join(rows)})"
    unpack = f"  {''.join(a + ', ' for a in names)}= lv\n" if names else ""
    src = (
        f"def read(x):\n  lv = flatten(x)\n  if lv is None:\n    return None\n{unpack}"
        f"  return lv, ({spec_id}, {key}), {n}\n"
    )
    exec(compile(src, "<fgraph batched reader>", "exec"), env)
    return env["read"]


class _Key:
    """A hashable layout key that hashes once: a params tree of hundreds of leaves is looked up per call."""

    __slots__ = ("key", "hash")

    def __init__(self, key):
        self.key, self.hash = key, hash(key)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return self is other or (isinstance(other, _Key) and self.hash == other.hash and self.key == other.key)


def jit(fn: Callable | None = None, **options) -> Jitted | Callable[[Callable], Jitted]:
    """Trace `fn` once per signature and capture CUDA graphs for it.

    static: argument names that are hashable Python values (a new value is a new signature).
    donate: argument names whose tensors the function may update in place (KV cache, state).
    batch: {argument name: Batched or a prefix tree of Batched/None}: leaves that carry the token axis.
    buckets: the padded token counts to capture (default vLLM's: 1, 2, 4, 8, ..., 256, 272, ..., 512).
    mode: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE (default); `routine` names the static
      argument whose value "decode" marks uniform decode signatures.
    breaks: primitive names that cut the graph (default: all registered primitives).
    strict: raise instead of running eagerly for unseen signatures or oversize batches.
    copy_outputs: return copies; by default outputs live in graph memory until the next call of this function
      (every signature's graphs share one pool, so any later replay may write over them).
    compile: compile the graph pieces with Inductor before capturing them (fuses elementwise work between
      matmuls; costs compile time per signature, so capture fewer buckets with it). True, or a dict of Inductor
      config options as torch.compile(options=...) takes them, e.g. {"coordinate_descent_tuning": True}: with it,
      Inductor turns one-row matmuls (decode at batch 1) into tuned Triton reductions with the norm fused in.
    """
    if fn is None:
        return lambda f: Jitted(f, **options)
    return Jitted(fn, **options)
