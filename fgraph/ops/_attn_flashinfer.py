"""The flashinfer attention backend (>= 0.6). CUDA only; any page size.

  decode  BatchDecodeWithPagedKVCacheWrapper(use_cuda_graph=True): one wrapper per (bucket, block-table width,
          head config), all over slices of persistent device buffers (indptr / indices / last-page lengths), so
          a captured graph reads its metadata from fixed addresses.
  mixed   BatchPrefillWithPagedKVCacheWrapper(backend="fa2", use_cuda_graph=True) over the same buffers (and the
          query offsets), one per (bucket, width, head config), where the metadata is padded to the bucket (one
          sequence slot per token: what fgraph.jit does); in graph mode flashinfer fixes the launch by the bucket
          (_PrefillModulePlan). Unpadded calls (outside fgraph.jit) get a plain wrapper per head config.
Both routines are capturable (Support.ALWAYS).

`plan()` (the host-side scheduling that fills those buffers) never runs inside a graph. fgraph's plan hook
calls `on_plan` with the call's host (CPU int32) metadata before every execution of a signature, so FULL
graphs replay on fresh plans without a device sync. Before a capture the hook makes the call
site's wrapper for the bucket from the traced shapes and dtypes of q and k_cache (PlanCall.avals, _config: the
same construction as the eager rule's from the tensors), so no graph capture makes one. Otherwise wrappers are
made by the first eager run of their signature, which plans them from the hook's metadata.

Decode plan cost (per step, host). The hook builds the host metadata with numpy (HostPlan), uploads it to the
shared device buffers once (one pinned non-blocking copy), then, per decode wrapper of the bucket and width:
  - skips flashinfer's plan when the host indptr equals the one the wrapper's last plan was made from (the
    schedule depends on nothing else; lengths +1 a step change it only when a sequence enters a new page);
  - else calls the wrapper's JIT module `plan` directly with an argument list recorded from one
    fast_decode_plan call (_ModulePlan): the C++ DecodePlan/PrefillPlan (cheap) plus FFI argument passing;
  - the first plan goes through flashinfer's plan(), the second through fast_decode_plan (recorded); where a
    flashinfer lacks fast_decode_plan or the recording cannot be matched, every plan keeps that API path.
Mixed graph wrappers do the same from the host query offsets and indptr: skipped when both are unchanged, else the
C++ PrefillPlan called directly after the first plan() (_PrefillModulePlan, checked against it once). Each direct
plan first waits for the last one's copy out of the wrapper's pinned buffer (_Fence).
The stock plan() costs far more host time per step, growing with the batch (docs/performance.md);
benchmarks/attention_bench.py (plan_step_us, plan_skip_us) measures both paths.

Freshness. All layers of one step share one plan. The eager rule treats the plan as current when the hook made
it for the execution in progress (`fgraph.ops.executing()`: fgraph sets a token around each execution
of a signature), or, for a direct call outside fgraph, when the plan was made by hand (A.plan_attention) and
not used yet, or when it gets the very tensors (same objects, same version counter) its plan was made or
first used for (the later layers of the step). Anything else, e.g. the model called directly outside fgraph.jit,
re-plans from the device tensors (a host sync, refused during capture). Without the token, a plan the hook
made for one jitted call would be taken as current by the next eager call of another model in the process:
wrong attention, or an illegal address when that model's page tables are smaller.
"""

from __future__ import annotations

import functools
import itertools
import weakref

import attrs
import torch

from fgraph.extend import FgraphError, executing
from fgraph.ops._flashinfer_buffers import HostPlan, _PlanBuffers, host_plan
from fgraph.ops._flashinfer_plans import (
    _Fence,
    _ModulePlan,
    _PrefillModulePlan,
    _Recorder,
    graph_prefill_workspace,
    plan_info,
)
from fgraph.ops._kv_write import write_kv

WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace (split-KV partial results)
_gen = itertools.count(1)


@functools.cache
def _fi():
    import flashinfer

    return flashinfer


