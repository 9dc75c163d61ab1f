"""Slots: the non-batched tensor inputs a captured graph reads by address, read in place or copied.

A call passing the captured tensor (or one at the same address and strides) is read in place, for free. The first
time a call passes another tensor there, the signature is captured again to read the new one in place (a reloaded
checkpoint costs one capture per signature, no copies, and fgraph lets go of the old tensors). The second time
(state fed back as new tensors each call, or two params sets in turn) the slot becomes a copied one: fgraph allocates
its own buffer for it (shared by the function's signatures), captures the signature to read that, and from then on
copies the caller's tensor in before each replay, and back out after it for donated state (the function wrote into
it; eager would have written into the caller's tensor). Captured tensors are never written into by a call that did
not pass them.

Donated state passed anew (transformers' generate makes a StaticCache per generate) is adopted instead of copied per
call: its contents move into fgraph's buffer once and the caller's tensor is set onto the buffer (`Tensor.set_`), so
later calls read and write it in place, as eager writes the caller's tensor. Only a tensor nothing else can see the
memory of is adopted (no view of it, no graph reading it in place), and the tensor the buffer held before gets a
copy of what it held (`Owned`).
"""

from __future__ import annotations

import logging
import operator
import weakref

import attrs
import torch

from .._state import root_of
from ._buffers import copy_groups, foreach_copy

log = logging.getLogger("fgraph")

COPY_LOG_BYTES = 4 << 20  # a call copying more than this logs one line per function and set of key paths


def _same_memory(x, t) -> bool:
    return x is t or (x.data_ptr() == t.data_ptr() and x.stride() == t.stride())


# every caller's tensor some graph reads in place (a Slots target), by id: never set onto a buffer, nor off one. (A
# WeakSet would compare two references to one tensor with the tensor's own elementwise ==.)
_read_in_place: dict[int, weakref.ref] = {}


def _mark_read_in_place(t) -> None:
    if type(t) is torch.Tensor and id(t) not in _read_in_place:
        _read_in_place[id(t)] = weakref.ref(t, lambda _, i=id(t): _read_in_place.pop(i, None))


def _is_read_in_place(t) -> bool:
    r = _read_in_place.get(id(t))
    return r is not None and r() is t


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # (torch's own count of a storage's holders)
_data_ptr, _stride = torch.Tensor.data_ptr, torch.Tensor.stride


