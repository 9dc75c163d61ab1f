"""The map of FunctionStates: one per function object and jit options, held weakly by the function, so jit objects
of one function and equal options are views of one state (`_function_state`)."""

from __future__ import annotations

import logging
import threading
import types
import weakref

import attrs

log = logging.getLogger("fgraph")


# ------------------------------------------------------------------------------------------------ the map
class _Slot:
    """One function's entry in the map: weak references to what identifies it, and its FunctionState per options key."""

    def __init__(self, refs: tuple):
        self.refs, self.by_options = refs, {}


_slots: dict[tuple[int, ...], _Slot] = {}  # ids of what identifies a function (identity_of) -> its slot
_slots_lock = threading.Lock()


def shared_for(fn, given: dict, make):
    """The FunctionState of `fn` and these options (`given`, as passed to jit), made by `make()` the first time.

    A function that cannot be held weakly, or options with an unhashable value, get a FunctionState of their own."""
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
