"""Replanning flashinfer's CUDA-graph wrappers without flashinfer's Python plan(): the plan half of the backend.

A wrapper made for CUDA graphs (decode, or prefill over fixed buffers) reads its schedule from its own int
workspace, which its JIT module's C++ `plan` fills: it writes the schedule into the wrapper's pinned host buffer
and copies that to the device with cudaMemcpyAsync. These classes make that one call with an argument list held
from the first plan, whose host metadata tensors are refilled in place (_ModulePlan: decode; _PrefillModulePlan:
prefill), and keep the pinned buffer from being rewritten while the last copy out of it is still queued (_Fence).
"""

from __future__ import annotations

import torch

from fgraph.extend import DoneEvent
from fgraph.ops._flashinfer_buffers import HostPlan


class _Recorder:
    """Stands in for a flashinfer wrapper's `_cached_module` during one fast_decode_plan call.

    Records the arguments of its module-level `plan` call (and forwards it), so later plans can make that call
    directly."""

    def __init__(self, inner):
        self.inner, self.call = inner, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def plan(self, *args, **kwargs):
        self.call = (args, kwargs)
        return self.inner.plan(*args, **kwargs)


def _call_on_device(fi, fn, args, kwargs):
    if fi.device.type == "cuda" and torch.cuda.current_device() != fi.device.index:
        with torch.cuda.device(fi.device):  # as flashinfer's plans (the usual case needs no switch)
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


class _ModulePlan:
    """A decode wrapper's replan as one call of its JIT module's `plan`.

    C++: DecodePlan, or PrefillPlan for the tensor-core decode. It makes the call with the argument list
    fast_decode_plan built on the first replan, in which only the host indptr (and, tensor cores, the host kv
    lengths) change: they are persistent CPU tensors refilled in place. What fast_decode_plan does per call besides
    this one call is constant for a wrapper of fixed bucket and head config: dtype strings, two empty device tensors
    (dtype carriers), a range buffer, the kv-length torch ops, a device context, the same attributes set again
    (Python and torch ops, most of its host time: docs/performance.md).

    What the plan computes, read from flashinfer's source (include/flashinfer/attention/scheduler.cuh
    DecodePlan / PrefillPlan, csrc batch_decode.cu / batch_prefill.cu, flashinfer/decode.py): from the host
    indptr alone (page counts per sequence; the tensor-core plan ignores kv_len_arr) and the static shapes, the
    split-KV schedule (request / kv-tile indices, o_indptr, chunk size, valid mask) written to the wrapper's
    own pinned buffer and copied (cudaMemcpyAsync) into the wrapper's own int workspace, and the plan info
    (offsets, padded batch, split flag) returned to Python. The kernels read last-page lengths and page ids from
    the device buffers at run time. So a plan is reusable as long as the host indptr is the same.
    """

    def __init__(self, fi_wrapper, call, indptr: torch.Tensor, batch: int):
        args, self.kwargs = list(call[0]), call[1]
        at = [i for i, a in enumerate(args) if a is indptr]
        if len(at) != 1:
            raise LookupError(f"the host indptr is argument {at} of the module's plan call")  # caught: no replay
        # persistent: the argument list holds them (host tensors name their device: set_default_device("cuda"))
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cpu")
        self.indptr_np = self.indptr.numpy()
        args[at[0]] = self.indptr
        self.lens_np = None
        nxt = args[at[0] + 1] if at[0] + 1 < len(args) else None
        if (
            isinstance(nxt, torch.Tensor)
            and nxt.device.type == "cpu"
            and nxt.dtype == torch.int32
            and nxt.shape == (batch,)
        ):  # the tensor-core plan's kv lengths (get_seq_lens of indptr and last)
            lens = torch.zeros(batch, dtype=torch.int32, device="cpu")
            self.lens_np, args[at[0] + 1] = lens.numpy(), lens
        self.fi, self.fn, self.args = fi_wrapper, fi_wrapper._cached_module.plan, args

    def __call__(self, host: HostPlan) -> None:
        self.indptr_np[:] = host.indptr
        if self.lens_np is not None:
            self.lens_np[:] = host.lens
        self.fi._plan_info = _call_on_device(self.fi, self.fn, self.args, self.kwargs)


def plan_info(info) -> tuple:
    """A plan's info (what the module's plan returns: offsets, padded batch, tile size, split flag) as ints."""
    return tuple(int(v) for v in info)


