"""The replay path: what it proves unchanged, so that a call passing the same containers again skips the slow path.

Inputs are values (jax.jit's contract): any non-static tensor leaf may be a new tensor on any call. An argument
passed again (the same object) is not flattened again only when what it holds is proven the same. Immutable
containers (tuples, NamedTuples, frozen attrs classes and dataclasses) need no proof beyond their identity; every
mutable node (dict, list, mutable record, other registered node types) is re-read per call and its children
compared by identity with what the last flatten saw (`guard_for`). Batched arguments are flattened afresh by a
reader generated per structure (`reader`). The tensors a graph reads by address are checked by its Slots.
"""

from __future__ import annotations

import inspect
import operator
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import torch
import torch.utils._pytree as pytree

from .._errors import SignatureError
from .._pytree import _RECORDS, _children, flattener, is_seen_into
from .._signature import Call, batch_specs, bucket_for, leaf_of, static_key, torch_state
from ..padding import check_aliases
from ..trace import LiftedView
from ._bind import Binder


class Layout(NamedTuple):
    """A non-batched argument's flat layout as the last slow call (or the replay path, `weak`) saw it, cached by the
    container's identity."""

    tree: Any  # the argument itself, or a weak reference to it (`weak`)
    leaves: list
    key: _Key  # layout_key(structure, leaves)
    guard: Callable[[Any], bool] | None  # guard_for(tree): None when the tree is immutable
    rkey: Any = None  # its reader's key, for an argument that has readers (passed as another object before)
    weak: bool = False  # held weakly: learnt by the replay path itself (FastPath._learn), let go with the object


class Hit(NamedTuple):
    """A call the replay path serves.

    Its entry, flat leaves, real token count, bound arguments, and the identity-cached containers that vouch for the
    entry's address inputs."""

    entry: Any
    leaves: list
    n: int | None
    bound: dict
    held: list


@attrs.frozen(eq=False)
class Written:
    """The leaves an entry's program writes, as a call passed them: weak references to them, their storages' addresses,
    and a reader of them from a call's leaves (FastPath._over_written)."""

    refs: list
    storages: set
    read: Callable[[list], tuple]


