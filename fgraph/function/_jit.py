"""jit: trace once per signature, split at breaks, capture each signature's graphs, dispatch calls to them."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
import time
import types
from collections.abc import Callable, Mapping
from typing import overload

import torch
from torch._subclasses.fake_tensor import FakeTensor
from tqdm.auto import tqdm

from .. import trace as T
from .._errors import CaptureError, SignatureError
from .._pytree import flatten_with_paths, see_into, structure_key
from .._signature import (
    Call,
    Signature,
    Static,
    batch_specs,
    bucket_for,
    check_leaves,
    device_of,
    leaf_of,
    pad_count,
)
from .._traceback import boundary, user_frames
from ..capture import Entry, Stats, capture_session
from ..compile import compiler
from . import _options
from ._function_state import FunctionState
from ._lower import lower
from ._shared import shared_for

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


class Jitted(T.Inlined):
    """A function traced and captured per signature. Call it like the original; see `jit`.

    Inspection: `options` (the checked jit options), `entries` (Signature -> Entry, read-only), `stats()`,
    `cache` (entries, traces, the graph pool), `fastpath` (the replay path's keys); see docs/contract.md.

    Jit objects of one function object and equal options are views of one `state` (FunctionState): they trace and
    capture once, and show the same entries, cache and stats; reset() on one resets it for all. A view replays what
    the fast path finds and hands every other call to its state (FunctionState.call)."""

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
        compile=None,
        static_argnames=(),
        donate_argnames=(),
    ):
        given = {k: v for k, v in locals().items() if k not in ("self", "fn")}
        name, signature = T.describe(fn)
        if not isinstance(fn, torch.nn.Module):  # (a module's __dict__ is its state, not function metadata)
            # name, docstring and __wrapped__, not the __dict__: a jitted function wrapped again must not take
            # the inner one's fields (its fn, options and cache) for its own
            functools.update_wrapper(self, fn, updated=())
        self.fn, self.name, self.signature = fn, name, signature
        self.lifted = T.Lifted(fn, set(signature.parameters))
        self.options = opts = _options.make(name, signature, self.lifted.roots(), given)
        # the replay path binds calls itself: every parameter by name (and **kwargs)
        self._plain = T.plain_signature(signature)
        self._view = None  # the replay path's proof of the lifted tensors (FastPath.remember)
        # cache, fastpath, sealed, fallbacks, the warnings logged and the lock: per function object and options
        self.state = shared_for(fn, given, lambda: FunctionState(name, signature, opts))
        self.cache, self.fastpath, self._lock = self.state.cache, self.state.fastpath, self.state.lock

    def __get__(self, obj, objtype=None):
        """The function itself from the class; from an instance, a Jitted of the bound method, one per instance.

        Two instances hold different tensors: each has its own signatures and graphs."""
        return self if obj is None else _method(self, obj)

    @property
    def sealed(self) -> bool:
        """capture() ran (on this jit object or another view of its shared state): unseen signatures run eagerly."""
        return self.state.sealed

    @property
    def entries(self) -> Mapping[Signature, Entry]:
        """The signatures made so far, read-only.

        Signature -> Entry (its sig, mode, reason, graphs, paths, stats, program, pool_bytes, capture_seconds)."""
        return types.MappingProxyType(self.cache.entries)

    def log_once(self, key, fmt: str, *args) -> None:
        """Log a warning about this function once per key."""
        self.state.log_once(key, fmt, *args)

    # -- the call path ---------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if torch.compiler.is_dynamo_compiling():  # torch.compile tracing a caller: this call stays opaque to it
            return _opaque(self, args, kwargs)
        if _disabled or T.tracing.depth:  # called while this thread traces a function: inlined
            return self.fn(*args, **kwargs)
        T.check_transforms(self.name)  # vmap / grad over a jitted call: an fgraph error
        if type(self.fn) is functools.partial and self.fn.keywords:  # its keywords as they are now, as partial does
            kwargs = {**self.fn.keywords, **kwargs}  # (the signature's defaults are the ones at jit time)
        with self._lock:
            # (a jit object serves the replay path once a slow call of its own found what its function reads)
            taught = self._view is not None or (self.lifted.rescanned and not self.lifted)
            hit = self.fastpath.find(args, kwargs, self._view) if self._plain and taught else None
            if hit is None:
                with user_frames:  # where tracing fails: fgraph's errors show the user's frames only
                    return self.state.call(self, args, kwargs)
            try:
                out = hit.entry.run(hit.leaves, hit.n, hit.bound, self.options.copy_outputs)
            except Exception:
                if any(isinstance(x, FakeTensor) for x in hit.leaves):  # a value that escaped a trace: the slow
                    self.bind(args, kwargs)  # path's EscapeError names it (the replay path does not look per call)
                raise
            hit.entry.verified = hit.held
            if torch.is_grad_enabled() and self.lifted.reads_tensors():  # outputs over parameters that require grad
                self.lifted.grads = self._view.requires_grad()
                return T.refuse_backward(self.name, self.lifted, out, self._donated_of(hit.bound))
            return out

    def bind(self, args: tuple, kwargs: dict) -> Call:
        """The slow, thorough path: bind, check statics, flatten with key paths, find N and the bucket."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise SignatureError(f"fgraph.jit({self.name}): {e}", f"call it as {self.name}{self.signature}") from None
        bound.apply_defaults()
        statics, dynamic = {}, {}
        for k, v in bound.arguments.items():
            (statics if k in self.options.static else dynamic)[k] = v
        for k, v in statics.items():
            try:
                hash(v)
            except TypeError:
                raise SignatureError(
                    f"fgraph.jit({self.name}): static argument {k}={v!r} is unhashable ({type(v).__name__})",
                    "pass a hashable value (a tuple instead of a list, a frozen attrs class instead of a dict)",
                ) from None
        for k in self.options.donate:  # donated objects of plain classes (an HF StaticCache): seen into
            if k in dynamic:
                see_into(dynamic[k])
        dynamic = T.check_call(self.name, self.lifted, statics, dynamic)  # + the lifted tensors' current values
        flat, treespec = flatten_with_paths(dynamic)
        paths, leaves = [p for p, _ in flat], [x for _, x in flat]
        check_leaves(self.name, flat)
        specs = batch_specs(self.name, self.options.batch, dynamic, treespec, leaves)
        n = pad_count(self.name, paths, leaves, specs)
        bucket = bucket_for(self.options.buckets, max(n, 1)) if n is not None else None
        sig = Signature(
            tuple(Static(k, statics[k]) for k in sorted(statics))  # by type and value: 1, True, 1.0 apart
            + T.context(self.lifted)  # + autocast, model.eval(), ...
            + ((Static("<structure>", st),) if (st := structure_key(treespec)) is not None else ()),  # 1 / 1.0 keys
            bucket,
            treespec,
            tuple(leaf_of(x, s, bucket) for x, s in zip(leaves, specs)),
        )
        return Call(sig, statics, paths, leaves, specs, n, dict(bound.arguments))

    def donated(self, call) -> tuple:
        """The donated arguments of a call, as passed (handed back as the caller's own when returned)."""
        return self._donated_of(call.bound)

    def learn(self, call, entry) -> None:
        """After a call the slow path served: the replay path's keys for its signature, and this view's proof of
        the lifted tensors it read (FastPath.remember)."""
        if self._plain:
            self._view = self.fastpath.remember(call, entry, self.lifted, self._view)

    def _donated_of(self, bound: dict) -> tuple:
        return tuple(bound[k] for k in self.options.donate if k in bound)

    def __getattr__(self, name: str):
        """A jitted module is a drop-in for it: attributes Jitted lacks are the module's (`.config`, `.device`).

        Its methods (`.generate`) run with the module's forward jitted (these options), so the `self(...)` calls
        inside them go through fgraph as well. A jitted function has the function's own attributes
        (`f.some_value = 1`), as functools.wraps would copy them: read through, not copied, so a jitted function
        jitted again never takes the inner one's fields (its fn, options and cache) for its own."""
        fn = self.__dict__.get("fn")
        if not name.startswith("_") and fn is not None and not isinstance(fn, torch.nn.Module):
            if isinstance(fn, Jitted):
                return getattr(fn, name)
            own = getattr(fn, "__dict__", {})
            if name in own:
                return own[name]
        if name.startswith("_") or not isinstance(fn, torch.nn.Module):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        attr = getattr(fn, name)
        if not (isinstance(attr, types.MethodType) and attr.__self__ is fn) or name == "forward":
            return attr
        return functools.partial(_with_jitted_forward, self, attr)

    # -- capture ---------------------------------------------------------------------------------------------
    @boundary
    def capture(self, *args, buckets=None, progress=True, **kwargs):
        """Trace and capture every signature up front, then seal: later unseen signatures never capture.

        Static keyword arguments may be lists (`routine=["decode", "mixed"]`): every combination is captured, for
        every bucket (largest first, so smaller graphs reuse the pool memory of larger ones). Batched inputs are
        replaced by all-padding dummies, so the padding values must be valid inputs for every kernel.
        """
        choices, rest, todo = _options.capture_plan(self, args, kwargs, buckets)
        t0, n0, graphs, device = time.perf_counter(), len(self.cache.entries), 0, None
        compiled0 = dict(compiler.counts)
        with contextlib.ExitStack() as stack:
            for combo in itertools.product(*choices.values()) if choices else [()]:
                statics = dict(zip(choices, combo))
                desc = f"fgraph capture {self.name} {statics or ''}".rstrip()
                bar = tqdm(todo, desc=desc, disable=None if progress else True, leave=False)
                for b in bar:
                    call = self.cache.for_grad_mode(self.bind(args, {**rest, **statics}).padding_only(b))
                    if call.sig in self.cache.entries:
                        continue
                    if device is None:
                        device = device_of(self.name, call)
                        stack.enter_context(capture_session(device))
                    entry = self.cache.make(self, call, call)
                    if entry is None:
                        raise CaptureError(
                            f"fgraph.jit({self.name}).capture: {call.sig.describe()} ran out of device memory",
                            "capture fewer buckets (buckets=[...]) or free memory first",
                        )
                    graphs += len(entry.graphs)
                bar.close()
        self.state.sealed = True
        secs = time.perf_counter() - t0
        gib = sum(e.pool_bytes for e in self.cache.entries.values()) / 2**30
        if progress:
            print(
                f"fgraph: captured {graphs} graphs for {len(self.cache.entries) - n0} signatures of {self.name} in "
                f"{secs:.1f} s, {gib:.2f} GiB" + self._compile_summary(compiled0, device),
                file=sys.stderr,
                flush=True,
            )
        return self

    def _compile_summary(self, before: dict, device) -> str:
        """The compile choice in effect, and what Inductor did in a capture (compiled, loaded, shared, failed)."""
        text = "; " + self.options.compile_text(device or "cpu")
        if device is None or self.options.compile_for(device) is None:
            return text
        d = {k: compiler.counts[k] - before[k] for k in before}
        failed = f", failed on {d['failed']} signatures (uncompiled)" if d["failed"] else ""
        return (
            f"{text}: {d['compiled']} pieces compiled, {d['loaded']} loaded from its cache ({d['static']} of them "
            f"for one bucket's own shapes), {d['shared']} shared, {d['linear']} matmuls as fgraph::linear, in "
            f"{d['seconds']:.1f} s{failed}"
        )

    # -- introspection ---------------------------------------------------------------------------------------
    lower = lower  # jax.jit(f).lower(*args): this call's signature traced, .as_text() its program

    def stats(self) -> dict:
        """Counters per signature.

        Counters (Stats: traces, captures, warm-ups, replays, eager, calls, padded, copies, copied bytes) per
        signature (keyed by its description, plus the leaves that tell apart signatures described alike). Jit
        objects of one function and equal options share them: each shows the calls of all. A jitted module's also
        count the calls its methods made through its jitted forward (`jit(model).generate(...)`)."""
        per, fallbacks = dict(self.cache.stats()), dict(self.state.fallbacks)
        forward = self.__dict__.get("_forward")
        if forward is not None:
            inner = forward.stats()
            per.update({f"forward {k}": v for k, v in inner["signatures"].items()})
            fallbacks = {k: n + inner["fallbacks"][k] for k, n in fallbacks.items()}  # (the same kinds, in order)
        total = {k: sum(d[k] for d in per.values()) for k in Stats.__slots__}
        return {"signatures": per, "total": total, "fallbacks": fallbacks}

    def reset(self):
        """Drop every trace and graph (after replacing params or state with new tensors).

        Graphs whose outputs the caller still holds keep their memory (retired, not freed) until a later reset
        finds them unused. Every jit object of this function and options is reset (they share one cache)."""
        self.state.reset()


def _opaque(jitted: Jitted, args: tuple, kwargs: dict):
    """A jitted call inside a function torch.compile traces (HF generate's own compile of a jitted forward): a graph
    break, so Dynamo neither traces fgraph's call path nor its graphs; at run time fgraph runs the call as any other
    (its signatures and graphs, the plain function's answer). fullgraph=True cannot break there: torch says so, with
    the reason below."""
    return jitted(*args, **kwargs)


_opaque = torch.compiler.disable(
    _opaque,
    reason="a call of an fgraph.jit function runs fgraph's own CUDA graphs, opaque to torch.compile: compile without "
    "fullgraph=True, or torch.compile the plain function instead of calling the jitted one",
)


def _with_jitted_forward(jitted: Jitted, method, *args, **kwargs):
    """`jit(model).generate(...)`: the module's method, with `model.forward` jitted by these options meanwhile."""
    module = jitted.fn
    forward = jitted.__dict__.get("_forward")
    if forward is None:
        forward = jitted.__dict__["_forward"] = Jitted(module.forward, **jitted.options.given)
    had, prev = "forward" in vars(module), vars(module).get("forward")
    module.forward = forward
    try:
        return method(*args, **kwargs)
    finally:
        if had:
            module.forward = prev
        else:
            del module.forward


def _method(jitted: Jitted, obj) -> Jitted:
    """`obj.f` for a jitted function defined in a class body, kept in the instance's __dict__.

    It lives and dies with the instance; a copy of the instance binds its own."""
    d = getattr(obj, "__dict__", None)
    if d is None:  # __slots__: kept by id for the process's life
        d = jitted.__dict__.setdefault("_per_id", {}).setdefault(id(obj), {})
    methods = d.get("_fgraph_methods")
    bound = methods.get(jitted) if methods is not None else None
    if bound is None or bound.fn.__self__ is not obj:  # (copy.copy shares the __dict__'s values: not its graphs)
        if methods is None or bound is not None:
            methods = d["_fgraph_methods"] = _Methods()
        bound = methods[jitted] = type(jitted)(types.MethodType(jitted.fn, obj), **jitted.options.given)
    return bound


class _Methods(dict):
    """An instance's jitted methods: never copied or pickled with the instance (a copy binds its own)."""

    def __copy__(self):
        return _Methods()

    def __deepcopy__(self, memo):
        return _Methods()

    def __reduce__(self):
        return _Methods, ()


OPTIONS = tuple(inspect.signature(Jitted.__init__).parameters)[2:]  # what jit(fn, **options) takes


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
    compile: Inductor compiles the graph pieces before capture (fusions; few-row matmuls as fgraph::linear). Default:
      on CUDA (fgraph.config.compile_cuda), uncompiled graphs elsewhere; a piece Inductor fails on runs uncompiled,
      logged. False: uncompiled graphs, eager's own kernels (bit for bit). True, or a dict of Inductor options.
    """
    _options.check_names(options, OPTIONS)
    if fn is None:
        return lambda f: Jitted(f, **options)
    return Jitted(fn, **options)
