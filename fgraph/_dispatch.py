"""What dispatch proves unchanged and what it copies: the guards that let the replay path skip re-reading an
argument, and the inputs a captured graph reads by address (read in place, or copied into fgraph's buffers).

Inputs are values (jax.jit's contract): any non-static tensor leaf may be a new tensor on any call.
- Guards: an argument passed again (the same object) is not flattened again only when what it holds is proven the
  same. Immutable containers (tuples, NamedTuples, frozen attrs classes and dataclasses) need no proof beyond their
  identity; every mutable node (dict, list, mutable record, other registered node types) is re-read per call and
  its children compared by identity with what the last flatten saw (`guard_for`).
- Slots: a graph reads a non-batched tensor input at the address it was captured with. A call passing that tensor
  (or one at the same address and strides) is read in place, for free. The first time a call passes another
  tensor there, the signature is captured again to read the new one in place (a reloaded checkpoint costs one
  capture per signature, no copies, and fgraph lets go of the old tensors). The second time (state fed back as new
  tensors each call, or two params sets in turn) the slot becomes a copied one: fgraph allocates its own buffer for
  it (shared by the function's signatures), captures the signature to read that, and from then on copies the
  caller's tensor in before each replay, and back out after it for donated state (the function wrote into it;
  eager would have written into the caller's tensor). Captured tensors are never written into by a call that did
  not pass them.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from ._errors import CaptureError, FgraphError, SignatureError
from ._pytree import _RECORDS, _children
from ._signature import Signature, leaf_of, path_str, torch_state
from ._state import root_of

log = logging.getLogger("fgraph")

COPY_LOG_BYTES = 4 << 20  # a call copying more than this logs one line per function and set of key paths


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


def _node_children(x, spec) -> tuple[Callable[[Any], Any], tuple]:
    """(read, snapshot): read(x) returns what x holds now (children and anything in its tree structure) for an
    identity comparison with the snapshot."""
    typ = spec.type
    if typ is dict or isinstance(x, dict):

        def read(d):
            return (*d, *d.values())

    elif typ is list:
        read = tuple
    elif typ in _RECORDS:
        dynamic, static = _RECORDS[typ]
        names = [*dynamic, *static]
        get = operator.attrgetter(*names) if names else (lambda o: ())
        read = get if len(names) != 1 else (lambda o, g=get: (g(o),))
    else:
        flatten = pytree.SUPPORTED_NODES[typ].flatten_fn

        def read(o):
            children, ctx = flatten(o)
            return (*children, ctx)

    return read, tuple(read(x))


def guard_for(tree, spec: pytree.TreeSpec) -> Callable[[], bool] | None:
    """A check that `tree` (flattened to `spec` just now) still holds what it holds now: () -> bool. None when its
    whole structure is immutable (its identity is the proof). Each mutable node is re-read and compared by identity
    (a container replaced inside it, a longer list, a changed static field of a mutable record all fail it)."""
    checks = []

    def visit(x, sp):
        if sp.is_leaf():
            return
        if not _immutable(x):
            read, snap = _node_children(x, sp)
            checks.append((read, x, snap))
        kids = _children(sp)
        values = pytree.SUPPORTED_NODES[sp.type].flatten_fn(x)[0]
        for v, k in zip(values, kids):
            visit(v, k)

    visit(tree, spec)
    if not checks:
        return None
    is_ = operator.is_

    def guard() -> bool:
        for read, node, snap in checks:
            now = read(node)
            if len(now) != len(snap) or not all(map(is_, now, snap)):
                return False
        return True

    return guard


# -- slots -----------------------------------------------------------------------------------------------------
def _same_memory(x, t) -> bool:
    return x is t or (x.data_ptr() == t.data_ptr() and x.stride() == t.stride())


class Slots:
    """A captured entry's non-batched tensor inputs: what its graphs read (`targets`, one per address_ix), which of
    them are fgraph's own buffers, copied into per call (`copied`), and the last call's plan."""

    def __init__(self, entry, leaves: list, donate: tuple, batched: tuple = ()):
        self.entry = entry
        self.ix = list(entry.address_ix)
        self.targets = [leaves[i] for i in self.ix]  # held: the graphs read their memory
        self.copied: list[int] = []  # positions into ix whose targets are fgraph's buffers
        self.moved = [0] * len(self.ix)  # per position: how many times a call passed another tensor
        root = [root_of(entry.paths[i]) for i in self.ix]
        donate, batched = set(donate), set(batched)
        self.donated = [r in donate for r in root]
        # positions inside batched arguments (a tensor without a batch axis next to batched ones): those arguments
        # are flattened afresh every call, so no container identity vouches for these tensors (_fast_call)
        self.loose = [k for k, r in enumerate(root) if r in batched]
        self.logged = False

    def diverged(self, leaves: list, positions: list[int] | None = None) -> list[int]:
        """Positions (of `positions`, default all) whose tensor is neither at its captured address nor copied
        already: the graphs would read another tensor's memory."""
        copied = set(self.copied)
        return [
            k
            for k in (range(len(self.ix)) if positions is None else positions)
            if k not in copied and not _same_memory(leaves[self.ix[k]], self.targets[k])
        ]

    def move(self, positions: list[int], store: dict, leaves: list) -> None:
        """New tensors at these positions: read the caller's in place the first time a position moves, copy into
        fgraph's buffers (from `store`, shared by the function's signatures: one per key path and aval) after."""
        own = []
        for k in positions:
            self.moved[k] += 1
            if self.moved[k] == 1:
                self.targets[k] = leaves[self.ix[k]]
            else:
                own.append(k)
        for k in own:
            x = leaves[self.ix[k]]
            key = (self.entry.paths[self.ix[k]], tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device))
            buf = store.get(key)
            if buf is None:
                buf = store[key] = torch.empty_like(x, memory_format=torch.preserve_format)
            buf.copy_(x)
            self.targets[k] = buf
        self.copied = sorted({*self.copied, *own})

    def args(self, leaves: list) -> list:
        """The leaves with fgraph's buffers in place of the caller's tensors at copied positions."""
        if not self.copied:
            return leaves
        leaves = list(leaves)
        for k in self.copied:
            leaves[self.ix[k]] = self.targets[k]
        return leaves

    def copy_in(self, leaves: list, stats, fname: str) -> None:
        n = 0
        for k in self.copied:
            x, t = leaves[self.ix[k]], self.targets[k]
            if x is not t:
                t.copy_(x)
                n += t.numel() * t.element_size()
        if n:
            stats.copies += 1
            stats.copied_bytes += n
            if n > COPY_LOG_BYTES and not self.logged:
                self.logged = True
                paths = [self.entry.paths[self.ix[k]] for k in self.copied]
                log.warning(
                    "fgraph.jit(%s): %s: copies %.1f MiB of inputs per call (%s%s are not the tensors it was captured "
                    "with). Fix: pass the same tensors each call, or call .reset() after replacing them so the graphs "
                    "read the new ones in place",
                    fname,
                    self.entry.sig.describe(),
                    n / 2**20,
                    ", ".join(paths[:4]),
                    f" and {len(paths) - 4} more" if len(paths) > 4 else "",
                )

    def copy_back(self, leaves: list) -> None:
        """Donated state the graph wrote into fgraph's buffer goes back into the caller's tensor."""
        for k in self.copied:
            if self.donated[k]:
                x, t = leaves[self.ix[k]], self.targets[k]
                if x is not t:
                    x.copy_(t)

    def describe(self) -> list[str]:
        copied = set(self.copied)
        return [f"{self.entry.paths[i]}: {'copied' if k in copied else 'read in place'}" for k, i in enumerate(self.ix)]


