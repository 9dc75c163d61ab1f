"""The cases, fakes and fixtures shared by test_attention, test_attention_backends and test_attention_flashinfer."""

import contextlib
import math

import pytest
import torch

import fgraph
from fgraph.capture import _graphs as C
from fgraph.ops import _attn_flashinfer as FI
from fgraph.ops import attention as A

NAN = float("nan")


PAGE, D = 4, 8


DECODE = ([1] * 5, [1, 4, 5, 9, 17])  # length 1, a full page, one past it, ...


MIXED = ([1, 3, 6, 1, 9], [1, 7, 6, 13, 16])  # a decode of length 1, a chunk, a whole prompt, ...


GQA = [(2, 2), (4, 2), (14, 2)]  # group sizes 1, 2 and 7


# ------------------------------------------------------------------------------------------ the oracle
def reference(q, cache_k, cache_v, meta, scale):
    """float64, one sequence and one query token at a time, explicit softmax, causal to the token's position."""
    qsl, sl, bt = meta.query_start_loc.tolist(), meta.seq_lens.tolist(), meta.block_table.tolist()
    Hq, page, Hkv = q.shape[1], cache_k.shape[1], cache_k.shape[2]
    kf, vf = cache_k.reshape(-1, Hkv, q.shape[2]).double(), cache_v.reshape(-1, Hkv, q.shape[2]).double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(len(sl)):
        L, n = sl[s], qsl[s + 1] - qsl[s]
        slots = [bt[s][j // page] * page + j % page for j in range(L)]
        K = kf[slots].repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
        V = vf[slots].repeat_interleave(Hq // Hkv, dim=1)
        for i in range(n):
            t, p = qsl[s] + i, L - n + i  # the token and its position: the new tokens are the sequence's tail
            logits = torch.einsum("hd,lhd->hl", q[t].double(), K[: p + 1]) * scale
            w = torch.exp(logits - logits.max(-1, keepdim=True).values)
            out[t] = torch.einsum("hl,lhd->hd", w / w.sum(-1, keepdim=True), V[: p + 1])
    return out


class Case:
    """S sequences on random distinct pages (never page 0). Every cache slot starts poisoned with NaN except
    the KV history (positions before each sequence's new tokens), so any stray read or write shows."""

    def __init__(self, qlens, seqlens, hq, hkv, dtype=torch.float64, num_pages=48, max_pages=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
        tables = [[free.pop() for _ in range(-(-n // PAGE))] for n in seqlens]
        self.unused_pages = free
        self.meta = A.build_metadata(qlens, seqlens, tables, PAGE, max_pages)
        self.k_cache = torch.full((num_pages, PAGE, hkv, D), NAN, dtype=dtype)
        self.v_cache = self.k_cache.clone()
        for table, q, n in zip(tables, qlens, seqlens):
            for pos in range(n - q):
                self.k_cache[table[pos // PAGE], pos % PAGE] = torch.randn(hkv, D, generator=g).to(dtype)
                self.v_cache[table[pos // PAGE], pos % PAGE] = torch.randn(hkv, D, generator=g).to(dtype)
        N = sum(qlens)
        self.q = torch.randn(N, hq, D, generator=g).to(dtype)
        self.k = torch.randn(N, hkv, D, generator=g).to(dtype)
        self.v = torch.randn(N, hkv, D, generator=g).to(dtype)
        self.g = g

    def written(self):
        """The caches as they must be after the KV write of the real tokens."""
        k, v = self.k_cache.clone(), self.v_cache.clone()
        hkv = k.shape[2]
        k.view(-1, hkv, D)[self.meta.slot_mapping] = self.k
        v.view(-1, hkv, D)[self.meta.slot_mapping] = self.v
        return k, v

    def expected(self):
        k, v = self.written()
        return reference(self.q, k, v, self.meta, D**-0.5)

    def run(self, bucket, routine, backend="torch", scratch=None, meta=None):
        """Pad to `bucket` (padded q/k/v rows are random, finite), attend, return (out [bucket], k, v caches)."""
        meta = A.pad_metadata(self.meta, bucket) if meta is None else meta
        pad = lambda x: torch.cat([x, torch.randn(bucket - x.shape[0], *x.shape[1:], generator=self.g).to(x.dtype)])
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        if scratch is not None:
            k_cache[0], v_cache[0] = scratch, scratch
        out = A.attention(
            pad(self.q), pad(self.k), pad(self.v), k_cache, v_cache, meta, backend=backend, routine=routine
        )
        return out, k_cache, v_cache


def same(a, b):
    """Bitwise equal, NaN included."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


class FakeFlashAttnExtension:
    """flash_attn_2_cuda's two entry points as the flash_attn backend calls them, on the CPU, with the output
    contract read from flash-attn's source (flash_api.cpp): fwd_kvcache writes k/v at position cache_seqlens[b]
    through the block table, then attends over cache_seqlens[b] + 1 keys; with GQA and one query per sequence it
    folds the group into the query length, checks `out` as [B, G, Hkv, D] (head hkv * G + g at [b, g, hkv]) and
    returns it unfolded; varlen_fwd at max_seqlen_q == 1 with GQA computes in a temporary it returns, leaving
    `out` alone (the case the backend must copy)."""

    def __init__(self):
        self.copies_needed = 0

    def fwd_kvcache(
        self,
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        cos,
        sin,
        batch_idx,
        leftpad,
        block_table,
        alibi,
        out,
        scale,
        causal,
        wl,
        wr,
        softcap,
        interleaved,
        num_splits,
    ):
        assert causal and (wl, wr) == (-1, -1) and cos is None and num_splits >= 1 and out is not None
        B, _, Hq, D = q.shape
        Hkv, page = k_cache.shape[2], k_cache.shape[1]
        G = Hq // Hkv
        pos = cache_seqlens.long()
        slots = block_table[torch.arange(B), pos // page].long() * page + pos % page
        k_cache.view(-1, Hkv, D)[slots], v_cache.view(-1, Hkv, D)[slots] = k[:, 0], v[:, 0]
        meta = A.AttentionMetadata(torch.arange(B + 1, dtype=torch.int32), cache_seqlens + 1, block_table, slots)
        res = reference(q[:, 0], k_cache, v_cache, meta, scale).to(q.dtype)  # [B, Hq, D]
        if G > 1:
            assert out.shape == (B, G, Hkv, D), out.shape
            out.copy_(res.view(B, Hkv, G, D).transpose(1, 2))  # through out's own strides, as the kernel writes
            return out.transpose(1, 2).reshape(B, 1, Hq, D), None
        assert out.shape == (B, 1, Hq, D)
        out.copy_(res[:, None])
        return out, None

    def varlen_fwd(
        self,
        q,
        k_cache,
        v_cache,
        out,
        cu_q,
        cu_k,
        seqused_k,
        leftpad,
        block_table,
        alibi,
        max_q,
        max_k,
        dropout,
        scale,
        zero,
        causal,
        wl,
        wr,
        softcap,
        return_softmax,
        gen,
    ):
        assert causal and dropout == 0.0 and seqused_k is None and out.shape == q.shape
        meta = A.AttentionMetadata(cu_q, cu_k.diff(), block_table, None)
        res = reference(q, k_cache, v_cache, meta, scale).to(q.dtype)
        if max_q == 1 and q.shape[1] > k_cache.shape[2]:
            self.copies_needed += 1
            return res, None
        out.copy_(res)
        return out, None


def refill(jcache, cache):
    """Graphs read state by address: the captured cache tensors get each step's contents in place."""
    for d, src in zip(jcache.k + jcache.v, cache.k + cache.v):
        d.copy_(src)


def toy_step(cache, batch, routine="mixed", backend="torch"):
    """Two attention layers over given q/k/v (layer i shifts k and v by i) -> ([N, layers, Hq, D], cache)."""
    outs = [
        A.attention(
            batch["q"],
            batch["k"] + i,
            batch["v"] - i,
            cache.k[i],
            cache.v[i],
            batch["meta"],
            routine=routine,
            backend=backend,
        )
        for i in range(len(cache.k))
    ]
    return torch.stack(outs, 1), cache


# the toy step's batch: q, k, v and the attention metadata, each padded to the bucket
TOY_BATCH = {"q": fgraph.Batched(), "k": fgraph.Batched(), "v": fgraph.Batched(), "meta": A.metadata_batching()}


def jit_toy(buckets=(4, 8, 16, 32)):
    return fgraph.jit(
        toy_step, static=["routine", "backend"], donate=["cache"], batch={"batch": TOY_BATCH}, buckets=list(buckets)
    )


def toy_inputs(case):
    cache = A.KVCache((case.k_cache.clone(), case.k_cache.clone()), (case.v_cache.clone(), case.v_cache.clone()))
    return cache, {"q": case.q, "k": case.k, "v": case.v, "meta": case.meta}


def decode_wrapper_births(fake, monkeypatch) -> list:
    """Records, per flashinfer decode wrapper made from now on, (made by the plan hook, made inside a graph capture)."""
    births, inside = [], {"hook": False, "graph": False}

    def during(where, fn):
        def run(*args, **kwargs):
            inside[where] = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[where] = False

        return run

    monkeypatch.setattr(FI, "on_plan", during("hook", FI.on_plan))
    monkeypatch.setattr(C.HostGraph, "capture", during("graph", C.HostGraph.capture))  # the CPU's CUDA graph
    cls = fake.BatchDecodeWithPagedKVCacheWrapper
    init = cls.__init__

    def recording_init(self, *args, **kwargs):
        births.append((inside["hook"], inside["graph"]))
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", recording_init)
    return births


def decode_wrapper_keys(dtype, buckets, width=8) -> set:
    """FI._wrappers keys of the toy models' decode wrappers (4 query heads, 2 kv heads) of these buckets."""
    return {("decode", b, "cpu", (4, 2, D, PAGE, dtype, dtype, D**-0.5), width) for b in buckets}


CACHE_WRITES = {"index_copy", "index_copy_", "index_put", "index_put_", "copy_", "scatter", "scatter_"}


def _attend(q, k, v, scale, causal_offset):
    """q [n, Hq, D] over k/v [L, Hkv, D]; query i sees keys <= causal_offset + i."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,lhd->hql", q.double(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] > causal_offset + torch.arange(q.shape[0])[:, None]
    return torch.einsum("hql,lhd->qhd", s.masked_fill(mask, -math.inf).softmax(-1), v)


class FakeFlashInfer:
    """Stands in for flashinfer on the CPU. Its kernels read only what plan() stored (the decode wrapper: the
    caller's persistent buffers, as in CUDA-graph mode), so attention from a stale plan comes out wrong. Like
    flashinfer's, the fast replan of decode wrappers copies nothing: the buffers must already hold the plan.

    Decode plans go through a JIT-module-like `_cached_module.plan(...)` with flashinfer's argument lists (the
    CUDA-core one, or the tensor-core one with the host kv lengths), whose result (`_plan_info`) is the schedule:
    here the host indptr it was made from. run() refuses a schedule that does not match the device buffers, as
    the real kernels would silently compute garbage on one."""

    def __init__(self):
        self.plans, self.fast, self.module = [], 0, 0
        fake = self

        def kv_of(k_cache, v_cache, indptr, indices, last, b):
            pages = indices[indptr[b] : indptr[b + 1]].long()
            L = (len(pages) - 1) * k_cache.shape[1] + int(last[b])
            return (c[pages].reshape(-1, *c.shape[2:])[:L] for c in (k_cache, v_cache))

        def module_plan(*args):
            """The C++ plan: the host indptr (CUDA cores: argument 3; tensor cores: 4, then the kv lengths)."""
            tc = isinstance(args[4], torch.Tensor)
            indptr = args[4] if tc else args[3]
            assert indptr.device.type == "cpu" and indptr.dtype == torch.int32 and (indptr.diff() >= 0).all()
            if tc:
                lens, page = args[5], args[10]
                assert lens.shape == (len(indptr) - 1,) and torch.equal((lens + page - 1) // page, indptr.diff()), (
                    lens,
                    indptr,
                )
            fake.module += 1
            return indptr.clone()

        class BatchDecodeWithPagedKVCacheWrapper:
            def __init__(
                self,
                ws,
                layout,
                use_cuda_graph,
                use_tensor_cores,
                paged_kv_indptr_buffer,
                paged_kv_indices_buffer,
                paged_kv_last_page_len_buffer,
            ):
                assert use_cuda_graph and layout == "NHD"
                self.indptr, self.indices, self.last = (
                    paged_kv_indptr_buffer,
                    paged_kv_indices_buffer,
                    paged_kv_last_page_len_buffer,
                )
                self.use_tensor_cores, self.ws, self.device = use_tensor_cores, ws, ws.device

            def plan(self, indptr, indices, last, hq, hkv, d, page, q_data_type, kv_data_type, sm_scale):
                assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (indptr, last))  # no sync
                assert len(last) == len(self.last) and (last >= 1).all() and (indptr.diff() >= 0).all()
                self.indptr.copy_(indptr)
                self.last.copy_(last)
                self.indices[: len(indices)].copy_(indices)
                self._cached_module = type("module", (), {"plan": staticmethod(module_plan)})()
                fast_decode_plan(
                    self, indptr, indices, last, hq, hkv, d, page, q_data_type, kv_data_type, sm_scale, count=False
                )
                fake.plans.append(("decode", len(last)))

            def run(self, q, kv, out):
                assert torch.equal(self._plan_info, self.indptr), "stale plan: its schedule is not the buffers' indptr"
                for b in range(q.shape[0]):
                    k, v = kv_of(*kv, self.indptr, self.indices, self.last, b)
                    out[b] = _attend(q[b : b + 1], k, v, self.scale, k.shape[0])[0].to(out.dtype)

        def prefill_schedule(iws, qo, indptr, lens, rows, batch, page):
            """The C++ PrefillPlan in CUDA-graph mode: the schedule (here the host offsets) goes to the int
            workspace, the info it returns is fixed by the rows and the batch."""
            assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (qo, indptr, lens))
            assert len(qo) == batch + 1 and int(qo[-1]) <= rows and (qo.diff() >= 0).all()
            assert torch.equal((lens + page - 1) // page, indptr.diff()), (lens, indptr)
            iws.copy_(torch.cat([qo, indptr]))
            return (rows, batch, 16)

        def prefill_module_plan(fws, iws, pinned, qo, indptr, lens, rows, batch, hq, hkv, page, graph, *rest):
            assert graph and rest[2:] == (True, -1, -1, False, 0), rest  # causal, no window, split settings
            fake.module += 1
            return prefill_schedule(iws, qo, indptr, lens, rows, batch, page)

        class BatchPrefillWithPagedKVCacheWrapper:
            def __init__(
                self,
                ws,
                layout,
                use_cuda_graph=False,
                qo_indptr_buf=None,
                paged_kv_indptr_buf=None,
                paged_kv_indices_buf=None,
                paged_kv_last_page_len_buf=None,
                backend="auto",
            ):
                assert backend == "fa2" and layout == "NHD"
                self.is_cuda_graph_enabled, self._backend, self._window_left = use_cuda_graph, backend, -1
                self._float_workspace_buffer = self._pin_memory_int_workspace_buffer = ws
                self._max_total_num_rows, self.device = None, ws.device
                if use_cuda_graph:  # flashinfer's checks of the buffers
                    B = len(qo_indptr_buf) - 1
                    assert len(paged_kv_indptr_buf) == B + 1 and len(paged_kv_last_page_len_buf) == B
                    self.qo, self.indptr, self.indices, self.last = (
                        qo_indptr_buf,
                        paged_kv_indptr_buf,
                        paged_kv_indices_buf,
                        paged_kv_last_page_len_buf,
                    )
                    self._int_workspace_buffer = torch.zeros(2 * B + 2, dtype=torch.int32)

            def plan(
                self, qo_indptr, indptr, indices, last, hq, hkv, d, page, causal, sm_scale, q_data_type, kv_data_type
            ):
                assert causal and all(t.device.type == "cpu" for t in (qo_indptr, indptr, last))
                fake.plans.append(("mixed", len(last)))
                self.scale = sm_scale
                if not self.is_cuda_graph_enabled:
                    self.p = [t.clone() for t in (qo_indptr, indptr, indices, last)]
                    return
                rows = int(qo_indptr[-1])  # graph mode: the first plan fixes the rows, and the batch is fixed
                self._max_total_num_rows = self._max_total_num_rows or rows
                assert len(last) == len(self.last) and len(indices) <= len(self.indices)
                self.qo.copy_(qo_indptr)
                self.indptr.copy_(indptr)
                self.last.copy_(last)
                self.indices[: len(indices)].copy_(indices)
                self._cached_module = type("module", (), {"plan": staticmethod(prefill_module_plan)})()
                lens = (indptr.diff() - 1) * page + last
                self._plan_info = prefill_schedule(
                    self._int_workspace_buffer, qo_indptr, indptr, lens, self._max_total_num_rows, len(last), page
                )

            def run(self, q, kv, out):
                scale = self.scale
                if self.is_cuda_graph_enabled:  # graph mode: the schedule from the int workspace, the rest buffers
                    qo, indptr, indices, last, B = self.qo, self.indptr, self.indices, self.last, len(self.last)
                    assert torch.equal(self._int_workspace_buffer, torch.cat([qo, indptr])), (
                        "stale plan: its schedule is not the buffers' offsets"
                    )
                    assert self._plan_info == (self._max_total_num_rows, B, 16)
                else:
                    qo, indptr, indices, last = self.p
                assert q.shape[0] == qo[-1]
                for b in range(len(last)):
                    k, v = kv_of(*kv, indptr, indices, last, b)
                    rows = slice(int(qo[b]), int(qo[b + 1]))
                    n = rows.stop - rows.start
                    if n:
                        out[rows] = _attend(q[rows], k, v, scale, k.shape[0] - n).to(out.dtype)

        def fast_decode_plan(
            wrapper, indptr, indices, last, hq, hkv, d, page, q_data_type, kv_data_type, sm_scale, count=True
        ):
            """flashinfer's replan for CUDA-graph decode wrappers: it copies nothing into the buffers; it makes
            the module's plan call with flashinfer's argument lists."""
            assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (indptr, last))
            assert len(indices) <= len(wrapper.indices)
            B, ws = len(last), wrapper.ws
            if wrapper.use_tensor_cores:
                lens = (indptr[1:] - indptr[:-1] - 1) * page + last  # get_seq_lens
                args = (
                    ws,
                    ws,
                    ws,
                    torch.arange(B + 1, dtype=torch.int32),
                    indptr.cpu(),
                    lens,
                    B,
                    B,
                    hq,
                    hkv,
                    page,
                    True,
                    d,
                    d,
                    False,
                    -1,
                    -1,
                    False,
                    0,
                )
            else:
                args = (ws, ws, ws, indptr.cpu(), B, hq, hkv, page, True, -1, 0.0, d, d, torch.empty(0), torch.empty(0))
            wrapper._plan_info = wrapper._cached_module.plan(*args)
            wrapper.scale = sm_scale
            if count:
                fake.plans.append(("decode", len(last)))
                fake.fast += 1

        self.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
        self.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
        self.decode = type("decode", (), {"fast_decode_plan": staticmethod(fast_decode_plan)})


@contextlib.contextmanager
def flashinfer_stand_in():
    """The stand-in flashinfer, with fresh wrappers, plans and buffers, until the block ends (property tests, whose
    examples each need their own, use it directly)."""
    with pytest.MonkeyPatch.context() as mp:
        fake = FakeFlashInfer()
        mp.setattr(FI, "_fi", lambda: fake)
        mp.setitem(A.TAKES, "flashinfer", (None, None))  # the stand-in computes in any dtype (float64 here)
        mp.setattr(FI, "WORKSPACE_BYTES", 64)
        for name in ("_workspaces", "_plan_bufs", "_wrappers", "_groups", "_states"):
            mp.setattr(FI, name, {})
        yield fake


@pytest.fixture
def fake_flashinfer():
    with flashinfer_stand_in() as fake:
        yield fake


def _layers(case, meta, routine, bucket, n_layers=3):
    """n_layers attention calls over the same metadata tensors (one model step); returns the last output."""
    pad = lambda x: torch.cat([x, x.new_zeros(bucket - x.shape[0], *x.shape[1:])])
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    for _ in range(n_layers):
        out = A.attention(pad(case.q), pad(case.k), pad(case.v), kc, vc, meta, backend="flashinfer", routine=routine)
    return out[: case.q.shape[0]]


def plans_made(bucket=None, routine="decode") -> int:
    """Plans a routine's wrappers (of one bucket, or all) got, whichever way: plan(), fast, module, or skipped."""
    return sum(
        sum(w.counts.values()) for key, w in FI._wrappers.items() if key[0] == routine and bucket in (None, key[1])
    )