def _holders(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold t's memory, not counting this call's own."""
    s = t.untyped_storage()
    return _use_count(s._cdata) - 1


def _set(t: torch.Tensor, onto: torch.Tensor) -> bool:
    """t.set_(onto): whether torch allowed it (an inference tensor outside inference mode may not be written)."""
    try:
        t.set_(onto)
    except RuntimeError:
        return False
    return True


@attrs.define(eq=False)
class Owned:
    """One of fgraph's buffers for a copied slot (shared by the function's signatures), and the caller's tensor
    adopted onto it, if any (weakly: the caller's last reference frees it)."""

    tensor: torch.Tensor
    holder: weakref.ref | None = None
    others: int = 0  # what held the buffer's memory beside the holder when it was adopted (fgraph's own aliases)

    def vacate(self) -> bool:
        """Make the buffer fgraph's own again (before a copy into it, or adopting another tensor): whether it is.

        Its holder, if alive and still on it, moves off with a copy of what it holds, unless something new holds the
        buffer's memory beside it (a view of the holder would go stale): then it stays, and the caller must put the
        buffer's contents back after using it."""
        prev = self.holder() if self.holder is not None else None
        buf = self.tensor
        if prev is None or prev.data_ptr() != buf.data_ptr():
            return True
        if _is_read_in_place(prev) or _holders(buf) != self.others + 1 or not _set(prev, prev.clone()):
            return False
        self.holder = None
        return True

    def adopt(self, x: torch.Tensor) -> bool:
        """Move x's contents into the (vacated) buffer and set x onto it, if that is safe; whether it did.

        Safe: x is a plain tensor outside autograd, the only holder of its memory (a view of it would go stale), and
        read in place by no graph."""
        buf = self.tensor
        if (
            _use_count is None
            or type(x) is not torch.Tensor
            or x.requires_grad
            or x.stride() != buf.stride()
            or _is_read_in_place(x)
            or _holders(x) != 1
        ):
            return False
        buf.copy_(x)
        if not _set(x, buf):
            return False
        self.holder, self.others = weakref.ref(x), _holders(buf) - 1
        return True


@attrs.frozen(eq=False)
class CopyPlan:
    """How a call copies a set of positions in (Slots._plan): the positions, their targets, a reader of their leaves
    from a call's leaves, per device and dtype (copy_groups) its targets and a reader of its leaves, and the targets'
    addresses and strides (donated leaves on them are in place: adopted, or fgraph's buffer passed in)."""

    positions: tuple
    targets: tuple
    read: object
    groups: list
    ptrs: list
    strides: list


class Slots:
    """A captured entry's non-batched tensor inputs.

    What its graphs read (`targets`, one per address_ix), which of them are fgraph's own buffers, copied into per
    call (`copied`), and the last call's plan."""

    def __init__(self, entry, leaves: list, donate: tuple, batched: tuple = ()):
        self.entry = entry
        self.ix = list(entry.address_ix)
        self.targets = [leaves[i] for i in self.ix]  # held: the graphs read their memory
        for t in self.targets:
            _mark_read_in_place(t)
        self.copied: list[int] = []  # positions into ix whose targets are fgraph's buffers
        self.owned: dict[int, Owned] = {}  # copied position -> its buffer (store's)
        self._restore: list = []  # (buffer, its contents) to put back after this call (copy_in -> copy_back)
        self.moved = [0] * len(self.ix)  # per position: how many times a call passed another tensor
        root = [root_of(entry.paths[i]) for i in self.ix]
        donate, batched = set(donate), set(batched)
        self.donated = [r in donate for r in root]
        # positions inside batched arguments (a tensor without a batch axis next to batched ones): those arguments
        # are flattened afresh every call, so no container identity vouches for these tensors (FastPath.find)
        self.loose = [k for k, r in enumerate(root) if r in batched]
        self._loose_with: dict[tuple, list[int]] = {}
        self._plans: tuple[CopyPlan, CopyPlan] | None = None  # how a call copies in (_plan); move() drops it
        self._bytes: dict[tuple, int] = {}  # copied-in positions -> the bytes their targets hold (move() resets it)
        self.logged = False

    def loose_with(self, ranges: tuple) -> list[int]:
        """`loose` plus the positions whose leaves fall in these (start, end) ranges of a call's leaves: arguments
        the replay path flattened afresh, whose tensors no container identity vouches for."""
        got = self._loose_with.get(ranges)
        if got is None:
            inside = (k for k, i in enumerate(self.ix) if any(a <= i < b for a, b in ranges))
            got = self._loose_with[ranges] = sorted({*self.loose, *inside})
        return got

    def diverged(self, leaves: list, positions: list[int] | None = None) -> list[int]:
        """Positions whose tensor is neither at its captured address nor copied already.

        Of `positions` (default all). At those, the graphs would read another tensor's memory."""
        copied = set(self.copied)
        return [
            k
            for k in (range(len(self.ix)) if positions is None else positions)
            if k not in copied and not _same_memory(leaves[self.ix[k]], self.targets[k])
        ]

    def move(self, positions: list[int], store: dict, leaves: list) -> None:
        """Take new tensors at these positions: read in place the first time, copied into fgraph's buffers after.

        The first time a position moves, the graphs read the caller's tensor; after, fgraph's buffer from `store`
        (shared by the function's signatures: one per key path and aval)."""
        own = []
        for k in positions:
            self.moved[k] += 1
            if self.moved[k] == 1:
                self.targets[k] = leaves[self.ix[k]]
                _mark_read_in_place(self.targets[k])
            else:
                own.append(k)
        for k in own:
            x = leaves[self.ix[k]]
            key = (self.entry.paths[self.ix[k]], tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device))
            owned = store.get(key)
            # a caller's tensor adopted onto the shared buffer moves off it first (with its contents); one that cannot
            # (read in place by a graph, or a view of it alive) keeps it, and this slot gets a buffer of its own
            if owned is None or not owned.vacate():
                owned = store[key] = Owned(torch.empty_like(x, memory_format=torch.preserve_format))
            owned.tensor.copy_(x)
            self.targets[k], self.owned[k] = owned.tensor, owned
        self.copied = sorted({*self.copied, *own})
        self._bytes.clear()
        self._plans = None

    def args(self, leaves: list) -> list:
        """The leaves with fgraph's buffers in place of the caller's tensors at copied positions."""
        if not self.copied:
            return leaves
        leaves = list(leaves)
        for k in self.copied:
            leaves[self.ix[k]] = self.targets[k]
        return leaves

    def _plan(self) -> tuple[CopyPlan, CopyPlan]:
        """How a call copies in: (the positions not donated, always copied; the donated ones, adopted once they can
        be). Made once per copied set (move() drops them): a call then copies with one C call per group and builds no
        lists (a cache made anew per generate is ~75 tensors each way per decode step)."""
        if self._plans is None:
            copied = [k for k in self.copied if not self.donated[k]], [k for k in self.copied if self.donated[k]]
            self._plans = tuple(map(self._plan_of, copied))
        return self._plans

    def _plan_of(self, ks: list) -> CopyPlan:
        ts = tuple(self.targets[k] for k in ks)
        ix = [self.ix[k] for k in ks]
        groups = [(tuple(ts[i] for i in g), _reader([ix[i] for i in g])) for g in copy_groups(list(ts))]
        return CopyPlan(tuple(ks), ts, _reader(ix), groups, list(map(_data_ptr, ts)), list(map(_stride, ts)))

    def copy_in(self, leaves: list, stats, fname: str) -> tuple:
        """Each copied position's leaf into its target, one foreach copy per dtype; donated leaves adopted where they
        can be (Owned.adopt), after which they are in place. Returns the positions copied (copy_back's)."""
        kept, donated = self._plan()
        left = ()
        if donated.positions:
            xs = donated.read(leaves)
            # every donated leaf on its buffer: none to adopt or copy (two C loops)
            if list(map(_data_ptr, xs)) != donated.ptrs or list(map(_stride, xs)) != donated.strides:
                left, lx = self._adopt(donated.positions, xs, stats)
        ks = self._copy(kept, leaves) + left
        if left:  # (after the others: _adopt cloned any of these leaves over a buffer they write)
            foreach_copy([self.targets[k] for k in left], lx)
        if ks:
            self._count(ks, stats, fname)
        return ks

    @staticmethod
    def _copy(plan: CopyPlan, leaves: list) -> tuple:
        """The plan's leaves into its targets; returns the positions copied (a leaf that is its target already,
        fgraph's buffer passed in, is not)."""
        ks, ts = plan.positions, plan.targets
        if not ks:
            return ()
        xs = plan.read(leaves)
        if any(map(operator.is_, xs, ts)):  # (rare: only the others)
            pairs = [(k, t, x) for k, t, x in zip(ks, ts, xs) if x is not t]
            if not pairs:
                return ()
            ks, ts, xs = zip(*pairs)
            foreach_copy(ts, xs)
        elif len(plan.groups) == 1:
            torch._foreach_copy_(ts, xs)
        else:
            for dst, src in plan.groups:
                torch._foreach_copy_(dst, src(leaves))
        return tuple(ks)

    def _adopt(self, ks: tuple, xs: tuple, stats) -> tuple[tuple, list]:
        """Of the donated positions whose leaf is not on its buffer: adopt the ones that can be; the rest are copied.
        Returns those positions and their leaves (a leaf over one of the copied positions' buffers, cloned: the copies
        into the buffers must not read one another's targets). A buffer a caller's tensor stays on (a view of it is
        alive) has its contents put back after the call (restore)."""
        self._restore.clear()
        left, lx = [], []
        for k, x in zip(ks, xs):
            t, owned = self.targets[k], self.owned[k]
            if _same_memory(x, t):
                continue
            if not owned.vacate():
                self._restore.append((t, t.clone()))
            elif owned.adopt(x):
                stats.adopted += 1
                continue
            left.append(k), lx.append(x)
        if left:
            mine = {self.targets[k].untyped_storage().data_ptr() for k in self.copied}
            lx = [x.clone() if x.untyped_storage().data_ptr() in mine else x for x in lx]
        return tuple(left), lx

    def _count(self, ks: tuple, stats, fname: str) -> None:
        n = self._bytes.get(ks)
        if n is None:  # (the targets are fgraph's buffers: their sizes change only when move() replaces them)
            n = self._bytes[ks] = sum(self.targets[k].numel() * self.targets[k].element_size() for k in ks)
        if n:
            stats.copies += 1
            stats.copied_bytes += n
            if n > COPY_LOG_BYTES and not self.logged:
                self.logged = True
                paths = [self.entry.paths[self.ix[k]] for k in self.copied]
                log.warning(
                    "fgraph.jit(%s): %s: copies %.1f MiB of inputs per call (%s%s are not the tensors it was captured "
                    "with). Fix: pass the same tensors each call, or call .reset() after replacing them so the graphs "
                    "read the new ones in place (donated state passed anew is adopted instead, unless a view of it or "
                    "a graph reading it in place shares its memory)",
                    fname,
                    self.entry.sig.describe(),
                    n / 2**20,
                    ", ".join(paths[:4]),
                    f" and {len(paths) - 4} more" if len(paths) > 4 else "",
                )

    def copy_back(self, leaves: list, ks: tuple) -> None:
        """Donated state the graph wrote into fgraph's buffer goes back into the caller's tensor (positions ks: the
        ones copy_in copied). A buffer a caller's tensor stayed on gets its contents back; a tensor over such a
        buffer (passed for another slot) gets its result after that."""
        back = [k for k in ks if self.donated[k]]
        dst, src = [leaves[self.ix[k]] for k in back], [self.targets[k] for k in back]
        late = []
        if self._restore and dst:
            pinned = {t.untyped_storage().data_ptr() for t, _ in self._restore}
            over = [d.untyped_storage().data_ptr() in pinned for d in dst]
            late = [(d, t.clone()) for d, t, o in zip(dst, src, over) if o]
            dst, src = [d for d, o in zip(dst, over) if not o], [t for t, o in zip(src, over) if not o]
        if dst:
            foreach_copy(dst, src)
        self.restore()
        for d, t in late:
            d.copy_(t)

    def restore(self) -> None:
        """Put back the contents of the buffers a caller's tensor stayed on (after the call, whatever it raised)."""
        for t, was in self._restore:
            t.copy_(was)
        self._restore.clear()

    def describe(self) -> list[str]:
        copied = set(self.copied)
        return [f"{self.entry.paths[i]}: {'copied' if k in copied else 'read in place'}" for k, i in enumerate(self.ix)]


def _reader(ix: list[int]):
    """leaves -> the tuple of leaves[i] for i in ix, in one C call."""
    if len(ix) > 1:
        return operator.itemgetter(*ix)
    return (lambda lv, i=ix[0]: (lv[i],)) if ix else (lambda lv: ())