class FastPath:
    """The replay path's state for one jitted function.

    Per jitted function: the argument layouts (by container identity), the batched arguments' readers (per
    structure) and the entries by (statics, torch state, grad mode, bucket, layouts). `find` serves a call from them
    or says it is the slow path's; `remember` teaches them a call the slow path ran."""

    def __init__(self, fname: str, signature: inspect.Signature, static: tuple, batch: dict, buckets: tuple):
        params = signature.parameters
        self.fname, self.batch, self.buckets = fname, batch, buckets
        self.binder = Binder(signature)  # (the calls Python accepts; None for the rest)
        self.static_sorted = tuple(sorted(static))
        # bound -> the statics tuple, in one C call (itemgetter returns a bare value for a single name)
        get = operator.itemgetter(*self.static_sorted) if self.static_sorted else (lambda b: ())
        self.statics_of = get if len(self.static_sorted) != 1 else (lambda b, g=get: (g(b),))
        self.dynamic = [k for k in params if k not in static]
        # per non-batched argument: the last slow call's object and layout (its identity proves the layout); an
        # argument once passed as another object also has readers (read afresh, its tensors checked by the entry's
        # Slots), and is keyed by the reader's key either way
        self.layouts: dict[str, Layout] = {}
        self.readers: dict[str, list[Callable]] = {}
        self.entries: dict[tuple, Any] = {}
        self.written_storages: dict[Any, Written] = {}  # entry -> the leaves it writes, as last passed
        # per argument read afresh: the id of the object the last call it served read (a cache generate makes passed
        # again on its next step is then proven by identity, _learn)
        self.last_read: dict[str, int] = {}

    def find(self, args: tuple, kwargs: dict, view=None) -> Hit | None:
        """The entry that serves this call with what the last calls proved, or None.

        view: the calling jit object's LiftedView (of the tensors its function reads without taking them), if any.

        First sight of anything, errors and fallbacks are the slow path's."""
        bound = self.binder.arguments(args, kwargs)
        if bound is None:
            return None
        try:
            statics = self.statics_of(bound)
            statics = tuple(map(static_key, statics))  # by type and value, as signatures key them (Static)
            hash(statics)
        except TypeError:
            return None
        parts, leaves, held, fresh, drop, read_fresh, n = [], [], [], [], [], [], None
        layouts = self.layouts
        for name in self.dynamic:
            v = bound[name]
            c = layouts.get(name)  # (batched arguments have readers only)
            if c is not None:
                t = c.tree
                if (t is v or (c.weak and t() is v)) and (c.guard is None or c.guard(v)):
                    parts.append(c.key if c.rkey is None else c.rkey)
                    held.append(c.key)  # the identity-cached containers (not the batched args)
                    leaves.extend(c.leaves)
                    continue
                drop.append(name)  # another object: the layout lets go of the old one if this call is served
            for read in self.readers.get(name, ()):  # known structures of this argument
                got = read(v)
                if got is not None:
                    break
            else:
                return None
            lv, key, m = got
            if m is not None and (n is None or m > n):
                n = m
            if name not in self.batch:  # its tensors: no container identity vouches for them
                fresh.append((len(leaves), len(leaves) + len(lv)))
                read_fresh.append((name, v, lv, key, read))
            parts.append(key)
            leaves.extend(lv)
        if view is not None:
            if not view.proven():
                return None
            leaves.extend(view.leaves)
            parts.append(view.key)  # the lifted leaves' layout: an entry traced with another set is not this one's
            held.append(view)  # vouches for them as a container passed again does (an entry verified with
            # another view checks every address: it may have been captured with the tensors before a reload)
        bucket = bucket_for(self.buckets, n) if n else None
        if n is not None and bucket is None:  # past the largest bucket, or an empty batch
            return None
        entry = self.entries.get(fast_key(statics, bucket, parts))
        if entry is None:  # (each token count gets its key from a slow call it served: one whose N breaks what
            return None  # the trace assumed of the batch size, run eagerly there, never gets one: Traced.breaks_at)
        # a new tensor where the graphs read another: the slow path copies it. Containers passed again vouch for
        # theirs by identity; tensors inside batched arguments (slots.loose) are flattened afresh and checked
        slots, seen = entry.slots, entry.verified
        if slots is not None:
            same = seen is not None and len(held) == len(seen) and all(map(operator.is_, held, seen))
            loose = slots.loose_with(tuple(fresh)) if fresh else slots.loose
            if (loose or not same) and slots.diverged(leaves, loose if same else None):
                return None
        if fresh and self._over_written(entry, leaves, fresh):
            return None  # a fresh tensor over memory the program writes: the slow path raises it
        for name in drop:
            layouts.pop(name, None)  # (a weak layout's object may have gone meanwhile: its callback dropped it)
        for got in read_fresh:
            self._learn(*got)
        return Hit(entry, leaves, n, bound, held)

    def _learn(self, name: str, v, lv: list, rkey, read) -> None:
        """An argument the replay path read afresh: passed as the same object twice running (a cache generate makes,
        on its every step), it gets a layout, so that later calls prove it by identity and its guard.

        The call serving it checked its tensors (Slots, _over_written) as read now; the layout holds exactly those
        leaves. It holds the object itself weakly: the caller's last reference to it frees it and drops the layout.
        A leaf argument (a tensor) is not learnt: its layout's leaves would hold it, and its reader reads one leaf."""
        if len(lv) == 1 and lv[0] is v:
            return
        if self.last_read.get(name) != id(v):  # (an id reused by a new object only costs this a layout)
            self.last_read[name] = id(v)
            return
        me = weakref.ref(self)  # (the callback must not keep the replay path's state alive)
        try:
            ref = weakref.ref(v, lambda _, name=name: (fp := me()) is not None and fp._let_go(name))
        except TypeError:  # (dicts, lists: no weak reference; such an argument stays read afresh)
            return
        layout = Layout(ref, lv, layout_key(read.spec, lv), guard_for(v, read.spec), rkey, weak=True)
        self.layouts[name] = layout
        del self.last_read[name]

    def _let_go(self, name: str) -> None:
        c = self.layouts.get(name)
        if c is not None and c.weak and c.tree() is None:
            self.layouts.pop(name, None)

    def remember(self, call: Call, entry, lifted=None, view=None):
        """Teach the replay path this call's layout.

        Per argument, its flat leaves by container identity; or, for batched arguments and arguments passed as
        another object than the last call's (state returned and passed back, a new input tensor each call), a reader
        of its structure that flattens it afresh. lifted: the calling jit object's Lifted, when its function reads
        tensors it does not take (a module's parameters); returns its view for the next calls to prove (`view`, the
        last one, kept while it holds). The jit object keeps it: a Shared holds nothing of the function's."""
        parts, offset = [], 0
        for name in self.dynamic:
            v = call.bound[name]
            lv, spec = pytree.tree_flatten(v)
            offset += len(lv)
            c = self.layouts.get(name)
            if c is not None and c.weak:  # the slow path's layout replaces one learnt
                c = None
            if name not in self.batch and c is not None and c.tree is not v:  # it changes between calls
                self.readers.setdefault(name, [])
            rkey = None
            if name in self.readers or name in self.batch:
                readers = self.readers.setdefault(name, [])
                got = next((g for r in readers if (g := r(v)) is not None), None)  # the reader find() picks
                if got is None:
                    if name in self.batch:
                        tree_spec = pytree.tree_flatten({name: v})[1]
                        specs = batch_specs(self.fname, {name: self.batch[name]}, {name: v}, tree_spec, lv)
                    else:
                        specs = [None] * len(lv)
                    nones = tuple(x is None for x in lv)  # None is a leaf: the same structure with a tensor there
                    spec_id = sum(map(len, self.readers.values()))  # unique among this function's readers
                    readers.append(reader(flattener(spec), specs, spec_id, nones))
                    readers[-1].spec = spec
                    got = readers[-1](v)
                rkey = got[1]
            if name in self.batch:
                parts.append(rkey)
                continue
            key = layout_key(spec, lv)
            if c is None or c.tree is not v or c.key != key or c.rkey != rkey or (c.guard and not c.guard(v)):
                self.layouts[name] = c = Layout(v, lv, key, guard_for(v, spec), rkey)
            parts.append(c.key if rkey is None else c.rkey)  # the objects find() appends: equal by identity
        if lifted:
            if view is None or not view.proven():
                view = LiftedView(lifted, call.leaves[offset:])
                view.key = _Key(
                    ("lifted", tuple(map(leaf_of, view.leaves)), tuple(view.training), tuple(view.guard_keys))
                )
            if not view.whole:
                return None  # the jit object's calls take the slow path
            parts.append(view.key)
        statics = tuple(call.bound[k] for k in self.static_sorted)
        statics = tuple(map(static_key, statics))
        self.entries[fast_key(statics, call.sig.bucket, parts)] = entry
        return view if lifted else None

    def _over_written(self, entry, leaves: list, fresh: list) -> bool:
        """Whether a fresh leaf shares memory with a leaf the program writes (check_aliases, on those leaves only).

        The written leaves' storages are kept per entry while the same tensors (by weak reference) are passed
        there: a cache held by identity is not walked again per call; only fresh leaves whose storage is among them
        are checked in full."""
        traced = entry.traced
        written = traced.written_ix
        if not written:
            return False
        known = self.written_storages.get(entry)
        # (the written leaves now against the ones the storages were read from: one C loop, `_deref` and `is`)
        if known is None or not all(map(operator.is_, map(_deref, known.refs), known.read(leaves))):
            refs = [weakref.ref(leaves[w]) for w in written]
            get = operator.itemgetter(*written) if len(written) > 1 else (lambda lv, w=written[0]: (lv[w],))
            storages = {leaves[w].untyped_storage().data_ptr() for w in written}
            known = self.written_storages[entry] = Written(refs, storages, get)
        storages = known.storages
        near = [
            i
            for a, b in fresh
            for i in range(a, b)
            if isinstance(x := leaves[i], torch.Tensor) and x.untyped_storage().data_ptr() in storages
        ]
        if not near:
            return False
        try:
            check_aliases(self.fname, traced, leaves, None, only=near)
        except SignatureError:
            return True
        return False

    def forget(self, entry) -> None:
        """Drop every key that leads to `entry` (its signature is being dropped)."""
        for key in [k for k, e in self.entries.items() if e is entry]:
            del self.entries[key]
        self.written_storages.pop(entry, None)

    def clear(self) -> None:
        self.layouts.clear(), self.readers.clear(), self.entries.clear(), self.written_storages.clear()
        self.last_read.clear()