class _PrefillModulePlan:
    """A CUDA-graph prefill wrapper's replan as one call of its JIT module's `plan` (C++ PrefillPlan).

    The argument list is the one flashinfer's plan() passes for the fa2 backend (flashinfer/prefill.py,
    BatchPrefillWithPagedKVCacheWrapper.plan): the three workspaces, the host query offsets, page offsets and kv
    lengths (persistent CPU tensors here, refilled in place), the row count fixed by the first plan, the batch,
    heads, page size, cuda-graph mode, head dims, causal, the window and the split settings. plan() itself costs
    a blocking host-to-device copy of each metadata array besides (the buffers: fgraph uploads them itself).

    It is checked once, where it is made: called with the metadata of the plan() that set the wrapper up, it must
    return that plan's info (LookupError otherwise, as with another flashinfer: plans stay on plan()).

    In CUDA-graph mode the schedule's shape is fixed by the batch and the row count (scheduler.cuh,
    PrefillSplitQOKVIndptr with enable_cuda_graph: the tile size from the longest possible sequence, the grid
    padded to an upper bound of the tiles, KV always split), so every plan of a wrapper returns the same info and
    the kernels of a captured graph read the rest (tile indices, merge offsets, rows) from the int workspace."""

    def __init__(self, fi, host: HostPlan, cfg: tuple):
        hq, hkv, d, page = cfg[:4]
        if getattr(fi, "_backend", None) != "fa2" or not fi.is_cuda_graph_enabled:
            raise LookupError("not a CUDA-graph fa2 prefill wrapper")
        B = host.last.shape[0]
        self.qo, self.indptr, self.lens = (torch.zeros(n, dtype=torch.int32, device="cpu") for n in (B + 1, B + 1, B))
        names = ("qo_indptr", "indptr", "lens")
        self.views = [(t.numpy(), n) for t, n in zip((self.qo, self.indptr, self.lens), names)]
        self.args = [
            fi._float_workspace_buffer,
            fi._int_workspace_buffer,
            fi._pin_memory_int_workspace_buffer,
            self.qo,
            self.indptr,
            self.lens,
            fi._max_total_num_rows,
            B,
            hq,
            hkv,
            page,
            True,  # CUDA-graph mode
            d,
            d,
            True,  # causal
            fi._window_left,
            -1,  # fixed split size: none
            False,  # split KV allowed
            0,  # colocated CTAs (POD attention only)
        ]
        self.fi, self.fn = fi, fi._cached_module.plan
        want = plan_info(fi._plan_info)
        got = plan_info(self._plan(host))
        if got != want:
            raise LookupError(f"the module's plan returned {got}, flashinfer's plan() {want}")

    def _plan(self, host: HostPlan):
        for view, name in self.views:
            view[:] = getattr(host, name)
        return _call_on_device(self.fi, self.fn, self.args, {})

    def __call__(self, host: HostPlan) -> None:
        self.fi._plan_info = self._plan(host)


def graph_prefill_workspace(B: int, cfg: tuple, device) -> int:
    """Bytes of float workspace a CUDA-graph prefill plan of B rows and B sequences takes.

    In graph mode flashinfer always splits KV and pads the grid to max(2 CTAs a SM / kv heads, an upper bound of the
    query tiles: ceil(B * group / tile) + B - 1), with the tile size of the longest possible sequence (one token
    a sequence here: 16 rows up to groups of 16); each CTA keeps a float32 tile of outputs and one of
    log-sum-exps per query head (scheduler.cuh, PrefillPlan). At 8B shapes and B=512: 169 MB, past the default
    128 MiB."""
    hq, hkv, d = cfg[:3]
    g = hq // hkv
    tile = 16 if g <= 16 else 64 if g <= 64 or d >= 256 else 128
    dev = torch.device(device)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
    ctas = max(2 * sms // hkv, -(-B * g // tile) + B - 1)
    return hq * ctas * tile * (d + 1) * 4 + (1 << 20)  # + alignment slack


class _Fence:
    """Orders the host's writes to a wrapper's pinned plan buffer after the device's last read of it.

    flashinfer's C++ plan writes the schedule into the wrapper's pinned buffer on the host and queues its copy to
    the device (cudaMemcpyAsync) on the current stream. fgraph's replays do not wait for the device: a second
    plan made while the first one's copy is still queued behind a busy stream would rewrite the buffer under it,
    and the earlier step would run on the later step's schedule. `before` waits for the last plan's copy (no wait
    unless the device is a whole step behind); `after` marks the new one."""

    def __init__(self, device):
        self.event = torch.cuda.Event() if torch.device(device).type == "cuda" else DoneEvent()
        self.queued = False
        self.waits = 0  # plans that found the last plan's copy still queued

    def before(self) -> None:
        if self.queued and not self.event.query():
            self.waits += 1
            self.event.synchronize()

    def after(self) -> None:
        self.event.record()
        self.queued = True
