"""Paged attention on the CPU: the torch backend against a float64 reference, the padding contract, the KV
write, backend resolution, the break's trace and capture support, and the flashinfer backend's planning logic
(with a stand-in flashinfer whose kernels compute from the *plan*, so a stale plan gives wrong numbers).

Shapes are tiny (head dim 8, pages of 4 tokens) so every sequence spans several pages.
"""

import contextlib
import math
import re
import subprocess
import sys

import attrs
import numpy as np
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fgraph
from fgraph import Support, _fx
from fgraph._primitives import support_rules
from fgraph.capture import _graphs as C
from fgraph.ops import _attn_flash, _backends
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


# ------------------------------------------------------------------------------------------ metadata
def test_build_metadata_layout():
    m = A.build_metadata([3, 1], [5, 9], [[1, 2], [3, 4, 5]], page_size=4, max_pages=4)
    assert m.query_start_loc.tolist() == [0, 3, 4] and m.query_start_loc.dtype == torch.int32
    assert m.seq_lens.tolist() == [5, 9] and m.seq_lens.dtype == torch.int32
    assert m.block_table.tolist() == [[1, 2, 0, 0], [3, 4, 5, 0]] and m.block_table.dtype == torch.int32
    # positions 2, 3, 4 of sequence 0 (page 1 slots 2-3, page 2 slot 0); position 8 of sequence 1 (page 5)
    assert m.slot_mapping.tolist() == [6, 7, 8, 20] and m.slot_mapping.dtype == torch.int64