# ------------------------------------------------------------------------------------------- wrappers
def _fast_decode_plan():
    """flashinfer.decode.fast_decode_plan, or None if absent.

    flashinfer.decode.fast_decode_plan (what vLLM and sglang replan CUDA-graph decode wrappers with): plan() minus
    the buffer copies (`upload` made them) and minus plan's O(batch) Python work. None if absent."""
    return getattr(getattr(_fi(), "decode", None), "fast_decode_plan", None)


@attrs.define(eq=False)
class _Wrapper:
    routine: str
    cfg: tuple  # (num_qo_heads, num_kv_heads, head_dim, page_size, q dtype, kv dtype, scale)
    fi: object  # the flashinfer wrapper
    bufs: _PlanBuffers | None = None  # CUDA-graph wrappers (decode; mixed over padded metadata): their buffers
    gen: int | None = None  # generation of its last plan
    planned: bytes | None = None  # graph wrappers: the host offsets their last plan was made from
    replay: object = None  # graph wrappers: the direct plan call (_ModulePlan, _PrefillModulePlan); False: the API
    info: tuple | None = None  # graph prefill wrappers: the plan info every plan must return (fixed in graph mode)
    fence: _Fence | None = None
    counts: dict = attrs.Factory(lambda: {"plan": 0, "fast": 0, "module": 0, "skip": 0})

    def valid(self, gen: int) -> bool:
        return self.gen == gen and (self.bufs is None or self.bufs.owner == gen)

    def plan(self, host: HostPlan, gen: int, in_graph: bool = False) -> None:
        if self.bufs is not None:
            self._plan_graphed(host, gen, in_graph)
        else:  # a prefill wrapper for unpadded metadata (outside fgraph.jit): never captured
            self.fi.plan(*self._api_args(host, host.t("indices")), causal=True, **self._api_kwargs())
            self.counts["plan"] += 1
        self.gen = gen

    def _api_args(self, host: HostPlan, indices) -> tuple:
        hq, hkv, d, page = self.cfg[:4]
        offsets = (host.t("qo_indptr"),) if self.routine == "mixed" else ()
        return (*offsets, host.t("indptr"), indices, host.t("last"), hq, hkv, d, page)

    def _api_kwargs(self) -> dict:
        return dict(q_data_type=self.cfg[4], kv_data_type=self.cfg[5], sm_scale=self.cfg[6])

    def _plan_graphed(self, host: HostPlan, gen: int, in_graph: bool = False) -> None:
        """Upload the metadata (once per generation), then re-plan only if the host offsets changed.

        Since this wrapper's last plan (its schedule depends on nothing else: see _ModulePlan; a mixed step's on
        the query offsets too): decode lengths grow by one a step, so the page counts, hence the indptr, change
        only when a sequence crosses into a new page (every page_size steps per sequence), or when the batch
        changes."""
        if in_graph:
            self.bufs.stage_for_graph(host, gen)
        else:
            self.bufs.upload(host, gen)
        # The switch off: tensor-core wrappers (their decode plans with the prefill scheduler) re-plan every step
        # through flashinfer's own entry points (a fallback kept for diagnosis; the skip / direct-module paths are
        # the default and tested against eager on the GPU).
        every_step = self.routine == "decode" and _tensor_cores(*self.cfg[:2]) and not TENSOR_CORE_PLAN_PATHS
        if every_step:
            self.replay = False
        key = host.indptr.tobytes()  # far cheaper than np.array_equal (docs/performance.md)
        if self.routine == "mixed":
            key += host.qo_indptr.tobytes()
        if key == self.planned and not every_step:
            self.counts["skip"] += 1
            return
        self.fence.before()
        if isinstance(self.replay, (_ModulePlan, _PrefillModulePlan)):
            self.replay(host)
            self.counts["module"] += 1
        elif self.routine == "decode":
            self._plan_decode_api(host)
        else:
            self._plan_mixed_api(host)
        self.fence.after()
        self.planned = key
        if self.routine == "mixed":
            self._check_info()

    def _plan_mixed_api(self, host: HostPlan) -> None:
        """flashinfer's plan() (its first plan sets the wrapper up), then its module call, checked, for the rest."""
        indices = self.bufs.indices[: host.indices.shape[0]]  # uploaded: plan()'s copy of them is a no-op
        self.fi.plan(*self._api_args(host, indices), causal=True, **self._api_kwargs())
        self.counts["plan"] += 1
        if self.replay is None:
            try:
                self.replay = _PrefillModulePlan(self.fi, host, self.cfg)
            except (LookupError, AttributeError, TypeError, RuntimeError):  # not the call we know: stay on plan()
                self.replay = False

    def _check_info(self) -> None:
        """A graph captured over this wrapper launched its kernels with the first plan's info: every plan must match.

        flashinfer fixes it in CUDA-graph mode (_PrefillModulePlan); a flashinfer that did not would be caught here,
        not computed wrong."""
        info = plan_info(self.fi._plan_info)
        if self.info is None:
            self.info = info
        elif info != self.info:
            raise FgraphError(
                f"attention(backend='flashinfer'): a mixed step's plan changed its kernel launch ({self.info} -> "
                f"{info}), which a captured CUDA graph cannot follow",
                "run mixed steps piecewise (mode='FULL_AND_PIECEWISE') or with another backend (backend='flash_attn')",
            )

    def _plan_decode_api(self, host: HostPlan) -> None:
        """Plan through flashinfer's own entry points.

        plan() the first time (it sets the wrapper up), fast_decode_plan after,
        whose module call the second plan records for _ModulePlan (kept on fast_decode_plan if that fails).
        `indices` is the uploaded page-id slice: it makes plan()'s own copy of them a no-op (same memory)."""
        args = self._api_args(host, self.bufs.indices[: host.indices.shape[0]])
        fast = _fast_decode_plan() if self.gen is not None else None
        if fast is None:
            self.fi.plan(*args, **self._api_kwargs())
            self.counts["plan"] += 1
            return
        inner = getattr(self.fi, "_cached_module", None)
        record = self.replay is None and inner is not None
        if inner is None:
            self.replay = False
        if record:
            self.fi._cached_module = rec = _Recorder(inner)
        try:
            fast(self.fi, *args, **self._api_kwargs())
        finally:
            if record:
                self.fi._cached_module = inner
        self.counts["fast"] += 1
        if record:
            try:
                self.replay = _ModulePlan(self.fi, rec.call, args[0], len(host.last)) if rec.call is not None else False
            except (LookupError, AttributeError):  # not the module call we know: stay on fast_decode_plan
                self.replay = False


