"""Paged attention on the CPU: the torch backend against a float64 reference, the padding contract, the KV
write, backend resolution, the break's trace and capture support, and the flashinfer backend's planning logic
(with a stand-in flashinfer whose kernels compute from the *plan*, so a stale plan gives wrong numbers).

Shapes are tiny (head dim 8, pages of 4 tokens) so every sequence spans several pages.
"""
import math
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fgraph
from fgraph import Support
from fgraph._primitives import support_rules
from fgraph.ops import _attn_flash, _attn_flashinfer as FI
from fgraph.ops import attention as A

NAN = float("nan")
PAGE, D = 4, 8
DECODE = ([1] * 5, [1, 4, 5, 9, 17])             # length 1, a full page, one past it, ...
MIXED = ([1, 3, 6, 1, 9], [1, 7, 6, 13, 16])       # a decode of length 1, a chunk, a whole prompt, ...
GQA = [(2, 2), (4, 2), (14, 2)]                    # group sizes 1, 2 and 7


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
      logits = torch.einsum("hd,lhd->hl", q[t].double(), K[:p + 1]) * scale
      w = torch.exp(logits - logits.max(-1, keepdim=True).values)
      out[t] = torch.einsum("hl,lhd->hd", w / w.sum(-1, keepdim=True), V[:p + 1])
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
    return reference(self.q, k, v, self.meta, D ** -0.5)

  def run(self, bucket, routine, backend="torch", scratch=None, meta=None):
    """Pad to `bucket` (padded q/k/v rows are random, finite), attend, return (out [bucket], k, v caches)."""
    meta = A.pad_metadata(self.meta, bucket) if meta is None else meta
    pad = lambda x: torch.cat([x, torch.randn(bucket - x.shape[0], *x.shape[1:], generator=self.g).to(x.dtype)])
    k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
    if scratch is not None:
      k_cache[0], v_cache[0] = scratch, scratch
    out = A.attention(pad(self.q), pad(self.k), pad(self.v), k_cache, v_cache, meta, backend=backend,
                      routine=routine)
    return out, k_cache, v_cache


def same(a, b):
  """Bitwise equal, NaN included."""
  torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------------ metadata
def test_build_metadata_layout():
  m = A.build_metadata([3, 1], [5, 9], [[1, 2], [3, 4, 5]], page_size=4, max_pages=4)
  assert m.query_start_loc.tolist() == [0, 3, 4] and m.query_start_loc.dtype == torch.int32
  assert m.seq_lens.tolist() == [5, 9] and m.seq_lens.dtype == torch.int32
  assert m.block_table.tolist() == [[1, 2, 0, 0], [3, 4, 5, 0]] and m.block_table.dtype == torch.int32
  # positions 2, 3, 4 of sequence 0 (page 1 slots 2-3, page 2 slot 0); position 8 of sequence 1 (page 5)
  assert m.slot_mapping.tolist() == [6, 7, 8, 20] and m.slot_mapping.dtype == torch.int64


@pytest.mark.parametrize("args, what", [
  (([2], [1], [[1]]), "1 <= query_len <= seq_len"),
  (([1], [9], [[1, 2]]), "needs 3 pages"),
  (([1, 1], [1], [[1]]), "give one of each"),
])
def test_build_metadata_rejects_bad_input(args, what):
  with pytest.raises(fgraph.FgraphError, match=what):
    A.build_metadata(*args, page_size=4, max_pages=4)


@pytest.mark.parametrize("bucket", [1, 7, 8, 64])
def test_all_padding_batch_obeys_the_contract(bucket):
  """What fgraph captures with: every leaf cut to its `extra` rows, then padded. It must be a valid batch."""
  real = A.build_metadata([1], [1], [[3]], PAGE, 8)
  cut = A.AttentionMetadata(real.query_start_loc[:1], real.seq_lens[:0], real.block_table[:0],
                            real.slot_mapping[:0])
  m = A.pad_metadata(cut, bucket)
  qsl, qlens = m.query_start_loc, m.query_start_loc.diff()
  assert qsl.shape == (bucket + 1,) and qsl[0] == 0 and qsl[-1] == bucket
  assert (qlens >= 0).all() and (qlens <= 1).all() and (qlens <= m.seq_lens).all()
  assert (m.seq_lens == 1).all() and (m.block_table == A.SCRATCH_PAGE).all() and (m.slot_mapping < PAGE).all()
  k_cache = torch.zeros(4, PAGE, 2, D)
  out = A.attention(torch.randn(bucket, 4, D), torch.randn(bucket, 2, D), torch.randn(bucket, 2, D), k_cache,
                    k_cache.clone(), m, routine="decode")
  assert torch.isfinite(out).all() and (k_cache[1:] == 0).all()  # only the scratch page was written