_deref = weakref.ref.__call__  # a weak reference's object (None once it is gone)


# -- guards ----------------------------------------------------------------------------------------------------
def _immutable(x) -> bool:
    t = type(x)
    if t is tuple or pytree.is_namedtuple_class(t) or x is None:
        return True
    if attrs.has(t):
        return bool(getattr(t, "__attrs_attrs__", None)) and _attrs_frozen(t)
    params = getattr(t, "__dataclass_params__", None)
    return params is not None and params.frozen


def _attrs_frozen(t) -> bool:
    # attrs marks frozen classes by their __setattr__ (attrs has no public "is frozen" query)
    return getattr(t.__setattr__, "__name__", "") == "_frozen_setattrs"


def _node_children(x, spec) -> tuple[str, Callable[[Any], Any] | None]:
    """How a guard reads a node's contents (its children and anything in its tree structure), for identity checks.

    Returns (how, read): how is "dict" (keys then values), "vars" (an object seen into, an HF cache layer: its
    attributes' names then values), "seq" (a list's items) or "read" (read(x) returns a tuple)."""
    typ = spec.type
    if typ is dict or isinstance(x, dict):
        return "dict", None
    if typ is list:
        return "seq", None
    if is_seen_into(x):
        return "vars", None
    if typ in _RECORDS:
        dynamic, static = _RECORDS[typ]
        names = [*dynamic, *static]
        get = operator.attrgetter(*names) if names else (lambda o: ())
        return "read", get if len(names) != 1 else (lambda o, g=get: (g(o),))
    flatten = pytree.SUPPORTED_NODES[typ].flatten_fn

    def read(o):
        children, ctx = flatten(o)
        return (*children, ctx)

    return "read", read