@attrs.define
class _State:
    """Per (routine, bucket, page size, decode block-table width): the latest plan's host metadata and what for."""

    gen: int
    host: HostPlan
    token: object | None  # the execution the hook planned it for (fgraph.ops.executing())
    ident: tuple | None  # (weakref, version) of (query_start_loc, seq_lens, block_table) it was used with


TENSOR_CORE_PLAN_PATHS = True  # False: tensor-core decode wrappers re-plan through the API (see _Wrapper._plan_graphed)
_BY_HAND = object()  # the token of a plan made outside any fgraph execution (A.plan_attention)
_workspaces: dict[str, torch.Tensor] = {}
_plan_bufs: dict[str, _PlanBuffers] = {}
_wrappers: dict[tuple, _Wrapper] = {}  # (routine, bucket or None, device, cfg, width or None) -> wrapper
_groups: dict[tuple, list] = {}  # (routine, bucket or None, page_size, scale, width or None) -> its wrappers
_states: dict[tuple, _State] = {}  # (routine, bucket, page_size, width or None) -> state


def _tensor_cores(hq: int, hkv: int) -> bool:
    # The CUDA-core decode kernels cover GQA groups 1, 2, 4, 8 only; tensor cores win from 4 on anyway.
    return hq // hkv > 2


def _graphed(routine: str, batch: int, sequences: int) -> bool:
    """Whether a call gets a CUDA-graph wrapper: decode always; a mixed step when its metadata is padded to the
    bucket (one sequence slot per token, as fgraph pads it: attention's padding contract), which fixes the batch
    flashinfer's graph mode needs. Unpadded mixed calls (outside fgraph.jit) get a plain prefill wrapper."""
    return routine == "decode" or sequences == batch