def test_padding_keeps_offsets_monotonic_and_ends_at_the_bucket():
  m = A.pad_metadata(A.build_metadata([3, 2], [3, 5], [[1], [2, 3]], PAGE, 8), 8)  # 5 tokens, 2 seqs -> 8
  assert m.query_start_loc.tolist() == [0, 3, 5, 6, 7, 8, 8, 8, 8]
  assert m.seq_lens.tolist() == [3, 5, 1, 1, 1, 1, 1, 1] and m.slot_mapping[5:].tolist() == [0, 0, 0]


def test_metadata_batching_is_what_pad_metadata_applies():
  spec = A.metadata_batching()
  assert all(isinstance(b, fgraph.Batched) for b in (spec.query_start_loc, spec.seq_lens, spec.block_table,
                                                    spec.slot_mapping))
  assert spec.query_start_loc.extra == 1 and spec.seq_lens.extra == 0
  m = A.build_metadata([3, 1], [5, 9], [[1, 2], [3, 4, 5]], PAGE, 4)
  ours = A.pad_metadata(m, 8)
  for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
    b = getattr(spec, name)
    assert torch.equal(b.padded(getattr(m, name), 8 + b.extra), getattr(ours, name)), name


# ------------------------------------------------------------------------------------------ torch backend
@pytest.mark.parametrize("hq, hkv", GQA)
@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED)])
def test_torch_backend_matches_reference(routine, lens, hq, hkv):
  case = Case(*lens, hq, hkv)
  out, _, _ = case.run(bucket=sum(lens[0]) + 3, routine=routine)
  torch.testing.assert_close(out[:sum(lens[0])], case.expected(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED)])
def test_padded_rows_never_touch_real_pages(routine, lens):
  """Real pages change only at the new tokens' slots; unused pages stay poisoned; the scratch page gets the
  padded tokens' k/v (slot 0) and nothing else."""
  case = Case(*lens, 4, 2)
  _, k_cache, v_cache = case.run(bucket=sum(lens[0]) + 5, routine=routine)
  want_k, want_v = case.written()
  same(k_cache[1:], want_k[1:])
  same(v_cache[1:], want_v[1:])
  assert k_cache[case.unused_pages].isnan().all()
  assert torch.isfinite(k_cache[0, 0]).all() and k_cache[0, 1:].isnan().all()


@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED)])
def test_real_outputs_ignore_the_scratch_page(routine, lens):
  case = Case(*lens, 14, 2)
  n = sum(lens[0])
  poisoned, _, _ = case.run(bucket=n + 2, routine=routine)
  huge, _, _ = case.run(bucket=n + 2, routine=routine, scratch=1e4)
  same(poisoned[:n], huge[:n])


def test_lengths_one_and_max_share_a_signature():
  """Same bucket and shapes, lengths 1 vs the block table's capacity: both right (nothing host-side differs)."""
  for n in (1, 8 * PAGE):
    case = Case([1, 1], [n, n], 4, 2, max_pages=8)
    out, _, _ = case.run(bucket=4, routine="decode")
    torch.testing.assert_close(out[:2], case.expected(), rtol=1e-10, atol=1e-10)


def test_bf16_within_tolerance():
  case = Case(*MIXED, 14, 2, dtype=torch.bfloat16)
  out, _, _ = case.run(bucket=24, routine="mixed")
  ref = case.expected()
  assert ((out[:20].double() - ref).norm() / ref.norm()) < 1e-2


def test_attention_rejects_mismatched_inputs():
  case = Case(*DECODE, 4, 2)
  two_seqs = A.build_metadata([2, 3], [2, 3], [[1], [2]], PAGE, 8)  # 5 tokens in 2 sequences
  with pytest.raises(fgraph.FgraphError, match="decode means one token per sequence"):
    A.attention(case.q, case.k, case.v, case.k_cache, case.v_cache, two_seqs, routine="decode")
  with pytest.raises(fgraph.FgraphError, match="multiple of 256"):
    case.run(bucket=5, routine="decode", backend="flash_attn")
  with pytest.raises(fgraph.FgraphError, match="does not fit q"):
    case.run(bucket=5, routine="decode", meta=A.pad_metadata(case.meta, 6))


