"""The flashinfer attention backend (>= 0.6). CUDA only; any page size.

  decode  BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True): one wrapper per (bucket, head config), all
          over slices of one set of persistent device buffers (indptr / indices / last-page lengths), so a
          captured graph reads its metadata from fixed addresses. Capturable: Support.UNIFORM_DECODE.
  mixed   BatchPrefillWithPagedKVCacheWrapper(backend="fa2"), one per head config, run eagerly between
          graph pieces (it is not capturable, hence the decode-only support level).

`plan()` (the host-side scheduling that fills those buffers) never runs inside a graph. fgraph's plan hook
calls `on_plan` with the call's host (CPU int32) metadata before every execution of a signature, so FULL
decode graphs replay on fresh plans without a device sync. Wrappers are created lazily by the first eager
run of their signature (warm-up), which plans them from the hook's metadata.

Freshness. All layers of one step share one plan. The eager rule treats the plan as current when the hook ran
since the last execution (`pending`), or when it gets the very tensors (same objects, same version counter)
the plan was made for (the later layers of a step). Anything else, e.g. the model called directly outside
fgraph.jit, re-plans from the device tensors (a host sync, refused during capture).
"""
from __future__ import annotations

import functools
import itertools
import weakref

import attrs
import torch

from fgraph._errors import FgraphError

WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace (split-KV partial results)
_gen = itertools.count(1)


@functools.cache
def _fi():
  import flashinfer
  return flashinfer


# ------------------------------------------------------------------------------------------- host metadata
@attrs.frozen
class HostPlan:
  """flashinfer's paged-KV description of one padded batch, on the host (CPU int32).

  qo_indptr [B+1] (= query_start_loc), indptr [B+1] page offsets, indices [indptr[-1]] page ids,
  last [B] entries in each last page (in 1..page_size: flashinfer reads 0 as a full page).
  """
  qo_indptr: torch.Tensor
  indptr: torch.Tensor
  indices: torch.Tensor
  last: torch.Tensor


def _np(t: torch.Tensor):
  return t.numpy() if t.device.type == "cpu" and t.dtype == torch.int32 else t.cpu().to(torch.int32).numpy()


def host_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              page_size: int) -> HostPlan:
  """Vectorized (no loop per sequence; numpy, ~10x cheaper than torch CPU ops at these sizes). Device inputs
  are copied to the host first (a sync: only for calls outside fgraph.jit)."""
  import numpy as np  # a flashinfer dependency
  qsl, sl, bt = _np(query_start_loc), _np(seq_lens), _np(block_table)
  npg = (sl + (page_size - 1)) // page_size                                   # [B] pages in use
  indptr = np.zeros(sl.shape[0] + 1, dtype=np.int32)
  np.cumsum(npg, out=indptr[1:])
  used = bt[:, :max(int(npg.max(initial=0)), 1)]
  indices = used[np.arange(used.shape[1], dtype=np.int32)[None, :] < npg[:, None]]  # row-major = per sequence
  last = sl - (npg - 1) * page_size
  # (copies: the caller's host tensors are fgraph's input mirror, rewritten by the next call)
  return HostPlan(torch.from_numpy(qsl.copy()), torch.from_numpy(indptr), torch.from_numpy(indices),
                  torch.from_numpy(last))