def _workspace(device, need: int = 0) -> torch.Tensor:
    """The shared float workspace of a device, at least `need` bytes (a larger one replaces it for wrappers made
    from now on; older wrappers keep theirs)."""
    key = str(device)
    if key not in _workspaces or _workspaces[key].numel() < need:
        # must start zeroed
        _workspaces[key] = torch.zeros(max(WORKSPACE_BYTES, need), dtype=torch.uint8, device=device)
    return _workspaces[key]


def _buffers(batch: int, max_pages: int, device) -> _PlanBuffers:
    """Shared buffers large enough for `batch` rows.

    A larger bucket gets a new, larger set (fgraph captures largest first, so in practice one set serves every
    bucket)."""
    key, need = str(device), batch * max_pages
    b = _plan_bufs.get(key)
    if b is None or b.batch < batch or b.indices.numel() < need:
        b = _plan_bufs[key] = _PlanBuffers(batch, need, device)
    return b


def _config(q, k_cache, scale: float) -> tuple[str, tuple]:
    """(device, _Wrapper.cfg) of an attention call, from its tensors or their avals.

    Tensors for the eager rule, avals for the plan hook before a capture: one construction, so the hook makes the very
    wrapper the graph's capture will look up. q: [B, Hq, D]; k_cache: [P, page, Hkv, D]; each has .shape, .dtype and
    .device (a tensor's torch.device or an aval's str of one: both name the index, "cuda:0")."""
    _, hq, d = q.shape
    return str(q.device), (hq, k_cache.shape[2], d, k_cache.shape[1], q.dtype, k_cache.dtype, float(scale))


def _wrapper_for(routine: str, B: int, device: str, cfg: tuple, width: int, graphed: bool = True) -> _Wrapper:
    """The wrapper of this routine, bucket, device and configuration (_Wrapper.cfg), made on first use.

    CUDA-graph wrappers (`graphed`) are one per bucket and block-table width (their buffers hold bucket x width page
    ids; an engine with longer sequences gets its own, and graphs captured over the old buffers keep them); plain
    prefill wrappers one per configuration."""
    bucket, wide = _slot(graphed, B, width)
    key = (routine, bucket, device, cfg, wide)
    w = _wrappers.get(key)
    if w is None:
        fi, (hq, hkv) = _fi(), cfg[:2]
        if not graphed:
            w = _Wrapper(routine, cfg, fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(device), "NHD", backend="fa2"))
        else:
            bufs = _buffers(B, width, device)
            buffers = dict(
                paged_kv_indptr_buffer=bufs.indptr[: B + 1],
                paged_kv_indices_buffer=bufs.indices,
                paged_kv_last_page_len_buffer=bufs.last[:B],
            )
            if routine == "decode":
                inner = fi.BatchDecodeWithPagedKVCacheWrapper(
                    _workspace(device), "NHD", use_cuda_graph=True, use_tensor_cores=_tensor_cores(hq, hkv), **buffers
                )
            else:  # flashinfer's prefill wrapper spells its buffers *_buf
                inner = fi.BatchPrefillWithPagedKVCacheWrapper(
                    _workspace(device, graph_prefill_workspace(B, cfg, device)),
                    "NHD",
                    use_cuda_graph=True,
                    qo_indptr_buf=bufs.qo[: B + 1],
                    **{k.replace("_buffer", "_buf"): v for k, v in buffers.items()},
                    backend="fa2",
                )
            w = _Wrapper(routine, cfg, inner, bufs, fence=_Fence(device))
        _wrappers[key] = w
        _groups.setdefault(_group_key(routine, B, cfg[3], cfg[6], width, graphed), []).append(w)
    return w