# ------------------------------------------------------------------------------------------ backends
def test_resolve_backend_and_page_sizes():
  assert A.resolve_backend("auto", "cpu") == "torch" and A.resolve_backend("torch", "cpu") == "torch"
  for bad, what in (("cudnn", "unknown attention backend"), ("flash_attn", "needs a CUDA device")):
    with pytest.raises(fgraph.FgraphError, match=what):
      A.resolve_backend(bad, "cpu")
  assert [A.page_size_for(b) for b in A.BACKENDS] == [16, 256, 16]


def test_import_is_lazy():
  code = ("import sys, fgraph, fgraph.ops.attention as A; A.resolve_backend('auto', 'cpu'); "
          "assert not {'flash_attn', 'flashinfer'} & set(sys.modules), sorted(sys.modules)")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_capture_support_per_backend():
  rule = support_rules[A.attention_p.p]
  assert rule({"backend": "torch", "routine": "mixed"})[0] is Support.ALWAYS
  assert rule({"backend": "flash_attn", "routine": "mixed"})[0] is Support.ALWAYS
  assert rule({"backend": "flashinfer", "routine": "decode"}) == (Support.UNIFORM_DECODE,
                                                                  "flashinfer prefill is not capturable")


def test_flash_attn_split_count_depends_on_shapes_only():
  """decode_num_splits takes no lengths at all; spot-check it against flash-attn's heuristic behaviour."""
  assert _attn_flash.decode_num_splits(256, 8, 4, 128, 8192, 132) == 1          # enough work: no split
  small = _attn_flash.decode_num_splits(1, 2, 7, 64, 8192, 132)
  assert 1 < small <= 32  # one sequence, 2 kv heads: split the 32 key blocks to fill the SMs
  for b in (1, 8, 64, 256):
    assert 1 <= _attn_flash.decode_num_splits(b, 2, 7, 64, 1 << 17, 132) <= _attn_flash.MAX_SPLITS


def test_trace_is_kv_write_then_one_break():
  """Under fgraph's tracer the KV write is two index_copy_ (inside the piece) and attention one break node."""
  case = Case(*MIXED, 4, 2, dtype=torch.float32)
  meta = A.pad_metadata(case.meta, 24)
  pad = lambda x: torch.cat([x, x.new_zeros(24 - x.shape[0], *x.shape[1:])])

  def f(q, k, v, kc, vc, qsl, sl, bt, sm):
    return A.attention(q, k, v, kc, vc, A.AttentionMetadata(qsl, sl, bt, sm), routine="mixed", backend="torch")

  gm = make_fx(f, tracing_mode="fake")(pad(case.q), pad(case.k), pad(case.v), case.k_cache, case.v_cache,
                                       *(getattr(meta, n) for n in ("query_start_loc", "seq_lens", "block_table",
                                                                    "slot_mapping")))
  ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
  assert ops.count(torch.ops.aten.index_copy_.default) == 2
  assert ops.count(torch.ops.fgraph.attention.default) == 1
  node = next(n for n in gm.graph.nodes if n.target is torch.ops.fgraph.attention.default)
  assert node.args[7:] == ("torch", "mixed", D ** -0.5, 8 * PAGE, PAGE)


def toy_step(cache, batch, routine="mixed", backend="torch"):
  """Two attention layers over given q/k/v (layer i shifts k and v by i) -> ([N, layers, Hq, D], cache)."""
  outs = [A.attention(batch["q"], batch["k"] + i, batch["v"] - i, cache.k[i], cache.v[i], batch["meta"],
                      routine=routine, backend=backend) for i in range(len(cache.k))]
  return torch.stack(outs, 1), cache


def jit_toy(buckets=(4, 8, 16, 32)):
  spec = {"q": fgraph.Batched(), "k": fgraph.Batched(), "v": fgraph.Batched(), "meta": A.metadata_batching()}
  return fgraph.jit(toy_step, static=["routine", "backend"], donate=["cache"], batch={"batch": spec},
                    buckets=list(buckets))