def test_build_metadata_equals_the_per_sequence_definition():
    """Random chunks and decodes: every new token's slot is page block_table[s][pos // page] at pos % page, for the
    last query_len positions of its sequence; rows of the block table are the given pages, then zeros."""
    g = torch.Generator().manual_seed(0)
    S, page, max_pages = 9, 4, 6
    seq = torch.randint(1, page * max_pages + 1, (S,), generator=g).tolist()
    q = [int(torch.randint(1, n + 1, (), generator=g)) for n in seq]
    tables = [torch.randperm(40, generator=g)[: -(-n // page) + k % 2].tolist() for k, n in enumerate(seq)]
    tables = [t[:max_pages] for t in tables]
    m = A.build_metadata(q, seq, tables, page, max_pages)
    slots = [tables[s][p // page] * page + p % page for s in range(S) for p in range(seq[s] - q[s], seq[s])]
    assert m.slot_mapping.tolist() == slots
    assert m.block_table.tolist() == [t + [0] * (max_pages - len(t)) for t in tables]
    assert m.query_start_loc.tolist() == [sum(q[:s]) for s in range(S + 1)] and m.seq_lens.tolist() == seq


@pytest.mark.parametrize(
    "args, what",
    [
        (([2], [1], [[1]]), "1 <= query_len <= seq_len"),
        (([1], [9], [[1, 2]]), "needs 3 pages"),
        (([1, 1], [1], [[1]]), "give one of each"),
    ],
)
def test_build_metadata_rejects_bad_input(args, what):
    with pytest.raises(fgraph.FgraphError, match=what):
        A.build_metadata(*args, page_size=4, max_pages=4)


@pytest.mark.parametrize("bucket", [1, 7, 8, 64])
def test_all_padding_batch_obeys_the_contract(bucket):
    """What fgraph captures with: every leaf cut to its `extra` rows, then padded. It must be a valid batch."""
    real = A.build_metadata([1], [1], [[3]], PAGE, 8)
    cut = A.AttentionMetadata(real.query_start_loc[:1], real.seq_lens[:0], real.block_table[:0], real.slot_mapping[:0])
    m = A.pad_metadata(cut, bucket)
    qsl, qlens = m.query_start_loc, m.query_start_loc.diff()
    assert qsl.shape == (bucket + 1,) and qsl[0] == 0 and qsl[-1] == bucket
    assert (qlens >= 0).all() and (qlens <= 1).all() and (qlens <= m.seq_lens).all()
    assert (m.seq_lens == 1).all() and (m.block_table == A.SCRATCH_PAGE).all() and (m.slot_mapping < PAGE).all()
    k_cache = torch.zeros(4, PAGE, 2, D)
    out = A.attention(
        torch.randn(bucket, 4, D),
        torch.randn(bucket, 2, D),
        torch.randn(bucket, 2, D),
        k_cache,
        k_cache.clone(),
        m,
        routine="decode",
    )
    assert torch.isfinite(out).all() and (k_cache[1:] == 0).all()  # only the scratch page was written


def test_padding_keeps_offsets_monotonic_and_ends_at_the_bucket():
    m = A.pad_metadata(A.build_metadata([3, 2], [3, 5], [[1], [2, 3]], PAGE, 8), 8)  # 5 tokens, 2 seqs -> 8
    assert m.query_start_loc.tolist() == [0, 3, 5, 6, 7, 8, 8, 8, 8]
    assert m.seq_lens.tolist() == [3, 5, 1, 1, 1, 1, 1, 1] and m.slot_mapping[5:].tolist() == [0, 0, 0]


def test_metadata_batching_is_what_pad_metadata_applies():
    spec = A.metadata_batching()
    assert all(
        isinstance(b, fgraph.Batched)
        for b in (spec.query_start_loc, spec.seq_lens, spec.block_table, spec.slot_mapping)
    )
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
    torch.testing.assert_close(out[: sum(lens[0])], case.expected(), rtol=1e-10, atol=1e-10)


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
    for bad, what in (
        ("cudnn", "unknown attention backend"),
        ("flash_attn", "needs a CUDA device"),
        ("triton", "needs a CUDA device"),
    ):
        with pytest.raises(fgraph.FgraphError, match=what):
            A.resolve_backend(bad, "cpu")
    assert [A.page_size_for(b) for b in A.BACKENDS] == [16, 256, 16, 16]


def test_a_pair_names_each_routines_backend_and_shares_one_page_size():
    assert A.backend_pair("triton") == ("triton", "triton")
    assert A.backend_pair("triton/flash_attn") == ("triton", "flash_attn")
    assert [A.backend_for("triton/flash_attn", r) for r in A.ROUTINES] == ["triton", "flash_attn"]
    assert A.page_size_for("triton/flash_attn") == A.page_size_for("flash_attn/torch") == 256
    assert A.page_size_for("triton/flashinfer") == 16
    assert A.resolve_backend("torch/torch", "cpu") == "torch/torch"
    for bad in ("triton/", "triton/cudnn", "a/b/c"):
        with pytest.raises(fgraph.FgraphError, match="DECODE/MIXED"):
            A.backend_pair(bad)
    with pytest.raises(fgraph.FgraphError, match="the triton backend needs a CUDA device"):
        A.resolve_backend("triton/torch", "cpu")
    with pytest.raises(fgraph.FgraphError, match="resolve it first"):
        A.page_size_for("auto")


@pytest.mark.parametrize(
    "missing, head_dim, want",
    [
        ((), 64, "triton/flash_attn"),  # every package: triton's decode, FA2's capturable mixed
        ((), None, "triton/flash_attn"),  # no head dim given: the cache's page size is the pair's either way
        (("triton",), 64, "flashinfer/flash_attn"),
        (("flash_attn",), 64, "triton/flashinfer"),
        (("flash_attn", "flashinfer"), 128, "triton"),
        ((), 80, "flashinfer/flash_attn"),  # a head dim triton's kernels cannot tile
        (("flash_attn", "flashinfer", "triton"), 64, "torch"),
    ],
)
def test_auto_on_cuda_picks_the_fastest_importable_backend_per_routine(missing, head_dim, want, monkeypatch):
    monkeypatch.setattr(_backends, "_importable", lambda b: "absent" if b in missing else None)
    assert A.resolve_backend("auto", "cuda", head_dim) == want


@pytest.mark.parametrize(
    "head_dim, dtype, want",
    [
        (64, torch.bfloat16, "triton/flash_attn"),
        (64, torch.float32, "triton"),  # FA2 and FlashInfer take half precision only: triton's mixed kernel
        (80, torch.float32, "torch"),  # nor does triton tile 80
        (80, torch.float16, "flashinfer/flash_attn"),
        (264, torch.bfloat16, "flashinfer"),  # past FA2's 256
    ],
)
def test_auto_picks_only_backends_whose_kernels_take_the_dtype_and_head_dim(head_dim, dtype, want, monkeypatch):
    """What the engine asks for (its config's head dim and the weights' dtype): a float32 model on CUDA must not meet
    FA2's own error at its first mixed step."""
    monkeypatch.setattr(_backends, "_importable", lambda b: None)
    assert A.resolve_backend("auto", "cuda", head_dim, dtype) == want


@pytest.mark.parametrize(
    "backend, routine, dtype, head_dim, says",
    [
        (
            "flash_attn",
            "mixed",
            torch.float32,
            64,
            "the flash_attn backend needs q in float16 or bfloat16, got torch.float32",
        ),
        ("triton/flash_attn", "mixed", torch.float32, 64, "the flash_attn backend needs q in float16 or bfloat16"),
        ("flashinfer", "decode", torch.float64, 64, "the flashinfer backend needs q in float16 or bfloat16"),
        ("flash_attn", "decode", torch.bfloat16, 12, "the flash_attn backend needs a head dim that is a multiple of 8"),
        ("triton", "decode", torch.float32, 24, "the triton backend needs a head dim that is a power of two >= 16"),
        (  # every requirement unmet is named, not the first
            "flash_attn",
            "decode",
            torch.float32,
            12,
            "q in float16 or bfloat16, got torch.float32 and a head dim that is a multiple of 8 up to 256, got 12",
        ),
    ],
)
def test_a_backend_given_what_its_kernels_do_not_take_is_an_fgraph_error(backend, routine, dtype, head_dim, says):
    """Checked before any kernel runs (here on the meta device, as when fgraph traces: no kernel could run): the
    backend, what it needs, and the fix, on any device (the CPU stand-ins of FA2 and FlashInfer declare their own
    TAKES)."""
    hkv, page, dev = 2, 256, "meta"
    q, kv = torch.randn(2, 4, head_dim, dtype=dtype, device=dev), torch.randn(2, hkv, head_dim, dtype=dtype, device=dev)
    cache = torch.zeros(3, page, hkv, head_dim, dtype=dtype, device=dev)
    meta = A.build_metadata([1, 1], [1, 1], [[1], [2]], page, 1).to(dev)
    with pytest.raises(fgraph.FgraphError, match=re.escape(says)) as e:
        A.attention(q, kv, kv, cache, cache.clone(), meta, backend=backend, routine=routine)
    assert "backend='auto'" in str(e.value)


def test_a_pair_checks_the_page_size_of_both_routines():
    """One cache serves both routines: a pair with flash_attn refuses pages FA2 cannot read, even for the other."""
    case, n = Case(*DECODE, 4, 2), len(DECODE[0])
    with pytest.raises(fgraph.FgraphError, match="multiple of 256"):
        case.run(bucket=5, routine="decode", backend="torch/flash_attn")
    got, *got_caches = case.run(bucket=5, routine="decode", backend="torch/torch")
    want, *want_caches = case.run(bucket=5, routine="decode", backend="torch")
    assert torch.equal(got[:n], want[:n])
    torch.testing.assert_close(got_caches[0][1:], want_caches[0][1:], rtol=0, atol=0, equal_nan=True)


def test_import_is_lazy():
    code = (
        "import sys, fgraph, fgraph.ops.attention as A; A.resolve_backend('auto', 'cpu'); "
        "assert not {'flash_attn', 'flashinfer', 'triton'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_capture_support_per_backend():
    rule = support_rules[A.attention_p.p]
    assert rule({"backend": "torch", "routine": "mixed"})[0] is Support.ALWAYS
    assert rule({"backend": "flash_attn", "routine": "mixed"})[0] is Support.ALWAYS
    assert rule({"backend": "triton", "routine": "mixed"})[0] is Support.ALWAYS
    assert rule({"backend": "flashinfer", "routine": "mixed"})[0] is Support.ALWAYS


def test_flash_attn_split_count_depends_on_shapes_only():
    """decode_num_splits takes no lengths at all; spot-check it against flash-attn's heuristic behaviour."""
    assert _attn_flash.decode_num_splits(256, 8, 4, 128, 8192, 132) == 1  # enough work: no split
    small = _attn_flash.decode_num_splits(1, 2, 7, 64, 8192, 132)
    assert 1 < small <= 32  # one sequence, 2 kv heads: split the 32 key blocks to fill the SMs
    for b in (1, 8, 64, 256):
        assert 1 <= _attn_flash.decode_num_splits(b, 2, 7, 64, 1 << 17, 132) <= _attn_flash.GRAPH_MAX_SPLITS
    # one sequence of 4096 keys on the 8B's heads: flash-attn's heuristic alone picks 32, the cap 16 (measured faster)
    assert _attn_flash.split_heuristic(8, 264, 32) == 32
    assert _attn_flash.decode_num_splits(1, 8, 4, 128, 4096, 132) == 16


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


@pytest.mark.parametrize("hq, hkv", GQA)
@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED), ("mixed", ([1], [6]))])
def test_flash_attn_results_land_in_out(routine, lens, hq, hkv, monkeypatch):
    """The flash_attn backend hands the kernels the break's `out` (a strided view of it for folded GQA decode) and
    gets every head back where `out` keeps it, with no copy; a result computed elsewhere is copied in.
    The extension is a CPU stand-in (FakeFlashAttnExtension); the H200 tests check the real one
    against the same reference."""
    fake = FakeFlashAttnExtension()
    monkeypatch.setattr(_attn_flash, "_api", lambda: fake)
    monkeypatch.setitem(A.TAKES, "flash_attn", (None, None))  # the stand-in computes in any dtype (float64 here)
    monkeypatch.setattr(_attn_flash, "_num_sms", lambda index: 132)
    in_place, into = [], _attn_flash._into  # whether the kernel's result already was `out` (no copy kernel)
    monkeypatch.setattr(
        _attn_flash, "_into", lambda out, o: (in_place.append(o.data_ptr() == out.data_ptr()), into(out, o))
    )
    case = Case(*lens, hq, hkv)
    m = case.meta
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = torch.full_like(case.q, NAN)
    _attn_flash.forward(
        out,
        case.q,
        case.k,
        case.v,
        k_cache,
        v_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_table,
        m.slot_mapping,
        routine=routine,
        scale=D**-0.5,
        max_seq_len=64,
    )
    torch.testing.assert_close(out, case.expected())
    same(k_cache, case.written()[0])
    same(v_cache, case.written()[1])
    copied = routine == "mixed" and case.q.shape[0] == 1 and hq > hkv
    assert fake.copies_needed == copied and in_place == [not copied]


def test_trace_is_one_break_that_writes_the_cache():
    """Under fgraph's tracer attention is one break node that does the KV write itself: no index_copy_ or
    index_put_ outside it (Inductor would turn such a write into a copy of the cache layer), and the op's schema
    declares both caches written, so the trace's in-place checks see the mutation."""
    case = Case(*MIXED, 4, 2, dtype=torch.float32)
    meta = A.pad_metadata(case.meta, 24)
    pad = lambda x: torch.cat([x, x.new_zeros(24 - x.shape[0], *x.shape[1:])])

    def f(q, k, v, kc, vc, qsl, sl, bt, sm):
        return A.attention(q, k, v, kc, vc, A.AttentionMetadata(qsl, sl, bt, sm), routine="mixed", backend="torch")

    gm = make_fx(f, tracing_mode="fake")(
        pad(case.q),
        pad(case.k),
        pad(case.v),
        case.k_cache,
        case.v_cache,
        *(getattr(meta, n) for n in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")),
    )
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not {torch.ops.aten.index_copy_.default, torch.ops.aten.index_put_.default} & set(ops), ops
    assert ops.count(torch.ops.fgraph.attention.default) == 1
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.fgraph.attention.default)
    assert node.args[10:] == (None, None, "torch", "mixed", D**-0.5, 8 * PAGE, PAGE)  # no rope: cos, sin None
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    written = {names.index(t.name) if t.op == "placeholder" else str(t.target) for t in _fx.write_targets(node)}
    assert written == {3, 4, "aten.empty.memory_format"}, written  # kc, vc and out (allocated in the function)


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
        # oracle plans its own unpadded sequences); plans after the first may be module calls or skipped
        bucket = 8 if routine == "decode" else 32
        counts = [w.counts for key, w in FI._wrappers.items() if key[:2] == (routine, bucket)]
        assert len(counts) == 1 and sum(counts[0].values()) == 3, counts


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


def test_flashinfer_decode_buckets_after_the_first_are_captured_without_an_eager_warmup(fake_flashinfer, monkeypatch):
    """A FULL decode graph records its bucket's flashinfer wrapper, which must exist (and be planned) before the
    capture. The plan hook makes each bucket's wrapper from the traced q and k_cache (PlanCall.avals) and plans it,
    the first bucket's too, so only the first bucket is warmed up (once per trace: libraries initialise lazily),
    and the other buckets are captured with no eager run of the model (the donated counter, put back after
    capture, stays 0). Replays of every bucket equal eager."""

    def counted(cache, batch, state, routine="decode", backend="flashinfer"):
        state["calls"].add_(1)
        out, cache = toy_step(cache, batch, routine, backend)
        return out, cache, state

    births = decode_wrapper_births(fake_flashinfer, monkeypatch)
    f = fgraph.jit(
        counted,
        static=["routine", "backend"],
        donate=["cache", "state"],
        batch={"batch": TOY_BATCH},
        buckets=[8, 16, 32],
        mode="FULL",
    )
    jcache, batch = toy_inputs(Case(*DECODE, 4, 2, dtype=torch.float32, num_pages=200))
    state = {"calls": torch.zeros((), dtype=torch.int64)}
    f.capture(jcache, batch, state, routine="decode", backend="flashinfer", progress=False)
    assert state["calls"].item() == 0 and f.stats()["total"]["warmups"] == 1
    assert set(FI._wrappers) == decode_wrapper_keys(torch.float32, [8, 16, 32])
    assert births == [(True, False)] * 3  # all by the hook, none by the warm-up or inside a capture
    for n in (7, 12, 25):  # one call per bucket
        case = Case([1] * n, [1 + (5 * i) % 23 for i in range(n)], 4, 2, dtype=torch.float32, num_pages=200, seed=n)
        cache, batch = toy_inputs(case)
        for d, src in zip(jcache.k + jcache.v, cache.k + cache.v):  # the captured cache tensors, refilled in place
            d.copy_(src)
        want, _ = toy_step(cache, batch, "decode", "flashinfer")
        got, _, _ = f(jcache, batch, state, routine="decode", backend="flashinfer")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert f.stats()["total"]["replays"] == 3 and f.stats()["total"]["traces"] == 1


def test_flashinfer_decode_wrappers_are_never_made_inside_a_graph_capture(fake_flashinfer, monkeypatch):
    """Two models in one process (float32, then float64: two wrapper configurations of the same page size and scale),
    FULL decode, two buckets each: every decode wrapper a graph records is made by the plan hook before its capture,
    never inside it, where flashinfer could not plan it (the eager oracle makes its own, outside any graph). The
    H200 found the hook calling a bucket ready when its only wrapper was the other model's."""
    births = decode_wrapper_births(fake_flashinfer, monkeypatch)
    for dtype in (torch.float32, torch.float64):
        f = fgraph.jit(
            toy_step,
            static=["routine", "backend"],
            donate=["cache"],
            batch={"batch": TOY_BATCH},
            buckets=[8, 16],
            mode="FULL",
        )
        jcache, batch = toy_inputs(Case(*DECODE, 4, 2, dtype=dtype, num_pages=200))
        f.capture(jcache, batch, routine="decode", backend="flashinfer", progress=False)
        case = Case([1] * 12, [1 + (5 * i) % 23 for i in range(12)], 4, 2, dtype=dtype, num_pages=200, seed=12)
        cache, batch = toy_inputs(case)
        for d, src in zip(jcache.k + jcache.v, cache.k + cache.v):
            d.copy_(src)
        torch.testing.assert_close(
            f(jcache, batch, routine="decode", backend="flashinfer")[0],
            toy_step(cache, batch, "decode", "flashinfer")[0],
            rtol=1e-5,
            atol=1e-5,
        )
    # per model: its 2 buckets by the hook, then the eager oracle's 12 sequences (bucket 12) by its own call
    assert births == [(True, False), (True, False), (False, False)] * 2, births


def test_flashinfer_captures_make_only_their_own_decode_wrappers(fake_flashinfer):
    """Models of other dtypes in one process (float32, float64, float32 again; FULL decode, overlapping buckets):
    each capture makes exactly its own configuration's wrapper per bucket it captures, never one in another model's
    configuration (on the GPU each wrapper holds flashinfer's pinned buffers): no float64 wrapper for the buckets
    the float32 models captured, no float32 wrapper for the float64 model's. Each model's replays equal eager."""
    models, want = [], set()
    for dtype, buckets in [(torch.float32, [8, 16]), (torch.float64, [4, 16]), (torch.float32, [4, 32])]:
        f = fgraph.jit(
            toy_step,
            static=["routine", "backend"],
            donate=["cache"],
            batch={"batch": TOY_BATCH},
            buckets=buckets,
            mode="FULL",
        )
        jcache, batch = toy_inputs(Case(*DECODE, 4, 2, dtype=dtype, num_pages=200))
        f.capture(jcache, batch, routine="decode", backend="flashinfer", progress=False)
        want |= decode_wrapper_keys(dtype, buckets)
        assert set(FI._wrappers) == want, sorted(set(FI._wrappers) ^ want, key=repr)
        assert f.stats()["total"]["warmups"] == 1
        models.append((f, jcache, dtype))
    for f, jcache, dtype in models:  # 3 sequences: bucket 4 or 8
        case = Case([1] * 3, [2, 7, 13], 4, 2, dtype=dtype, num_pages=200, seed=3)
        cache, batch = toy_inputs(case)
        for d, src in zip(jcache.k + jcache.v, cache.k + cache.v):
            d.copy_(src)
        torch.testing.assert_close(
            f(jcache, batch, routine="decode", backend="flashinfer")[0],
            toy_step(cache, batch, "decode", "flashinfer")[0],
            rtol=1e-5,
            atol=1e-5,
        )
        assert f.stats()["total"]["replays"] == 1


def test_flashinfer_decode_graphs_copy_the_staged_metadata_in_themselves(fake_flashinfer, monkeypatch):
    """fgraph.config.inputs_in_graph: the FULL decode graph copies flashinfer's metadata in at its first layer,
    from a stage the plan hook writes (no upload of its own). Steps within pages, a new page, other pages: the
    same attention as eager; after the capture, every plan is staged for the graph, none uploaded."""
    monkeypatch.setattr(fgraph.config, "inputs_in_graph", True)
    step = jit_toy(buckets=(8,))
    lens = [1, 5, 9, 13, 17]
    jcache, staged = None, []
    for grow, seed in [(0, 0), (1, 0), (2, 0), (4, 0), (4, 1)]:
        case = Case([1] * 5, [n + grow for n in lens], 4, 2, dtype=torch.float32, seed=seed)
        cache, batch = toy_inputs(case)
        if jcache is None:
            jcache = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
        else:  # graphs read state by address: refill the same tensors
            for d, src in zip(jcache.k + jcache.v, cache.k + cache.v):
                d.copy_(src)
        want, _ = toy_step(cache, batch, routine="decode", backend="flashinfer")
        before = dict(FI._plan_bufs["cpu"].uploads) if "cpu" in FI._plan_bufs else None
        got, jcache = step(jcache, batch, routine="decode", backend="flashinfer")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if before is not None:
            after = FI._plan_bufs["cpu"].uploads
            staged.append({k: after[k] - before[k] for k in after if after[k] != before[k]})
    (e,) = [e for e in step.entries.values() if e.full is not None]
    assert e.buffers.graph_mirror is not None
    # step 1: the capture's copy and the call's; within pages only the lengths; a new page or other pages: all
    # (the eager oracle between the steps uploads its own plan, which does not touch the graph stage)
    assert staged == [
        {"graph_full": 2},
        {"graph_lengths": 1},
        {"graph_lengths": 1},
        {"graph_full": 1},
        {"graph_full": 1},
    ], staged


CACHE_WRITES = {"index_copy", "index_copy_", "index_put", "index_put_", "copy_", "scatter", "scatter_"}


@pytest.mark.parametrize("compile", [False, True])
def test_jit_pieces_never_write_the_cache(compile):
    """The KV write lives in the break: the graph pieces between breaks hold no write into the cache (under
    Inductor, `compile=True`, such a write became a copy of the whole cache layer), and after a call the cache
    holds the new k/v at their slots (from the break), equal to the eager run's, with Inductor-compiled pieces
    too."""
    step = fgraph.jit(
        toy_step,
        static=["routine", "backend"],
        donate=["cache"],
        batch={"batch": TOY_BATCH},
        buckets=[32],
        mode="PIECEWISE",
        compile=compile,
    )
    case = Case(*MIXED, 4, 2, dtype=torch.float32)
    cache, batch = toy_inputs(case)
    jcache = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
    want, cache = toy_step(cache, batch)
    got, jcache = step(jcache, batch, routine="mixed", backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jcache.k + jcache.v, cache.k + cache.v):
        same(a[1:], b[1:])
    (e,) = step.entries.values()
    pieces = e.program.pieces
    assert [p.ops for p in pieces if p.is_break] == [("attention",), ("attention",)]
    for p in pieces:
        if not p.is_break:
            assert not CACHE_WRITES & set(p.ops), p.ops
            assert not any(i.startswith("cache.") for i in p.inputs), p.inputs  # pieces never even see the cache


def test_jit_rejects_a_cache_that_is_not_donated():
    """The break writes the cache (its schema says so), so fgraph's trace check still names the missing donation."""
    step = fgraph.jit(
        toy_step,
        static=["routine", "backend"],
        batch={"batch": TOY_BATCH},
        buckets=[32],
        mode="PIECEWISE",
    )
    cache, batch = toy_inputs(Case(*MIXED, 4, 2, dtype=torch.float32))
    with pytest.raises(
        fgraph.FgraphError,
        match=r"fgraph\.attention.* writes in place into cache\.k\[0\], "
        r"which is not donated",
    ):
        step(cache, batch, routine="mixed", backend="torch")


# ------------------------------------------------------------------------------------------ flashinfer logic
def test_flashinfer_host_plan_layout():
    m = A.pad_metadata(A.build_metadata([1, 1], [5, 4], [[7, 3], [2]], PAGE, 4), 4)
    h = FI.host_plan(m.query_start_loc, m.seq_lens, m.block_table, PAGE)
    assert h.indptr.tolist() == [0, 2, 3, 4, 5]  # padded rows: one (scratch) page each
    assert h.indices.tolist() == [7, 3, 2, 0, 0]
    assert h.last.tolist() == [1, 4, 1, 1]  # never 0 (flashinfer: 0 is a full page)
    assert h.qo_indptr.tolist() == [0, 1, 2, 3, 4] and h.lens.tolist() == [5, 4, 1, 1]
    assert all(a.dtype == np.int32 for a in (h.qo_indptr, h.indptr, h.indices, h.last, h.lens))
    assert h.t("indptr").dtype == torch.int32 and h.t("indptr").device.type == "cpu"


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


@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED)])
def test_flashinfer_plans_once_per_step_from_the_hook(routine, lens, fake_flashinfer):
    bucket = sum(lens[0]) + 3
    for seed in (0, 1, 2):  # three steps with different lengths, same bucket
        case = Case(lens[0], [n + seed for n in lens[1]], 4, 2, dtype=torch.float32, seed=seed)
        meta = A.pad_metadata(case.meta, bucket)
        A.plan_attention(meta, backend="flashinfer", routine=routine, page_size=PAGE, scale=D**-0.5)
        out = _layers(case, meta, routine, bucket)
        torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
        assert plans_made(routine=routine) == seed + 1  # step 0: the new wrapper, by warm-up
    if routine == "decode":  # lengths 1, 4, 5, 9, 17, then +1 (new page counts), then +2 (the same: skipped)
        assert FI.stats() == {"plan": 1, "fast": 1, "module": 0, "skip": 1}
    else:  # the metadata padded to the bucket: a CUDA-graph prefill wrapper, set up by plan(), then the module's
        # plan called directly (each step's page counts change)
        assert FI.stats() == {"plan": 1, "fast": 0, "module": 2, "skip": 0}
        assert fake_flashinfer.plans == [("mixed", bucket)]