# ------------------------------------------------------------------------------------- wrappers and buffers
class _DecodeBuffers:
  """The persistent device metadata that decode wrappers (and their graphs) read: one int32 array
  [indptr (batch+1) | last (batch) | indices], wrappers of smaller buckets use the heads of its parts. `owner`:
  the plan generation whose metadata it holds. A plan fills it with one non-blocking copy from a pinned mirror
  (two, alternating); flashinfer's own plan() copies page ids from pageable memory with a blocking copy,
  which synchronizes the stream every step."""

  def __init__(self, batch: int, num_indices: int, device):
    n = 2 * batch + 1 + num_indices
    self.flat = torch.zeros(n, dtype=torch.int32, device=device)
    self.indptr, self.last, self.indices = self.flat[:batch + 1], self.flat[batch + 1:2 * batch + 1], \
        self.flat[2 * batch + 1:]
    self.batch, self.owner = batch, None
    self.cuda = torch.device(device).type == "cuda"
    if self.cuda:
      self.stage = [torch.zeros(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
      self.copied, self.turn = [None, None], 0

  def upload(self, host: HostPlan) -> torch.Tensor:
    """indptr, last-page lengths and page ids -> the device, stream-ordered, no host sync. Returns the used
    page-id slice: handed to plan() as `indices`, it makes plan's own copy of them a no-op (same memory)."""
    B, nnz, o = host.last.numel(), host.indices.numel(), self.batch
    if nnz > self.indices.numel():
      raise FgraphError(f"attention(backend='flashinfer'): {nnz} pages in use, the decode buffers hold "
                        f"{self.indices.numel()}", "keep block tables within max_pages")
    if not self.cuda:
      self.indptr[:B + 1].copy_(host.indptr)
      self.last[:B].copy_(host.last)
      self.indices[:nnz].copy_(host.indices)
      return self.indices[:nnz]
    i, self.turn = self.turn, self.turn ^ 1
    if self.copied[i] is not None:
      self.copied[i].synchronize()  # the copy made from this mirror two plans ago must be done reading it
    st, end = self.stage[i], 2 * o + 1 + nnz
    st[:B + 1].copy_(host.indptr)
    st[o + 1:o + 1 + B].copy_(host.last)
    st[2 * o + 1:end].copy_(host.indices)
    self.flat[:end].copy_(st[:end], non_blocking=True)
    self.copied[i] = torch.cuda.Event()
    self.copied[i].record()
    return self.indices[:nnz]


def _fast_decode_plan():
  """flashinfer.decode.fast_decode_plan (what vLLM and sglang replan CUDA-graph decode wrappers with): plan()
  minus the buffer copies (`upload` made them) and minus plan's O(batch) Python work. None if absent."""
  return getattr(getattr(_fi(), "decode", None), "fast_decode_plan", None)


@attrs.define(eq=False)
class _Wrapper:
  routine: str
  cfg: tuple            # (num_qo_heads, num_kv_heads, head_dim, page_size, q dtype, kv dtype, scale)
  fi: object            # the flashinfer wrapper
  bufs: _DecodeBuffers | None = None
  gen: int | None = None  # generation of its last plan

  def valid(self, gen: int) -> bool:
    return self.gen == gen and (self.bufs is None or self.bufs.owner == gen)

  def plan(self, host: HostPlan, gen: int) -> None:
    hq, hkv, d, page, qdt, kvdt, scale = self.cfg
    if self.routine == "decode":
      indices = self.bufs.upload(host)
      fast = _fast_decode_plan() if self.gen is not None else None  # the first plan sets the wrapper up
      if fast is None:
        self.fi.plan(host.indptr, indices, host.last, hq, hkv, d, page, q_data_type=qdt, kv_data_type=kvdt,
                     sm_scale=scale)
      else:
        fast(self.fi, host.indptr, indices, host.last, hq, hkv, d, page, q_data_type=qdt, kv_data_type=kvdt,
             sm_scale=scale)
      self.bufs.owner = gen
    else:
      self.fi.plan(host.qo_indptr, host.indptr, host.indices, host.last, hq, hkv, d, page, causal=True,
                   sm_scale=scale, q_data_type=qdt, kv_data_type=kvdt)
    self.gen = gen


@attrs.define
class _State:
  """Per (routine, bucket, page size): the latest plan's host metadata and what it was made for."""
  gen: int
  host: HostPlan
  pending: bool          # the hook planned it and no eager run has used it yet
  ident: tuple | None    # (weakref, version) of (query_start_loc, seq_lens, block_table) it was used with


_workspaces: dict[str, torch.Tensor] = {}
_decode_bufs: dict[str, _DecodeBuffers] = {}
_wrappers: dict[tuple, _Wrapper] = {}   # (routine, bucket or None, device, cfg) -> wrapper
_states: dict[tuple, _State] = {}       # (routine, bucket, page_size) -> state


def _workspace(device) -> torch.Tensor:
  key = str(device)
  if key not in _workspaces:
    _workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # must start zeroed
  return _workspaces[key]


def _buffers(batch: int, max_pages: int, device) -> _DecodeBuffers:
  """Shared buffers large enough for `batch` rows; a larger bucket gets a new, larger set (fgraph captures
  largest first, so in practice one set serves every bucket)."""
  key, need = str(device), batch * max_pages
  b = _decode_bufs.get(key)
  if b is None or b.batch < batch or b.indices.numel() < need:
    b = _decode_bufs[key] = _DecodeBuffers(batch, need, device)
  return b


def _wrapper(routine: str, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
             scale: float) -> _Wrapper:
  B, hq, d = q.shape
  page, hkv = k_cache.shape[1], k_cache.shape[2]
  cfg = (hq, hkv, d, page, q.dtype, k_cache.dtype, scale)
  key = (routine, B if routine == "decode" else None, str(q.device), cfg)
  w = _wrappers.get(key)
  if w is None:
    fi, ws = _fi(), _workspace(q.device)
    if routine == "decode":
      bufs = _buffers(B, block_table.shape[1], q.device)
      # The CUDA-core decode kernels cover GQA groups 1, 2, 4, 8 only; tensor cores win from 4 on anyway.
      inner = fi.BatchDecodeWithPagedKVCacheWrapper(
          ws, "NHD", use_cuda_graph=True, use_tensor_cores=hq // hkv > 2,
          paged_kv_indptr_buffer=bufs.indptr[:B + 1], paged_kv_indices_buffer=bufs.indices,
          paged_kv_last_page_len_buffer=bufs.last[:B])
      w = _Wrapper(routine, cfg, inner, bufs)
    else:
      w = _Wrapper(routine, cfg, fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2"))
    _wrappers[key] = w
  return w


def _group(routine: str, bucket: int, page_size: int, scale: float):
  """The wrappers one plan serves: decode wrappers of this bucket, or every prefill wrapper (not bucketed)."""
  return [w for (r, b, _, cfg), w in _wrappers.items()
          if r == routine and (b == bucket or routine == "mixed") and cfg[3] == page_size and cfg[6] == scale]


def reset() -> None:
  """Forget every wrapper, plan and buffer (frees their memory). Drop graphs captured over them first."""
  for d in (_wrappers, _states, _decode_bufs, _workspaces):
    d.clear()


# --------------------------------------------------------------------------------------------- plan, run
def on_plan(routine: str, bucket: int, page_size: int, scale: float, inputs) -> None:
  """fgraph's plan hook for this backend: host metadata -> plan every wrapper this signature uses."""
  missing = [k for k in ("query_start_loc", "seq_lens", "block_table") if k not in inputs]
  if missing:
    raise FgraphError(f"attention(backend='flashinfer'): the plan hook did not get {missing} as per-call inputs, "
                      "so it cannot plan the kernels before a graph replays",
                      "pass the AttentionMetadata leaves straight from the batch argument (declared Batched, "
                      "e.g. A.metadata_batching()) instead of computing them inside the function")
  host = host_plan(inputs["query_start_loc"], inputs["seq_lens"], inputs["block_table"], page_size)
  gen = next(_gen)
  _states[(routine, bucket, page_size)] = _State(gen, host, pending=True, ident=None)
  for w in _group(routine, bucket, page_size, scale):
    w.plan(host, gen)


def _version(t: torch.Tensor):
  try:
    return t._version
  except RuntimeError:  # inference tensors keep no version counter: never assume they are unchanged
    return None


def _ident(ts) -> tuple:
  return tuple((weakref.ref(t), _version(t)) for t in ts)


def _same(ident, ts) -> bool:
  return ident is not None and all(r() is t and v is not None and v == _version(t) for (r, v), t in zip(ident, ts))


def forward(out, q, k_cache, v_cache, query_start_loc, seq_lens, block_table, *, routine, scale, max_seq_len):
  """out, q: [B, Hq, D]; k_cache/v_cache: [P, page, Hkv, D]; metadata padded to B sequences."""
  del max_seq_len  # flashinfer sizes its grid in plan(), from the actual lengths
  B, page = q.shape[0], k_cache.shape[1]
  w = _wrapper(routine, q, k_cache, block_table, scale)
  key, ts = (routine, B, page), (query_start_loc, seq_lens, block_table)
  st = _states.get(key)
  capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
  fresh = st is not None and (st.pending or _same(st.ident, ts))
  if fresh and st.pending:
    st.pending, st.ident = False, _ident(ts)
  if fresh and w.valid(st.gen):
    pass
  elif capturing:
    # plan() copies host memory to the device, which a graph must not record. A graph captured on an older
    # plan is fine: replays run on the plan the hook makes before each of them.
    if w.gen is None:
      raise FgraphError("attention(backend='flashinfer'): capturing a CUDA graph with no plan for this batch",
                        "run one eager call first (fgraph.jit warms up before capturing), or call "
                        "A.plan_attention(...) before torch.cuda.graph")
  elif fresh:
    w.plan(st.host, st.gen)  # a wrapper created after the hook ran (first eager run of the signature)
  else:
    # Not planned for these inputs (called outside fgraph.jit, or the inputs changed): plan from the device.
    host = host_plan(query_start_loc, seq_lens, block_table, page)  # device -> host copies: a sync
    st = _states[key] = _State(next(_gen), host, pending=False, ident=_ident(ts))
    w.plan(host, st.gen)
  w.fi.run(q, (k_cache, v_cache), out=out)