def toy_inputs(case):
  cache = A.KVCache((case.k_cache.clone(), case.k_cache.clone()), (case.v_cache.clone(), case.v_cache.clone()))
  return cache, {"q": case.q, "k": case.k, "v": case.v, "meta": case.meta}


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED)])
def test_jit_matches_eager(routine, lens, backend, fake_flashinfer):
  """fgraph.jit (all-padding capture, padded replays, plan hook) against the unpadded eager call, twice."""
  step = jit_toy()
  for seed in (0, 1):
    case = Case(*lens, 4, 2, dtype=torch.float32, seed=seed)
    cache, batch = toy_inputs(case)
    if seed == 0:
      jcache = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
    else:  # the same cache tensors (graphs read state by address): refill them in place
      for d, s in zip(jcache.k + jcache.v, cache.k + cache.v):
        d.copy_(s)
    want, cache = toy_step(cache, batch, routine=routine, backend=backend)
    got, jcache = step(jcache, batch, routine=routine, backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jcache.k + jcache.v, cache.k + cache.v):
      same(a[1:], b[1:])
  stats = step.stats()["total"]
  assert stats["traces"] == 1 and stats["calls"] == 2
  if backend == "flashinfer":  # one plan per execution, from the hook: warm-up, then each call (the eager
    jitted = [b for _, b in fake_flashinfer.plans if b > 5]  # oracle plans its own 5 unpadded sequences)
    assert len(jitted) == 3


# ------------------------------------------------------------------------------------------ flashinfer logic
def test_flashinfer_host_plan_layout():
  m = A.pad_metadata(A.build_metadata([1, 1], [5, 4], [[7, 3], [2]], PAGE, 4), 4)
  h = FI.host_plan(m.query_start_loc, m.seq_lens, m.block_table, PAGE)
  assert h.indptr.tolist() == [0, 2, 3, 4, 5]                  # padded rows: one (scratch) page each
  assert h.indices.tolist() == [7, 3, 2, 0, 0]
  assert h.last.tolist() == [1, 4, 1, 1]                       # never 0 (flashinfer: 0 is a full page)
  assert h.qo_indptr.tolist() == [0, 1, 2, 3, 4]
  assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in (h.indptr, h.indices, h.last))


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
  flashinfer's, the fast replan of decode wrappers copies nothing: the buffers must already hold the plan."""

  def __init__(self):
    self.plans, self.fast = [], 0
    fake = self

    def kv_of(k_cache, v_cache, indptr, indices, last, b):
      pages = indices[indptr[b]:indptr[b + 1]].long()
      L = (len(pages) - 1) * k_cache.shape[1] + int(last[b])
      return (c[pages].reshape(-1, *c.shape[2:])[:L] for c in (k_cache, v_cache))

    class BatchDecodeWithPagedKVCacheWrapper:
      def __init__(self, ws, layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                   paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
        assert use_cuda_graph and layout == "NHD"
        self.indptr, self.indices, self.last = paged_kv_indptr_buffer, paged_kv_indices_buffer, \
            paged_kv_last_page_len_buffer

      def plan(self, indptr, indices, last, hq, hkv, d, page, q_data_type, kv_data_type, sm_scale):
        assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (indptr, last))  # no sync
        assert len(last) == len(self.last) and (last >= 1).all() and (indptr.diff() >= 0).all()
        self.indptr.copy_(indptr)
        self.last.copy_(last)
        self.indices[:len(indices)].copy_(indices)
        self.scale = sm_scale
        fake.plans.append(("decode", len(last)))

      def run(self, q, kv, out):
        for b in range(q.shape[0]):
          k, v = kv_of(*kv, self.indptr, self.indices, self.last, b)
          out[b] = _attend(q[b:b + 1], k, v, self.scale, k.shape[0])[0].to(out.dtype)

    class BatchPrefillWithPagedKVCacheWrapper:
      def __init__(self, ws, layout, backend):
        assert backend == "fa2"

      def plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, page, causal, sm_scale, q_data_type,
               kv_data_type):
        assert causal and all(t.device.type == "cpu" for t in (qo_indptr, indptr, indices, last))
        self.p = [t.clone() for t in (qo_indptr, indptr, indices, last)] + [sm_scale]
        fake.plans.append(("mixed", len(last)))

      def run(self, q, kv, out):
        qo, indptr, indices, last, scale = self.p
        assert q.shape[0] == qo[-1]
        for b in range(len(last)):
          k, v = kv_of(*kv, indptr, indices, last, b)
          rows = slice(int(qo[b]), int(qo[b + 1]))
          n = rows.stop - rows.start
          if n:
            out[rows] = _attend(q[rows], k, v, scale, k.shape[0] - n).to(out.dtype)

    def fast_decode_plan(wrapper, indptr, indices, last, hq, hkv, d, page, q_data_type, kv_data_type, sm_scale):
      """flashinfer's replan for CUDA-graph decode wrappers: it copies nothing into the buffers."""
      assert all(t.device.type == "cpu" and t.dtype == torch.int32 for t in (indptr, last))
      assert len(indices) <= len(wrapper.indices)
      wrapper.scale = sm_scale
      fake.plans.append(("decode", len(last)))
      fake.fast += 1

    self.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    self.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    self.decode = type("decode", (), {"fast_decode_plan": staticmethod(fast_decode_plan)})


