"""Graphs: record a callable once and replay it, in a memory pool shared by a jitted function's graphs.

CUDA graphs on the GPU; on the CPU a stand-in with the same contract (static inputs, outputs overwritten in
place by every replay), so CPU tests drive the same dispatch path.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

ABANDONED: list = []  # CUDAGraphs whose capture failed (CudaGraph.capture): kept, never destroyed


def abandoned() -> int:
    """How many CUDA graphs of this process failed their capture (kept alive, see CudaGraph.capture)."""
    return len(ABANDONED)


class CudaGraph:
    """One torch.cuda.CUDAGraph in a pool shared by every graph of a jitted function."""

    def __init__(self, pool):
        self.graph, self.pool, self.out, self.uses = torch.cuda.CUDAGraph(), pool, None, ()

    def weaken(self) -> None:
        """Stop owning the outputs (after the signature's capture).

        Their pool blocks go back to the pool, so the next signature captured reuses them: the pool holds about
        one signature's outputs, not the sum over all (vLLM's weak_ref_tensors, Inductor's cudagraph trees). A
        replay still writes there, so outputs stay valid until the next call of the function, which may replay
        another signature over the same memory."""
        self.out = pytree.tree_map(_weak, self.out)
        self.uses = self._uses()

    def _uses(self) -> list[tuple[int, int]]:
        # per output: views of its memory (storage use count) and references to the tensor itself (a call whose
        # N is the bucket hands out the very tensor, no view)
        return [(_uses(t), sys.getrefcount(t)) for t in pytree.tree_leaves(self.out) if isinstance(t, torch.Tensor)]

    def in_use(self) -> bool:
        """Whether anyone besides this graph holds its outputs or views of them.

        If so, its pool must outlive a reset."""
        return any(a[0] > b[0] or a[1] > b[1] for a, b in zip(self._uses(), self.uses))

    def capture(self, fn: Callable, *args) -> Any:
        # No automatic collection during the stream capture: it may destroy CUDA objects that unrelated garbage
        # holds (another function's graphs, their memory), which is illegal while capturing and aborts the
        # process. torch.cuda.graph collects once on entry, before the capture begins.
        try:
            with _no_gc(), _own_workspaces(), torch.cuda.graph(self.graph, pool=self.pool):
                self.out = fn(*args)
        except BaseException:
            # A CUDAGraph whose capture failed midway is never destroyed: torch's reset assumes a capture that
            # ended, and destroying one that did not can abort the process inside the destructor, before the
            # error reaches the caller (pytorch/pytorch#180395, #190348). It is kept for the life of the process
            # (its pool blocks stay reserved: the price of an error path) and a fresh graph takes its place.
            ABANDONED.append(self.graph)
            self.graph, self.out = torch.cuda.CUDAGraph(), None
            raise
        return self.out

    def replay(self) -> Any:
        self.graph.replay()
        return self.out


@contextlib.contextmanager
def _no_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_CAPTURING = threading.RLock()  # the workspace handover below is process-wide: one capture at a time


@contextlib.contextmanager
def _own_workspaces():
    """The graph about to be captured owns the cuBLAS workspace its GEMMs write (split-K partial sums).

    torch keeps one workspace per (cuBLAS handle, stream) and hands it to every later GEMM on that stream, captured
    or not; a graph records its address. Left alone, the first capture in the process allocates it in its own pool
    and every later graph (other jitted functions, torch.compile's) writes there too; when anyone clears torch's
    workspaces (torch.compile's cudagraph trees do around every recording) and that first pool goes, the other
    graphs' replays write into memory that is no longer theirs. Clearing on entry makes this capture allocate its
    workspace in its own pool; clearing on exit keeps later GEMMs from inheriting it. Freed into the pool, the
    block is reused only by this function's later captures, whose replays never overlap (one call at a time).
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)  # absent from builds without CUDA
    with _CAPTURING:
        clear()
        try:
            yield
        finally:
            clear()


def _weak(t):
    """The same tensor, over memory it does not own (nothing frees it when the last view goes)."""
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        return t
    st = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty((), dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.size(), t.stride())


def _uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def run(fn: Callable, *args) -> Any:
    """Run the program (or a piece of it) on real tensors outside any CUDA graph capture.

    An exception it raises is marked as the program's own (`ran`): Cache.make reports a RunError for it, not a
    CaptureError."""
    try:
        return fn(*args)
    except Exception as e:
        e.fgraph_ran = True
        raise


def ran(e: BaseException) -> bool:
    """Whether the exception came from running the program on real tensors (`run`), not from capturing it."""
    return getattr(e, "fgraph_ran", False)


class HostGraph:
    """The CPU stand-in for a CUDA graph.

    Replay reruns `fn` on the captured arguments and writes into the captured outputs, which reproduces a CUDA
    graph's observable behaviour (stable input and output addresses)."""

    def __init__(self, pool=None):
        self.fn, self.args, self.out, self.write = None, (), None, None

    def weaken(self) -> None:  # host memory is not pooled: outputs stay owned, per graph
        pass

    def in_use(self) -> bool:
        return False

    def capture(self, fn: Callable, *args) -> Any:
        # aliases of the inputs' memory, not the tensor objects: a CUDA graph reads the memory it was captured with
        # even if the object is later pointed elsewhere (`t.data = u`)
        self.fn, self.args = fn, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        self.out = run(fn, *self.args)  # the CPU's "capture" is an eager run: its errors are the program's
        self.write = refiller(self.out)
        return self.out

    def replay(self) -> Any:
        self.write(self.fn(*self.args))
        return self.out


def refiller(recorded) -> Callable[[Any], None]:
    """`fresh -> None`: writes a run's fresh outputs into the recorded ones, as a graph replay does: same memory, this
    run's values.

    An output whose elements repeat in memory (`x.sum(0).expand(3, 2)`: stride 0 along a dim, which copy_ refuses
    to write) is written through one slice along each such dim, its memory once; outputs that are views of one
    another are written each with the same values; one that is the fresh one's very memory (a donated input's,
    written by the program itself) copy_ leaves as it is. What depends on the recorded outputs alone (their leaves,
    the slices) is worked out once: a replay on the CPU runs it per piece per call. A flat tuple or list (a graph
    module's outputs) is read as it is, not flattened again."""
    leaves = pytree.tree_leaves(recorded)
    kind, n = type(recorded), len(leaves)
    # its elements are its leaves (a nested container would be flattened into others)
    flat = kind in (tuple, list) and n == len(recorded) and all(map(operator.is_, leaves, recorded))
    writes = []
    for i, old in enumerate(leaves):
        if isinstance(old, torch.Tensor):
            repeated = tuple(d for d in range(old.dim()) if old.stride(d) == 0 and old.shape[d] > 1)
            into = old
            for d in repeated:
                into = into.narrow(d, 0, 1)
            writes.append((i, old, into, repeated))

    def write(fresh) -> None:
        now = fresh if flat and type(fresh) is kind and len(fresh) == n else pytree.tree_leaves(fresh)
        for i, old, into, repeated in writes:
            new = now[i]
            if old is new:
                continue
            for d in repeated:
                new = new.narrow(d, 0, 1)
            into.copy_(new)

    return write


def graph_class(device: str):
    return CudaGraph if device.startswith("cuda") else HostGraph


def new_pool(device: str):
    return torch.cuda.graph_pool_handle() if device.startswith("cuda") else None


@contextlib.contextmanager
def capture_session(device: str):
    """Freeze the GC for the whole capture.

    Each torch.cuda.graph collects and empties the cache on every entry, which made capturing one graph per piece
    slow in vLLM; one collection up front is enough."""
    gc.collect()
    gc.freeze()
    collect, empty = gc.collect, torch.cuda.empty_cache
    gc.collect, torch.cuda.empty_cache = (lambda *a, **k: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = collect, empty
        gc.unfreeze()


def pool_bytes(device: str) -> int:
    return torch.cuda.memory_reserved(device) if device.startswith("cuda") else 0