# -- signatures ------------------------------------------------------------------------------------------------
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


def fast_key(statics: tuple, bucket: int | None, parts: list) -> tuple:
    """The replay path's key of a call: its statics, bucket and argument layouts (layout_key, reader's keys), with
    torch's settings (not all of B.context: functions with lifted modules, training modes, are not _plain) and grad
    mode (a trace that branched on it serves one, for_grad_mode; a call under it with a tensor that requires grad
    is the slow path's to refuse)."""
    return statics, torch_state(), torch._C.is_grad_enabled(), bucket, tuple(parts)


def layout_key(spec: pytree.TreeSpec, leaves: list) -> _Key:
    """An argument's layout as the replay path keys it: its structure, each leaf's aval, and whether any of its
    tensors requires grad (the slow path refuses those under grad mode)."""
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


# -- making and remaking a signature ---------------------------------------------------------------------------
GRAD_MODE = "<grad mode>"  # the signature entry naming the grad mode, for traces that branched on it


def for_grad_mode(jitted, call):
    """A trace that branched on torch.is_grad_enabled() serves only the grad mode it was traced in: under the
    other, the call's signature names the grad mode too (a trace of its own). Functions that never read it are
    not keyed by it, so a capture under torch.no_grad() still serves calls made with grad on."""
    entry, now = jitted.entries.get(call.sig), torch.is_grad_enabled()
    if entry is None or entry.traced.grad_mode in (None, now):
        return call
    return call._replace(sig=call.sig._replace(statics=call.sig.statics + ((GRAD_MODE, now),)))