@pytest.fixture
def fake_flashinfer(monkeypatch):
  fake = FakeFlashInfer()
  monkeypatch.setattr(FI, "_fi", lambda: fake)
  monkeypatch.setattr(FI, "WORKSPACE_BYTES", 64)
  for name in ("_workspaces", "_decode_bufs", "_wrappers", "_states"):
    monkeypatch.setattr(FI, name, {})
  return fake


def _layers(case, meta, routine, bucket, n_layers=3):
  """n_layers attention calls over the same metadata tensors (one model step); returns the last output."""
  pad = lambda x: torch.cat([x, x.new_zeros(bucket - x.shape[0], *x.shape[1:])])
  kc, vc = case.k_cache.clone(), case.v_cache.clone()
  for _ in range(n_layers):
    out = A.attention(pad(case.q), pad(case.k), pad(case.v), kc, vc, meta, backend="flashinfer", routine=routine)
  return out[:case.q.shape[0]]


@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED)])
def test_flashinfer_plans_once_per_step_from_the_hook(routine, lens, fake_flashinfer):
  bucket = sum(lens[0]) + 3
  for seed in (0, 1, 2):  # three steps with different lengths, same bucket
    case = Case(lens[0], [n + seed for n in lens[1]], 4, 2, dtype=torch.float32, seed=seed)
    meta = A.pad_metadata(case.meta, bucket)
    A.plan_attention(meta, backend="flashinfer", routine=routine, page_size=PAGE, scale=D ** -0.5)
    out = _layers(case, meta, routine, bucket)
    torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
    assert fake_flashinfer.plans == [(routine, bucket)] * (seed + 1)  # step 0: the new wrapper, by warm-up
  if routine == "decode":  # replans after the first take flashinfer's fast path over our uploaded buffers
    assert fake_flashinfer.fast == 2


def test_flashinfer_replans_when_called_outside_jit(fake_flashinfer):
  """No hook: plan from the device tensors on first use; re-plan for new tensors or in-place changes."""
  case = Case(*DECODE, 4, 2, dtype=torch.float32)
  meta = A.pad_metadata(case.meta, 8)
  out = _layers(case, meta, "decode", 8)
  assert len(fake_flashinfer.plans) == 1
  torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
  case2 = Case(DECODE[0], [n + 3 for n in DECODE[1]], 4, 2, dtype=torch.float32, seed=1)
  meta2 = A.pad_metadata(case2.meta, 8)  # new tensors
  torch.testing.assert_close(_layers(case2, meta2, "decode", 8).double(), case2.expected(), rtol=1e-5, atol=1e-5)
  assert len(fake_flashinfer.plans) == 2
  for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):  # same tensors, new values
    getattr(meta2, name).copy_(getattr(meta, name))
  torch.testing.assert_close(_layers(case, meta2, "decode", 8).double(), case.expected(), rtol=1e-5, atol=1e-5)
  assert len(fake_flashinfer.plans) == 3


def test_flashinfer_buckets_share_buffers_without_stale_plans(fake_flashinfer):
  """Decode wrappers of different buckets share the persistent buffers: the last plan owns them."""
  small, large = Case([1, 1], [3, 6], 4, 2, dtype=torch.float32), Case(*DECODE, 4, 2, dtype=torch.float32, seed=3)
  m_small, m_large = A.pad_metadata(small.meta, 2), A.pad_metadata(large.meta, 8)
  _layers(large, m_large, "decode", 8)
  _layers(small, m_small, "decode", 2)  # overwrites the shared buffers
  out = _layers(large, m_large, "decode", 8)  # same tensors as before, but their plan is gone: re-plan
  torch.testing.assert_close(out.double(), large.expected(), rtol=1e-5, atol=1e-5)
  assert [b for _, b in fake_flashinfer.plans] == [8, 2, 8]