def test_flashinfer_decode_steps_within_pages_upload_only_the_last_page_lengths(fake_flashinfer):
    """A decode step that keeps every sequence in its last page (page_size - 1 steps in page_size) changes only the
    last-page lengths: the hook reuses the previous plan's indptr and page ids and uploads the lengths alone (the
    wrapper's plan is skipped); a sequence entering a new page, or other pages, upload everything again."""
    lens = [1, 5, 9, 13, 17]  # 1..5 pages of 4
    for step, (grow, seed, upload) in enumerate(
        [(0, 0, "full"), (1, 0, "lengths"), (2, 0, "lengths"), (4, 0, "full"), (4, 1, "full")]
    ):  # +4: new pages; seed 1: others
        case = Case([1] * 5, [n + grow for n in lens], 4, 2, dtype=torch.float32, seed=seed)
        meta = A.pad_metadata(case.meta, 8)
        bufs = FI._plan_bufs.get("cpu")
        before = (
            dict(bufs.uploads)
            if bufs is not None
            else dict.fromkeys(("full", "lengths", "graph_full", "graph_lengths"), 0)
        )
        A.plan_attention(meta, backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5)
        out = _layers(case, meta, "decode", 8)
        torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
        after = FI._plan_bufs["cpu"].uploads
        assert {k: after[k] - before[k] for k in after} == {
            "full": int(upload == "full"),
            "lengths": int(upload == "lengths"),
            "graph_full": 0,
            "graph_lengths": 0,
        }, step
    assert FI.stats()["skip"] == 3  # the schedule follows the page counts alone: steps 1, 2 and 4 keep it