def _graph_wrapper_of(avals, routine: str, bucket: int, scale: float, width: int) -> bool:
    """Before a capture: make this call site's CUDA-graph wrapper for the bucket from the avals.

    Of its q and k_cache (fgraph.PlanCall.avals), exactly the one its eager rule would make from the tensors, so the
    FULL graph is captured without an eager warm-up run of the whole model first (one per bucket, each as long as a
    model step: docs/performance.md), and only this model's wrappers are made (each holds flashinfer's pinned
    buffers). False where the avals do not tell (a hook called by hand; a head count or size not static in the
    trace): wrappers come from a warm-up."""
    q, k_cache = avals.get("q"), avals.get("k_cache")
    if q is None or k_cache is None:
        return False
    device, cfg = _config(q, k_cache, scale)
    if any(x is None for x in cfg[:4]):
        return False
    _wrapper_for(routine, bucket, device, cfg, width)
    return True


def _slot(graphed: bool, bucket: int, width: int) -> tuple:
    """(bucket, block-table width) in the keys of wrappers and groups: (None, None) for plain prefill wrappers."""
    return (bucket, width) if graphed else (None, None)


def _group_key(routine: str, bucket: int, page_size: int, scale: float, width: int, graphed: bool) -> tuple:
    return routine, *_slot(graphed, bucket, width), page_size, scale


def _group(routine: str, bucket: int, page_size: int, scale: float, width: int, graphed: bool) -> list:
    """The wrappers one plan serves: graph wrappers of this bucket and block-table width, or every plain prefill
    wrapper.

    Graph groups are keyed like the wrappers, by width too: a plan of a wider block table (another engine with a
    longer max_seq_len) must not plan the narrower wrappers, whose page buffers it overflows. A dict lookup:
    scanning every wrapper (one per bucket and config) costs host time every step (docs/performance.md)."""
    return _groups.get(_group_key(routine, bucket, page_size, scale, width, graphed), ())


def _state_key(routine: str, bucket: int, page_size: int, width: int, graphed: bool) -> tuple:
    # by width too: alternating engines each keep their own last plan (host_plan's `prev` reuse)
    return routine, bucket, page_size, _slot(graphed, bucket, width)[1]


def reset() -> None:
    """Forget every wrapper, plan and buffer (frees their memory). Drop graphs captured over them first."""
    for d in (_wrappers, _groups, _states, _plan_bufs, _workspaces):
        d.clear()


def stats() -> dict:
    """How each wrapper got its plans, summed.

    flashinfer's plan() ("plan"), its fast_decode_plan ("fast"), the direct module call ("module"), skipped as
    unchanged ("skip")."""
    out = {"plan": 0, "fast": 0, "module": 0, "skip": 0}
    for w in _wrappers.values():
        for k, v in w.counts.items():
            out[k] += v
    return out


# --------------------------------------------------------------------------------------------- plan, run
def on_plan(
    routine: str, bucket: int, page_size: int, scale: float, inputs, capturing: bool = False, avals=None
) -> bool:
    """fgraph's plan hook for this backend: host metadata -> plan every wrapper of the group this call uses.

    Before a capture with the call site's avals (fgraph.PlanCall.avals), it first makes the site's CUDA-graph wrapper
    for this bucket (_graph_wrapper_of) and returns True: this signature's capture then needs no eager warm-up."""
    missing = [k for k in ("query_start_loc", "seq_lens", "block_table") if k not in inputs]
    if missing:
        raise FgraphError(
            f"attention(backend='flashinfer'): the plan hook did not get {missing} as per-call inputs, "
            "so it cannot plan the kernels before a graph replays",
            "pass the AttentionMetadata leaves straight from the batch argument (declared Batched, "
            "e.g. A.metadata_batching()) instead of computing them inside the function",
        )
    sequences, width = inputs["block_table"].shape
    graphed = _graphed(routine, bucket, sequences)
    skey = _state_key(routine, bucket, page_size, width, graphed)
    prev = _states.get(skey)
    host = host_plan(
        inputs["query_start_loc"],
        inputs["seq_lens"],
        inputs["block_table"],
        page_size,
        with_qo=routine == "mixed",
        prev=prev.host if prev is not None else None,
    )
    gen = next(_gen)
    token = executing()
    _states[skey] = _State(gen, host, token=token or _BY_HAND, ident=None)
    in_graph = token is not None and token.in_graph  # a FULL graph that copies the metadata in itself
    made = capturing and graphed and bool(avals) and _graph_wrapper_of(avals, routine, bucket, scale, width)
    for w in _group(routine, bucket, page_size, scale, width, graphed):
        w.plan(host, gen, in_graph)
    return made


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: never assume they are unchanged
        return None


