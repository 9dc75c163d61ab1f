"""Input buffers: where a signature's graphs read their per-call (batched) inputs from.

The static device memory the graphs read, the pinned host mirrors a call pads its inputs into, and the padding writes
themselves."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

_NUMPY_DTYPES = {
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
}


class InputBuffers:
    """Static buffers for the per-call (batched) inputs.

    One device allocation viewed per leaf, and on CUDA two pinned host mirrors used in turn, so a call's host inputs
    reach the device in one copy instead of one per leaf, and a call never waits for the previous call's copy (only
    for the one before it, long done)."""

    ALIGN = 64

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]], device: str, written=()):
        offsets, total = [], 0
        for shape, dtype in shapes:
            total = -(-total // self.ALIGN) * self.ALIGN
            offsets.append(total)
            total += max(1, torch.Size(shape).numel()) * dtype.itemsize
        self.device, self.cuda = device, device.startswith("cuda")
        self.layout = (total, offsets, shapes)
        self.dev_bytes = torch.zeros(max(total, 1), dtype=torch.uint8, device=device)
        self.dev = self._views(self.dev_bytes, offsets, shapes)
        self.real_dev = [-1] * len(shapes)  # rows last written per leaf: the pad rows after them are still in place
        self.written = set(written)  # leaves the program writes in place: their padding is never still in place
        self.heads = {}  # (leaf, rows) -> view of the first rows of its device buffer (see _pad_all)
        self.mirrors = [_Mirror(total, offsets, shapes) for _ in range(2)] if self.cuda else []
        self.turn = 0
        self.graph_mirror = None  # the mirror a FULL graph copies from itself (copy_in_graph)
        self.last_host = self.dev
        # on the CPU the "device" buffers are host memory: written through numpy like a mirror
        self.dev_np = [_numpy(d) for d in self.dev] if not self.cuda else None

    @staticmethod
    def _views(buf, offsets, shapes):
        return [buf[o : o + torch.Size(s).numel() * d.itemsize].view(d).view(s) for o, (s, d) in zip(offsets, shapes)]

    @property
    def host(self) -> list[torch.Tensor]:
        """The host side last written (what write returned): a pinned mirror on CUDA, the buffers on the CPU."""
        return self.last_host

    def copy_in_graph(self) -> Callable[[], None]:
        """The host -> device copy as the first step of a graph (call it inside the capture).

        A third mirror, which the graph copies in full on every replay and then marks done with an external
        event. A call then only pads its inputs into that mirror (write(..., in_graph=True)) and replays: no
        copy_ and no event record of its own, two CUDA calls that each cost more host time than the replay
        itself when the GPU is busy (docs/performance.md). On the CPU (the HostGraph stand-in reruns the copy on
        replay) the same path runs, so CPU tests cover it; only the event is a stand-in."""
        m = self.graph_mirror = _Mirror(*self.layout, pinned=self.cuda)
        last = self.mirrors[self.turn ^ 1] if self.cuda else None  # it holds the inputs written for this capture
        m.bytes.copy_(last.bytes if last is not None else self.dev_bytes)
        m.real[:] = last.real if last is not None else self.real_dev
        if self.cuda:
            m.copied = torch.cuda.Event(external=True)  # recorded by the graph, waited on from the host
            m.copied.record()  # created here, before the capture (torch creates events on first record)
        else:
            m.copied = DoneEvent()

        def copy_in():
            self.dev_bytes.copy_(m.bytes, non_blocking=True)
            m.copied.record()

        return copy_in

    def write(self, leaves: list[torch.Tensor], specs, in_graph: bool = False) -> list[torch.Tensor]:
        """Pad the leaves straight into the buffers; returns the padded views on the caller's side of the copy.

        For host inputs that is the host mirror: what plan hooks read without a device sync. in_graph: the graph
        about to replay copies its own mirror (copy_in_graph); device leaves are then copied into that host
        mirror, which waits for the device (keep batched inputs on the host)."""
        if in_graph and self.graph_mirror is not None:
            m = self.graph_mirror
            m.copied.synchronize()  # the last replay's copy must be done reading the mirror (a no-op before the first)
            _pad_all(m.host, m.host_np, m.real, leaves, specs, m.heads)
            self.last_host = m.host
            return m.host
        if self.cuda and all(x.is_cpu for x in leaves):
            m, self.turn = self.mirrors[self.turn], self.turn ^ 1
            if m.copied is not None:
                m.copied.synchronize()  # the copy made from this mirror two calls ago must be done reading it
            _pad_all(m.host, m.host_np, m.real, leaves, specs, m.heads)
            self.real_dev[:] = m.real  # the whole mirror goes over, padding included
            self.dev_bytes.copy_(m.bytes, non_blocking=True)
            m.copied = m.copied or torch.cuda.Event()
            m.copied.record()
            self.last_host = m.host
            return m.host
        for k in self.written:
            self.real_dev[k] = -1
        _pad_all(self.dev, self.dev_np or [None] * len(self.dev), self.real_dev, leaves, specs, self.heads)
        for m in self.mirrors:
            m.real[:] = [-1] * len(m.real)  # the device side changed behind the mirrors' backs
        self.last_host = self.dev
        return self.dev


class DoneEvent:
    """The CPU's stand-in for a copy's event: copies on the CPU are done when they return."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Mirror:
    """A pinned host copy of the input buffers, its numpy views, and the event of its last copy to the device."""

    def __init__(self, total, offsets, shapes, pinned: bool = True):
        self.bytes = torch.zeros(max(total, 1), dtype=torch.uint8, device="cpu", pin_memory=pinned)
        self.host = InputBuffers._views(self.bytes, offsets, shapes)
        self.host_np = [_numpy(h) for h in self.host]
        self.real = [-1] * len(shapes)
        self.heads = {}
        self.copied = None