def guard_for(tree, spec: pytree.TreeSpec) -> Callable[[Any], bool] | None:
    """A check that `tree` (flattened to `spec` just now) still holds what it holds now: guard(tree) -> bool.

    None when its whole structure is immutable (its identity is the proof). Each mutable node is re-read and
    compared by identity (a container replaced inside it, a longer list, a changed static field of a mutable record
    all fail it). The guard holds the nodes below the root, not the root itself: it is passed the tree (proven the
    same object by its caller), so a layout may hold its argument weakly.

    Generated per tree as straight-line Python (as `flattener`): every node's length, then one identity comparison
    of all their contents in a row, a C loop; a call per node cost more than the comparisons (a 24-layer cache's 26
    nodes). The lengths keep each node's contents in place in the row."""
    env: dict = {"_is": operator.is_, "_all": all, "_map": map, "_vars": vars, "_len": len}
    lines, lens, row, snap = [], [], [], []

    def visit(x, sp):
        if sp.is_leaf():
            return
        if not _immutable(x):
            i = len(lens)
            how, read = _node_children(x, sp)
            if x is tree:
                lines.append(f"n{i} = root")
            else:
                env[f"n{i}"] = x
            if how == "read":
                env[f"r{i}"] = read
                lines.append(f"d{i} = r{i}(n{i})")
                d = read(x)
            else:
                lines.append(f"d{i} = _vars(n{i})" if how == "vars" else f"d{i} = n{i}")
                d = vars(x) if how == "vars" else x
            keyed = how in ("dict", "vars")  # names then values
            lens.append(len(d))
            row.append(f"*d{i}, *d{i}.values()" if keyed else f"*d{i}")
            snap.extend((*d, *d.values()) if keyed else d)
        kids = _children(sp)
        values = pytree.SUPPORTED_NODES[sp.type].flatten_fn(x)[0]
        for v, k in zip(values, kids):
            visit(v, k)

    visit(tree, spec)
    if not lens:
        return None
    env["LENS"], env["SNAP"] = tuple(lens), tuple(snap)
    src = (
        "def guard(root):\n"
        + "".join(f"  {ln}\n" for ln in lines)
        + f"  if ({''.join(f'_len(d{i}), ' for i in range(len(lens)))}) != LENS:\n    return False\n"
        + f"  return _all(_map(_is, ({', '.join(row)},), SNAP))\n"
    )
    exec(compile(src, "<fgraph guard>", "exec"), env)
    return env["guard"]


