"""Shared: what a jitted function keeps, one per function object and options, for every jit object of them.

jax.jit caches per function and options: `for _ in range(3): fgraph.jit(f)(x)` traces f once. Each jit object of
one function object and equal options is a view of one Shared (its Cache of signatures, traces and graphs, the
replay path's FastPath, whether capture() sealed it, the fallback counts, the warnings logged once, the lock that
serialises its calls), found in a process-wide map held weakly: it goes away with the function.

What is shared never gives another answer than a jit object of its own would: the key is the function object itself
(a closure made again is a new function: its own state) and options compared by value; the tensors a call reads
(arguments, lifted parameters, closed-over and global tensors) are read per call by the jit object called, as
without sharing. What a trace freezes (Python values the function reads) is frozen for every view, as under jax.jit:
`.reset()` on any view traces again for all.

A Shared holds no reference to the function (the map's weak key would never die): its cache gets the jit object
that calls it where it traces (Cache.make, Cache.probe).
"""

from __future__ import annotations

import logging
import threading
import types
import weakref

import attrs
import torch.utils._pytree as pytree

from .. import trace as T
from .._pytree import see_into
from .._signature import static_key
from ._cache import Cache
from ._fastpath import FastPath, layout_key

log = logging.getLogger("fgraph")


class Shared:
    """One function's jit state, for given options: what every jit object of them is a view of."""

    def __init__(self, name: str, signature, options):
        self.name, self.options = name, options
        self.fastpath = FastPath(name, signature, options.static, options.batch, options.buckets)
        self.cache = Cache(self, self.fastpath)
        self.sealed = False  # capture() ran: unseen signatures run eagerly (or raise with strict) from now on
        self.fallbacks = {"unseen": 0, "oversize": 0, "cap": 0, "oom": 0, "empty": 0, "init": 0}
        self.logged: set = set()  # warnings already logged once
        self.initialising: set = set()  # signatures whose calls make donated state's tensors: run eagerly
        # the same calls by `_call_key`: found again without binding (which reads every lifted tensor: ~5 ms for an
        # HF model's prefill, where generate makes a new cache each call)
        self.initialising_calls: set = set()
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
        try:
            bound = jitted.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        parts = []
        try:
            for k, v in bound.arguments.items():
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


# ------------------------------------------------------------------------------------------------ the map
class _Slot:
    """One function's entry in the map: weak references to what identifies it, and its Shared per options key."""

    def __init__(self, refs: tuple):
        self.refs, self.by_options = refs, {}


_slots: dict[tuple[int, ...], _Slot] = {}  # ids of what identifies a function (identity_of) -> its slot
_slots_lock = threading.Lock()


def shared_for(fn, given: dict, make) -> Shared:
    """The Shared of `fn` and these options (`given`, as passed to jit), made by `make()` the first time.

    A function that cannot be held weakly, or options with an unhashable value, get a Shared of their own."""
    objs, key = identity_of(fn), options_key(given)
    if objs is None or key is None:
        return make()
    ids = tuple(map(id, objs))
    with _slots_lock:
        slot = _slots.get(ids)
        if slot is None or any(r() is not o for r, o in zip(slot.refs, objs)):
            try:
                refs = tuple(weakref.ref(o, _forget(ids)) for o in objs)
            except TypeError:  # (no weak references to it: a __slots__ class without __weakref__)
                return make()
            slot = _slots[ids] = _Slot(refs)
        shared = slot.by_options.get(key)
        if shared is None:
            shared = slot.by_options[key] = make()
        return shared


def _forget(ids: tuple):
    def drop(ref):  # the function (or a bound method's object) died: its shared state goes with it
        with _slots_lock:
            slot = _slots.get(ids)
            if slot is not None and ref in slot.refs:
                del _slots[ids]

    return drop


def forget_all() -> None:
    """Forget every function's shared state: jit objects made later start afresh (those alive keep theirs)."""
    with _slots_lock:
        _slots.clear()


def identity_of(fn) -> tuple | None:
    """What makes a jit object of `fn` the same function as another: the function object itself.

    A bound method (a new object per attribute access) is its function and its object; an nn.Module is the module.
    None (no sharing) for what cannot be held weakly."""
    objs = (fn.__func__, fn.__self__) if isinstance(fn, types.MethodType) else (fn,)
    try:
        for o in objs:
            weakref.ref(o)
    except TypeError:
        return None
    return objs


def options_key(given: dict) -> tuple | None:
    """jit's options as given, in a hashable form, equal for equal options.

    Each value with its type (1 and True, a list and a tuple, stay apart), containers entry by entry in their
    order. None where some value is unhashable (a mutable record, a list inside a value that is not a plain
    container): those jit objects keep state of their own rather than compare options that may change. A hashable
    value (a Batched spec, a frozen record, a function as a pad rule) is taken as immutable, as jax takes static
    arguments."""
    try:
        key = _canonical(given)
        hash(key)
    except TypeError:
        return None
    return key


def _canonical(x):
    if type(x) is dict:
        return dict, tuple((_canonical(k), _canonical(v)) for k, v in x.items())
    if type(x) in (list, tuple):
        return type(x), tuple(_canonical(v) for v in x)
    hash(x)  # TypeError: not shared
    if attrs.has(type(x)):  # a frozen record (Batched, a tree of them): field by field, with their types
        return type(x), tuple(_canonical(getattr(x, f.name)) for f in attrs.fields(type(x)) if f.eq)
    if isinstance(x, tuple):  # a NamedTuple
        return type(x), tuple(_canonical(v) for v in x)
    return type(x), x