@pytest.mark.parametrize("hq, hkv", [(4, 2), (8, 2)], ids=["cuda-cores", "tensor-cores-switched-on"])
def test_flashinfer_decode_replans_only_when_page_counts_change(hq, hkv, fake_flashinfer, monkeypatch):
    """Lengths grow by one a step (new pages each step: the page ids change, the page counts only when a
    sequence enters a new page). flashinfer's plan is made from the page counts (the host indptr) alone: a step
    with the same indptr skips it, the others call the module's plan directly after the first two (plan(), then
    fast_decode_plan, recorded). The stand-in kernels refuse a schedule that is not the buffers' indptr.
    Tensor-core wrappers take these paths with FI.TENSOR_CORE_PLAN_PATHS (the default, verified on the H200)."""
    monkeypatch.setattr(FI, "TENSOR_CORE_PLAN_PATHS", True)
    starts, bucket = [1, 5, 9, 13, 17], 8  # each at the start of a page of 4
    for step, (grow, how) in enumerate(
        [(0, "plan"), (1, "skip"), (4, "fast"), (5, "skip"), (8, "module"), (9, "skip"), (12, "module")]
    ):
        case = Case([1] * 5, [n + grow for n in starts], hq, hkv, dtype=torch.float32, seed=step)
        meta = A.pad_metadata(case.meta, bucket)
        A.plan_attention(meta, backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5)
        before = FI.stats()
        out = _layers(case, meta, "decode", bucket)
        after = FI.stats()
        assert {k for k in after if after[k] != before[k]} <= {how} and plans_made() == step + 1, (step, after)
        torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
    assert FI.stats() == {"plan": 1, "fast": 1, "module": 2, "skip": 3}