# -- keys -----------------------------------------------------------------------------------------------------
def fast_key(statics: tuple, bucket: int | None, parts: list) -> tuple:
    """The replay path's key of a call: its statics (static_key: type and value), bucket and argument layouts.

    Layouts: layout_key, reader's keys. With torch's settings (not all of the slow path's context: functions with
    lifted modules, training modes, are not _plain) and grad mode (a trace that branched on it serves one,
    Cache.for_grad_mode; a call under it with a tensor that requires grad is the slow path's to refuse)."""
    return statics, torch_state(), torch._C.is_grad_enabled(), bucket, tuple(parts)


def layout_key(spec: pytree.TreeSpec, leaves: list) -> _Key:
    """An argument's layout as the replay path keys it.

    Its structure, each leaf's aval, and whether any of its tensors requires grad (the slow path refuses those under
    grad mode)."""
    grads = any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
    return _Key((spec, tuple(leaf_of(x) for x in leaves), grads))


class _Key:
    """A hashable layout key that hashes once: a params tree of hundreds of leaves is looked up per call."""

    __slots__ = ("key", "hash")

    def __init__(self, key):
        self.key, self.hash = key, hash(key)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return self is other or (isinstance(other, _Key) and self.hash == other.hash and self.key == other.key)


def reader(flatten, specs, spec_id: int, nones: tuple[bool, ...]):
    """A batched argument's reader for the fast path: `tree -> (leaves, key, n)`, or None for another structure.

    key: the structure's id and each leaf's (dtype, device, shape, requires_grad; the strides of a non-contiguous
    leaf without the batch axis, as signatures key it) as passed (unpadded: each token
    count met gets its own key, after one call down the slow path; requires_grad: the slow path refuses one under
    grad mode; Python leaves by value); n: the largest real token count among its Batched leaves (None if none).
    Generated per structure as one tuple display (a loop of small tuples costs more: docs/performance.md). nones:
    which leaves are None (an absent optional input): torch's pytrees make None a leaf, so the structure alone does
    not tell such a call from one passing a tensor there. A value where None was, or None (or any non-tensor) where
    a Batched tensor was, is another reader's: read returns None."""
    env = {"flatten": flatten, "_T": torch.Tensor, "_leaf": leaf_of}
    names = [f"a{i}" for i in range(len(specs))]
    # a leaf without the batch axis is read in its own layout: keyed by its strides where not contiguous (leaf_of)
    layout = {True: ", None if {a}.is_contiguous() else {a}.stride()", False: ""}
    key = "".join(
        f"({a}.dtype, {a}.device, {a}.shape, {a}.requires_grad{layout[s is None].format(a=a)}) "
        f"if isinstance({a}, _T) else _leaf({a}), "
        for a, s in zip(names, specs)
    )
    rows = [f"{a}.shape[{s.axis}] - {s.extra}" for a, s in zip(names, specs) if s is not None]
    n = "None" if not rows else rows[0] if len(rows) == 1 else f"max({', '.join(rows)})"
    unpack = f"  {''.join(a + ', ' for a in names)}= lv\n" if names else ""
    if any(nones):
        unpack += f"  if {' or '.join(f'{a} is not None' for a, none in zip(names, nones) if none)}:\n    return None\n"
    src = (
        f"def read(x):\n  lv = flatten(x)\n  if lv is None:\n    return None\n{unpack}"
        f"  try:\n    return lv, ({spec_id}, {key}), {n}\n"
        "  except (AttributeError, IndexError):\n    return None\n"  # no .shape, or no batch axis: not such a tensor
    )
    exec(compile(src, "<fgraph batched reader>", "exec"), env)
    return env["read"]