def make(jitted, call, capture_call):
    """A new signature's entry, traced and captured; nothing of it is kept when that fails or is interrupted
    (KeyboardInterrupt included): the next call makes it again. Returns None when the capture ran out of device
    memory (what it made is freed; the caller runs the call eagerly)."""
    try:
        entry = jitted._new_entry(call)  # tracing: its errors are the trace's own (TraceError, the function's)
    except BaseException:
        drop(jitted, call.sig, None)
        raise
    try:
        jitted._capture(entry, capture_call)
        return entry
    except BaseException as e:
        drop(jitted, call.sig, entry)
        if isinstance(e, torch.OutOfMemoryError):
            return None
        if isinstance(e, FgraphError) or not isinstance(e, Exception):
            raise
        raise CaptureError(
            f"fgraph.jit({jitted.name}): the warm-up or capture of signature {call.sig.describe()} failed: "
            f"{type(e).__name__}: {e}",
            "the eager function fails the same way on these inputs (fgraph.disable_jit() to see it there); the "
            "signature was dropped and the next call tries again",
        ) from e


def drop(jitted, sig, entry) -> None:
    """Forget a signature and anything half made for it: its entry, a trace made for it, fast-path keys, graphs."""
    jitted.entries.pop(sig, None)
    if entry is None:
        return
    for key in [k for k, e in jitted._fast.items() if e is entry]:
        del jitted._fast[key]
    if entry.stats.traces:  # the trace was made for this entry: drop it too (it may be half warmed)
        for family in jitted._traces.values():
            if entry.traced in family:
                family.remove(entry.traced)
    entry.graphs, entry.full, entry.buffers = [], None, None
    if entry.device.startswith("cuda"):
        with contextlib.suppress(Exception):  # the error being handled is the one to report
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def recapture(jitted, entry, call, moved: list[int]) -> None:
    """Positions `moved` of the entry's address inputs got new tensors: capture the signature again, reading them in
    place or from fgraph's buffers (Slots.move). Counted in stats() as captures."""
    from ._entry import _own_top_level

    if jitted.strict:
        paths = [entry.paths[entry.slots.ix[k]] for k in moved]
        raise SignatureError(
            f"fgraph.jit({jitted.name}, strict=True): {', '.join(paths)} is not the tensor the graphs of signature "
            f"{entry.sig.describe()} read (strict: no input copies)",
            "pass the same tensors each call (update them in place), or call .reset() after replacing them",
        )
    old = entry.graphs
    entry.slots.move(moved, jitted._owned, call.leaves)
    leaves = entry.slots.args(call.leaves)
    c = call._replace(leaves=leaves)
    entry.graphs, entry.full, entry.buffers = [], None, None
    entry.module = _own_top_level(entry.traced.program.module)
    entry.verified = None
    # warm-up and capture run the function: Entry.capture puts back the donated tensors they write (fgraph/_state.py)
    try:
        jitted._capture(entry, jitted._dummy(c, c.sig.bucket) if c.n is not None else c)
    except BaseException:
        drop(jitted, call.sig, entry)
        raise
    jitted._retired.extend([_Held(g) for g in old if g.in_use()])