def test_flashinfer_tensor_core_decode_replans_every_step_through_the_api_when_switched_off(
    fake_flashinfer, monkeypatch
):
    """Tensor-core wrappers (GQA groups > 2: Qwen2.5's 7, Llama-3's 4) plan with the prefill scheduler. With
    FI.TENSOR_CORE_PLAN_PATHS off they skip nothing: every step plan() (first) or fast_decode_plan."""
    monkeypatch.setattr(FI, "TENSOR_CORE_PLAN_PATHS", False)
    starts, bucket = [1, 5, 9, 13, 17], 8
    for step, grow in enumerate([0, 1, 4, 5]):
        case = Case([1] * 5, [n + grow for n in starts], 8, 2, dtype=torch.float32, seed=step)
        meta = A.pad_metadata(case.meta, bucket)
        A.plan_attention(meta, backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5)
        torch.testing.assert_close(
            _layers(case, meta, "decode", bucket).double(), case.expected(), rtol=1e-5, atol=1e-5
        )
    assert FI.stats() == {"plan": 1, "fast": 3, "module": 0, "skip": 0}


def test_flashinfer_decode_plan_falls_back_to_the_api(fake_flashinfer, monkeypatch):
    """Without fast_decode_plan every plan is flashinfer's plan(); when the module call cannot be recorded (no
    `_cached_module`), every plan keeps fast_decode_plan. Either way still skipped when unchanged."""
    starts, bucket = [1, 5, 9, 13, 17], 8
    steps = [0, 4, 8, 9]  # changed, changed, changed, unchanged

    def run():
        for step, grow in enumerate(steps):
            case = Case([1] * 5, [n + grow for n in starts], 4, 2, dtype=torch.float32, seed=step)
            meta = A.pad_metadata(case.meta, bucket)
            A.plan_attention(meta, backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5)
            torch.testing.assert_close(
                _layers(case, meta, "decode", bucket).double(), case.expected(), rtol=1e-5, atol=1e-5
            )

    monkeypatch.setattr(fake_flashinfer, "decode", type("decode", (), {}))
    run()
    assert FI.stats() == {"plan": 3, "fast": 0, "module": 0, "skip": 1}
    FI.reset()
    W, fast = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper, FakeFlashInfer().decode.fast_decode_plan

    class Hidden(W):
        """Keeps its module elsewhere than `_cached_module` (only fast_decode_plan knows where)."""

        def plan(self, *a, **k):
            W.plan(self, *a, **k)
            self.mod = self.__dict__.pop("_cached_module")

    def hidden_fast(w, *a, **k):
        w._cached_module = w.mod
        try:
            fast(w, *a, **k)
        finally:
            del w._cached_module

    monkeypatch.setattr(fake_flashinfer, "BatchDecodeWithPagedKVCacheWrapper", Hidden)
    monkeypatch.setattr(fake_flashinfer, "decode", type("decode", (), {"fast_decode_plan": staticmethod(hidden_fast)}))
    run()
    assert FI.stats() == {"plan": 1, "fast": 2, "module": 0, "skip": 1}