def _ident(ts) -> tuple:
    return tuple((weakref.ref(t), _version(t)) for t in ts)


def _same(ident, ts) -> bool:
    return ident is not None and all(r() is t and v is not None and v == _version(t) for (r, v), t in zip(ident, ts))


def forward(
    out, q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, *, routine, scale, max_seq_len
):
    """out, q: [B, Hq, D]; k/v: [B, Hkv, D]; k_cache/v_cache: [P, page, Hkv, D]; metadata padded to B sequences.

    Writes k/v into their slots, then out."""
    del max_seq_len  # flashinfer sizes its grid in plan(), from the actual lengths
    # not flashinfer's append_paged_kv_cache: that needs batch indices and positions per token (more device
    # metadata); _kv_write is one kernel for both caches from the slot_mapping we already have.
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    B, page = q.shape[0], k_cache.shape[1]
    graphed = _graphed(routine, B, block_table.shape[0])
    w = _wrapper_for(routine, B, *_config(q, k_cache, scale), block_table.shape[1], graphed)
    key = _state_key(routine, B, page, block_table.shape[1], graphed)
    ts = (query_start_loc, seq_lens, block_table)
    st = _states.get(key)
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing and not graphed:
        raise FgraphError(
            f"attention(backend='flashinfer'): capturing a mixed step of {B} tokens whose metadata holds "
            f"{block_table.shape[0]} sequences: flashinfer's CUDA-graph prefill needs one sequence slot per token",
            "declare the metadata Batched with A.metadata_batching() (fgraph pads it to the bucket), or pad it with "
            "A.pad_metadata(meta, bucket) before capturing by hand",
        )
    now = executing()
    fresh = st is not None and (st.token is (now or _BY_HAND) or _same(st.ident, ts))
    if fresh and st.token is _BY_HAND:  # a plan made by hand serves the next direct call (all its layers)
        st.token, st.ident = None, _ident(ts)
    if fresh and w.valid(st.gen):
        pass
    elif capturing:
        # plan() copies host memory to the device, which a graph must not record. A graph captured on an older
        # plan is fine: replays run on the plan the hook makes before each of them.
        if w.gen is None:
            raise FgraphError(
                "attention(backend='flashinfer'): capturing a CUDA graph with no plan for this batch",
                "run one eager call first (fgraph.jit warms up before capturing), or call "
                "A.plan_attention(...) before torch.cuda.graph",
            )
    elif fresh:
        w.plan(st.host, st.gen)  # a wrapper created after the hook ran (first eager run of the signature)
    else:
        # Not planned for these inputs (called outside fgraph.jit, or the inputs changed): plan from the device.
        host = host_plan(query_start_loc, seq_lens, block_table, page, with_qo=routine == "mixed")  # a sync
        st = _states[key] = _State(next(_gen), host, token=None, ident=_ident(ts))
        w.plan(host, st.gen)
    if w.bufs is not None and now is not None and now.in_graph and w.bufs.copied_for is not now:
        # first layer of a graph that copies its inputs in itself (P.Token): the metadata copy goes in the graph
        w.bufs.stage_for_graph(st.host, st.gen, capturing)  # a no-op when the hook staged this generation
        w.bufs.copy_in(B * block_table.shape[1])
        w.bufs.copied_for = now
    w.fi.run(q, (k_cache, v_cache), out=out)