class _Held:
    """Graphs replaced by a recapture whose outputs a caller still holds (kept, like reset()'s retired entries)."""

    def __init__(self, graph):
        self.graphs = [graph]


def warn_retraces(jitted, call) -> None:
    """Once a function has made config.warn_signatures signatures by itself, say so once, with what differs."""
    from ._config import config

    if jitted._made != config.warn_signatures + 1:
        return
    scalars = [
        f"{path_str(p)}={x!r}"
        for p, x in zip(call.paths, call.leaves)
        if isinstance(x, (int, float, bool)) and not isinstance(x, torch.Tensor)
    ]
    log.warning(
        "fgraph.jit(%s): %d signatures made by calls%s%s (logged once; past fgraph.config.max_signatures=%d new ones "
        "run eagerly). Fix: %s",
        jitted.name,
        jitted._made,
        closest({k: e for k, e in jitted.entries.items() if k != call.sig}, call.sig),
        f"; Python scalars are part of the signature, by value: {', '.join(scalars)}" if scalars else "",
        config.max_signatures,
        "pass values that change per call as tensors (torch.tensor(step)), or declare them static= and capture() "
        "the ones you need",
    )


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


def reader(flatten, specs, spec_id: int, nones: tuple[bool, ...]):
    """A batched argument's reader for the fast path: `tree -> (leaves, key, n)`, or None for another structure.
    key: the structure's id and each leaf's (dtype, device, shape, requires_grad) as passed (unpadded: each token
    count met gets its own key, after one call down the slow path; requires_grad: the slow path refuses one under grad
    mode; Python leaves by value); n: the largest real token count among its
    Batched leaves (None if none). Generated per structure as one tuple display (a loop of small tuples cost ~2 us).
    nones: which leaves are None (an absent optional input): torch's pytrees make None a leaf, so the structure alone
    does not tell such a call from one passing a tensor there. A value where None was, or None (or any non-tensor)
    where a Batched tensor was, is another reader's: read returns None."""
    env = {"flatten": flatten, "_T": torch.Tensor, "_leaf": leaf_of}
    names = [f"a{i}" for i in range(len(specs))]
    key = "".join(
        f"({a}.dtype, {a}.device, {a}.shape, {a}.requires_grad) if isinstance({a}, _T) else _leaf({a}), " for a in names
    )
    rows = [f"{a}.shape[{s.axis}] - {s.extra}" for a, s in zip(names, specs) if s is not None]
    n = "None" if not rows else rows[0] if len(rows) == 1 else f"max({', '.join(rows)})"
    unpack = f"  {''.join(a + ', ' for a in names)}= lv\n" if names else ""
    if any(nones):
        unpack += f"  if {' or '.join(f'{a} is not None' for a, none in zip(names, nones) if none)}:\n    return None\n"
    src = (
        f"def read(x):\n  lv = flatten(x)\n  if lv is None:\n    return None\n{unpack}"
        f"  try:\n    return lv, ({spec_id}, {key}), {n}\n"
        "  except AttributeError:\n    return None\n"  # no .shape: not a tensor where a Batched one was
    )
    exec(compile(src, "<fgraph batched reader>", "exec"), env)
    return env["read"]