def test_flashinfer_replans_when_called_outside_jit(fake_flashinfer):
    """No hook: plan from the device tensors on first use; re-plan for new tensors or in-place changes."""
    case = Case(*DECODE, 4, 2, dtype=torch.float32)
    meta = A.pad_metadata(case.meta, 8)
    out = _layers(case, meta, "decode", 8)
    assert plans_made() == 1
    torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
    case2 = Case(DECODE[0], [n + 3 for n in DECODE[1]], 4, 2, dtype=torch.float32, seed=1)
    meta2 = A.pad_metadata(case2.meta, 8)  # new tensors
    torch.testing.assert_close(_layers(case2, meta2, "decode", 8).double(), case2.expected(), rtol=1e-5, atol=1e-5)
    assert plans_made() == 2
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):  # same tensors, new values
        getattr(meta2, name).copy_(getattr(meta, name))
    torch.testing.assert_close(_layers(case, meta2, "decode", 8).double(), case.expected(), rtol=1e-5, atol=1e-5)
    assert plans_made() == 3


def test_flashinfer_buckets_share_buffers_without_stale_plans(fake_flashinfer):
    """Decode wrappers of different buckets share the persistent buffers: the last plan owns them. Coming back
    to bucket 8 re-uploads its metadata; its wrapper's own plan (page counts unchanged) is still good: skipped."""
    small, large = Case([1, 1], [3, 6], 4, 2, dtype=torch.float32), Case(*DECODE, 4, 2, dtype=torch.float32, seed=3)
    m_small, m_large = A.pad_metadata(small.meta, 2), A.pad_metadata(large.meta, 8)
    _layers(large, m_large, "decode", 8)
    _layers(small, m_small, "decode", 2)  # overwrites the shared buffers
    out = _layers(large, m_large, "decode", 8)  # same tensors as before, but the buffers are gone: re-upload
    torch.testing.assert_close(out.double(), large.expected(), rtol=1e-5, atol=1e-5)
    assert [b for _, b in fake_flashinfer.plans] == [8, 2] and plans_made(8) == 2 and FI.stats()["skip"] == 1