def _numpy(t: torch.Tensor):
    # numpy views of host buffers: writing a few small rows through numpy costs well under a microsecond, a torch
    # op several (dtypes numpy lacks, such as bfloat16, keep the torch path)
    return t.numpy() if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES else None


def _fuses(t: torch.Tensor) -> bool:
    """Whether foreach copies into t's device fuse (CUDA's do; the CPU's copy tensor by tensor whatever the dtypes)."""
    return not t.is_cpu


def copy_groups(dst: list) -> list[list[int]]:
    """The positions of dst, grouped by device and dtype (first-seen order); one group where copies do not fuse."""
    if not any(map(_fuses, dst)):
        return [list(range(len(dst)))] if dst else []
    got: dict = {}
    for i, t in enumerate(dst):
        got.setdefault((t.device, t.dtype), []).append(i)
    return list(got.values())


def foreach_copy(dst: list, src: list, groups: list[list[int]] | None = None) -> None:
    """dst[i].copy_(src[i]) for every i: one `_foreach_copy_` per device and dtype of dst.

    CUDA fuses a foreach copy into multi-tensor kernels only when every tensor of its lists has one device and dtype;
    lists that mix them are copied one kernel per tensor (a transformers StaticCache: bfloat16 keys and values, an
    int64 counter per layer). groups: copy_groups(dst), for a caller that keeps it."""
    groups = copy_groups(dst) if groups is None else groups
    if len(groups) == 1:
        torch._foreach_copy_(dst, src)
        return
    for ix in groups:
        torch._foreach_copy_([dst[i] for i in ix], [src[i] for i in ix])


class LastCall(NamedTuple):
    """A call whose every leaf went to the head of its target (`_pad_all`): its leaves' shapes, the target views
    they were copied into, the rows then written per target, and the views' dtype groups."""

    shapes: list
    views: list
    real: list
    groups: list


def _pad_all(targets, targets_np, real, leaves, specs, heads: dict) -> None:
    """Pad each leaf into its target, skipping padding still in place from the previous call.

    `real` holds the rows last written per target (-1: unknown), so padding still in place is not written again.
    The usual call (every leaf as long as the last call's, or filling its target) is one `_foreach_copy_` per dtype
    into cached views of the targets' heads: a C++ call for all leaves of a dtype (cheaper than a loop of numpy slice
    writes: docs/performance.md). heads[None] remembers such a call (LastCall): a call with the same shapes, whose
    targets nobody wrote since, goes straight to that copy (a decode loop at a fixed batch size)."""
    last = heads.get(None)
    if last is not None and real == last.real and [x.shape for x in leaves] == last.shapes:
        foreach_copy(last.views, leaves, last.groups)
        return
    dst, src = [], []
    for k, (t, x, s) in enumerate(zip(targets, leaves, specs)):
        have = x.shape[s.axis]
        full = have == t.shape[s.axis]
        if x.dtype == t.dtype and (full or (have == real[k] and s.fixed_tail)):
            h = heads.get((k, have))
            if h is None:
                h = heads[k, have] = t.narrow(s.axis, 0, have)
            dst.append(h)
            src.append(x)
            real[k] = have
            continue
        tn = targets_np[k] if x.is_cpu and not x.requires_grad else None  # (is_cpu: cheaper than device.type)
        if callable(s.pad) or tn is None or x.dtype != t.dtype:
            if have == real[k] and s.fixed_tail:  # the padding already there is still right
                t.narrow(s.axis, 0, have).copy_(x)
            else:
                s.pad_into(x, t)
                real[k] = have
            continue
        valid = s.pad_into_numpy(x.numpy(), tn, tail_valid=have == real[k])
        real[k] = have if valid else -1
    groups = copy_groups(dst)
    foreach_copy(dst, src, groups)
    if dst and len(dst) == len(leaves):
        heads[None] = LastCall([x.shape for x in leaves], dst, list(real), groups)
    else:
        heads.pop(None, None)
