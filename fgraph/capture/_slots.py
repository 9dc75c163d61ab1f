"""Slots: the non-batched tensor inputs a captured graph reads by address, read in place or copied.

A call passing the captured tensor (or one at the same address and strides) is read in place, for free. The first
time a call passes another tensor there, the signature is captured again to read the new one in place (a reloaded
checkpoint costs one capture per signature, no copies, and fgraph lets go of the old tensors). The second time
(state fed back as new tensors each call, or two params sets in turn) the slot becomes a copied one: fgraph allocates
its own buffer for it (shared by the function's signatures), captures the signature to read that, and from then on
copies the caller's tensor in before each replay, and back out after it for donated state (the function wrote into
it; eager would have written into the caller's tensor). Captured tensors are never written into by a call that did
not pass them.
"""

from __future__ import annotations

import logging
import operator

import attrs
import torch

from .._state import root_of
from ._buffers import copy_groups, foreach_copy

log = logging.getLogger("fgraph")

COPY_LOG_BYTES = 4 << 20  # a call copying more than this logs one line per function and set of key paths


def _same_memory(x, t) -> bool:
    return x is t or (x.data_ptr() == t.data_ptr() and x.stride() == t.stride())


@attrs.frozen(eq=False)
class CopyPlan:
    """How a call copies (Slots._plan): the copied positions (back: the donated ones), their targets, a reader of their
    leaves from a call's leaves, and per device and dtype (copy_groups) its targets and a reader of its leaves."""

    positions: tuple
    targets: tuple
    read: object
    groups: list


class Slots:
    """A captured entry's non-batched tensor inputs.

    What its graphs read (`targets`, one per address_ix), which of them are fgraph's own buffers, copied into per
    call (`copied`), and the last call's plan."""

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
        # are flattened afresh every call, so no container identity vouches for these tensors (FastPath.find)
        self.loose = [k for k, r in enumerate(root) if r in batched]
        self._loose_with: dict[tuple, list[int]] = {}
        self._plans: dict[bool, CopyPlan] = {}  # copy in (False) and back (True): _plan; move() drops them
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
        self._bytes.clear(), self._plans.clear()

    def args(self, leaves: list) -> list:
        """The leaves with fgraph's buffers in place of the caller's tensors at copied positions."""
        if not self.copied:
            return leaves
        leaves = list(leaves)
        for k in self.copied:
            leaves[self.ix[k]] = self.targets[k]
        return leaves

    def _plan(self, back: bool) -> CopyPlan:
        """How a call copies in (back: back out).

        Made once per copied set (move() drops it): a call then copies with one C call per group and builds no
        lists (a cache made anew per generate is ~75 tensors each way per decode step)."""
        got = self._plans.get(back)
        if got is None:
            ks = tuple(k for k in self.copied if self.donated[k] or not back)
            ts = tuple(self.targets[k] for k in ks)
            ix = [self.ix[k] for k in ks]
            groups = [(tuple(ts[i] for i in g), _reader([ix[i] for i in g])) for g in copy_groups(list(ts))]
            got = self._plans[back] = CopyPlan(ks, ts, _reader(ix), groups)
        return got

    def _copy(self, leaves: list, back: bool) -> tuple:
        """Each copied position's leaf into its target (back: the target into its leaf), one foreach copy per dtype.
        Returns the positions copied: a leaf that is its target already (fgraph's buffer passed in) is not."""
        plan = self._plan(back)
        ks, ts, groups = plan.positions, plan.targets, plan.groups
        if not ks:
            return ()
        xs = plan.read(leaves)
        if any(map(operator.is_, xs, ts)):  # (rare: only the others, grouped afresh)
            pairs = [(k, t, x) for k, t, x in zip(ks, ts, xs) if x is not t]
            if not pairs:
                return ()
            ks, ts, xs = zip(*pairs)
            foreach_copy(xs, ts) if back else foreach_copy(ts, xs)
            return ks
        if len(groups) == 1:
            torch._foreach_copy_(*((xs, ts) if back else (ts, xs)))
            return ks
        for dst, src in groups:
            torch._foreach_copy_(*((src(leaves), dst) if back else (dst, src(leaves))))
        return ks

    def copy_in(self, leaves: list, stats, fname: str) -> None:
        ks = self._copy(leaves, back=False)
        if not ks:
            return
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
                    "with). Fix: pass the same tensors each call (a cache made anew per call, as transformers' "
                    "generate makes its StaticCache: make one and pass it to every call), or call .reset() after "
                    "replacing them so the graphs read the new ones in place",
                    fname,
                    self.entry.sig.describe(),
                    n / 2**20,
                    ", ".join(paths[:4]),
                    f" and {len(paths) - 4} more" if len(paths) > 4 else "",
                )

    def copy_back(self, leaves: list) -> None:
        """Donated state the graph wrote into fgraph's buffer goes back into the caller's tensor."""
        self._copy(leaves, back=True)

    def describe(self) -> list[str]:
        copied = set(self.copied)
        return [f"{self.entry.paths[i]}: {'copied' if k in copied else 'read in place'}" for k, i in enumerate(self.ix)]


def _reader(ix: list[int]):
    """leaves -> the tuple of leaves[i] for i in ix, in one C call."""
    if len(ix) > 1:
        return operator.itemgetter(*ix)
    return (lambda lv, i=ix[0]: (lv[i],)) if ix else (lambda lv: ())