def test_flashinfer_wider_block_tables_get_their_own_decode_wrapper(fake_flashinfer):
    """A second engine with longer sequences (a wider block table, same bucket) gets its own wrapper and larger
    buffers, instead of the first wrapper's buffers overflowing ("pages in use"); the first still works."""
    short, long = (
        Case(*DECODE, 4, 2, dtype=torch.float32),
        Case([1] * 8, [29, 30, 31, 32, 25, 26, 27, 28], 4, 2, dtype=torch.float32, num_pages=72, max_pages=8),
    )
    m_short = A.pad_metadata(short.meta, 8)
    m_short = attrs.evolve(m_short, block_table=m_short.block_table[:, :5])  # 5 pages a row: buffers of 8 x 5
    m_long = A.pad_metadata(long.meta, 8)  # 8 pages a row, 60 in use
    for case, meta in ((short, m_short), (long, m_long), (short, m_short)):
        torch.testing.assert_close(_layers(case, meta, "decode", 8).double(), case.expected(), rtol=1e-5, atol=1e-5)
    assert sorted(key[-1] for key in FI._wrappers) == [5, 8]


def test_flashinfer_plan_of_a_jitted_call_is_not_taken_by_a_later_direct_call(fake_flashinfer):
    """The hook's plan belongs to the fgraph execution it was made for. A direct call afterwards (another model in
    the same process, the eager oracle of a test) must plan from its own metadata: taking the leftover plan of a
    CUDA-graph replay (which runs no Python, so nothing used the plan up) gave wrong attention, and an illegal
    address on the H200 where the leftover page tables were smaller (2026-11-29)."""
    from fgraph import _primitives as P

    bucket = 8
    a = Case([1] * 5, [1, 4, 5, 9, 17], 4, 2, dtype=torch.float32, seed=0)
    b = Case([1] * 5, [3, 6, 7, 12, 20], 4, 2, dtype=torch.float32, seed=1)
    _layers(a, A.pad_metadata(a.meta, bucket), "decode", bucket)  # creates the bucket's wrapper
    with P.execution():  # what fgraph does for a FULL replay: the plan hook, then the graph (no eager rule runs)
        A.plan_attention(
            A.pad_metadata(a.meta, bucket), backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5
        )
    before = plans_made(bucket)
    out = _layers(b, A.pad_metadata(b.meta, bucket), "decode", bucket)  # outside fgraph: plans for itself, once
    torch.testing.assert_close(out.double(), b.expected(), rtol=1e-5, atol=1e-5)
    assert plans_made(bucket) == before + 1


def test_flashinfer_two_engines_of_other_block_table_widths_alternate(fake_flashinfer):
    """Two jitted steps in one process whose block tables differ in width (two engines with different max_seq_len),
    calls alternating, same decode bucket: each equals eager. A decode plan serves the wrappers of its bucket and
    block-table width only; planning the narrower engine's wrapper from the wider one's plan overflowed its page
    buffers (an FgraphError: "60 pages in use, the decode buffers hold 40"), issue #32 item 8."""
    engines = {  # name: (jitted step, sequence lengths at step 0, Case options), the narrow one first
        "narrow": (jit_toy(buckets=(8,)), [1, 4, 5, 9, 13], {"max_pages": 5}),
        "wide": (jit_toy(buckets=(8,)), [29, 30, 31, 32, 25, 26, 27, 28], {"max_pages": 16, "num_pages": 72}),
    }
    caches = {}
    for step in range(3):  # lengths +1 a step: some sequences enter new pages
        for name, (f, lens, opts) in engines.items():
            case = Case([1] * len(lens), [n + step for n in lens], 4, 2, dtype=torch.float32, seed=step, **opts)
            cache, batch = toy_inputs(case)
            if name not in caches:
                caches[name] = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
            else:  # graphs read state by address: refill the same tensors
                for d, src in zip(caches[name].k + caches[name].v, cache.k + cache.v):
                    d.copy_(src)
            want, _ = toy_step(cache, batch, routine="decode", backend="flashinfer")
            got, caches[name] = f(caches[name], batch, routine="decode", backend="flashinfer")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sorted({key[-1] for key in FI._wrappers if key[1] == 8}) == [5, 16]
