"""The triton attention backend (fgraph/ops/_attn_triton.py) against the torch reference (_attn_torch), whose
semantics are the spec: the same outputs for every real row, the same caches after the KV write.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 with Triton installed; skipped otherwise):
the Qwen2.5-0.5B grouping (14 q heads over 2 kv heads, dim 64) and an 8B-like one (8 over 2, dim 128), pages of 16
and 256, lengths on and off every block and page edge in one batch, padded to a bucket as fgraph pads, float32 and
bfloat16, decode with many splits and with one. Every cache slot but the KV history starts NaN, so a read past a
sequence's keys or a write to a wrong slot shows. On the GPU (gpu marker): the same on CUDA in bfloat16, and CUDA
graphs captured once on an all-padding batch, replayed on batches of other lengths (up to max_seq_len), bitwise
equal to eager calls of the same kernels and close to the reference.
"""

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph.ops import _attn_torch
from fgraph.ops import _attn_triton as T
from fgraph.ops import attention as A

NAN = float("nan")
QWEN, LLAMA = (14, 2, 64), (8, 2, 128)  # (Hq, Hkv, D): the 0.5B's grouping (G = 7), an 8B-like one (G = 4)
MAX_SEQ = 512
LENS = [1, 2, 17, 255, 256, 257]  # seq_lens: one key, one cached key, off every block, a page of 256 and past it
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}

# (the interpreter's own numpy use warns at every tensor loop bound)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
interpreter = pytest.mark.interpreter


class Batch:
    """S sequences on random distinct pages (never page 0), padded to `bucket` tokens and sequences as fgraph
    pads. Every slot but the KV history (positions before each sequence's new tokens) is NaN. k and v are strided
    rows of one fused tensor, as a model's qkv split gives them."""

    def __init__(self, qlens, seqlens, shape, page, dtype, bucket, device="cpu", max_seq=MAX_SEQ, seed=0):
        g = torch.Generator().manual_seed(seed)
        hq, hkv, d = shape
        self.max_pages = -(-max_seq // page)
        self.num_pages = 1 + len(seqlens) * self.max_pages
        free = (torch.randperm(self.num_pages - 1, generator=g) + 1).tolist()
        tables = [[free.pop() for _ in range(-(-n // page))] for n in seqlens]
        self.unused = free
        self.host = A.build_metadata(qlens, seqlens, tables, page, self.max_pages)
        self.meta = A.pad_metadata(self.host, bucket).to(device)
        self.k_cache = torch.full((self.num_pages, page, hkv, d), NAN, dtype=dtype)
        self.v_cache = self.k_cache.clone()
        hist = [t[j // page] * page + j % page for t, q, n in zip(tables, qlens, seqlens) for j in range(n - q)]
        for c in (self.k_cache, self.v_cache):
            c.view(-1, hkv, d)[hist] = torch.randn(len(hist), hkv, d, generator=g).to(dtype)
        self.k_cache, self.v_cache = self.k_cache.to(device), self.v_cache.to(device)
        self.q = torch.randn(bucket, hq, d, generator=g).to(device, dtype)  # padded rows too: finite
        self.kv = torch.randn(bucket, 2, hkv, d, generator=g).to(device, dtype)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]  # row stride 2 * Hkv * D
        self.n = sum(qlens)

    def run(self, module, routine, max_seq_len=MAX_SEQ):
        """One call of a backend module's forward on copies of the caches -> (out, k_cache, v_cache)."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        out = torch.empty_like(self.q)
        m = self.meta
        module.forward(out, self.q, self.k, self.v, kc, vc, m.query_start_loc, m.seq_lens, m.block_table,
                       m.slot_mapping, routine=routine, scale=self.q.shape[2] ** -0.5,
                       max_seq_len=max_seq_len)  # fmt: skip
        return out, kc, vc


def all_padding(bucket, page, max_pages):
    """What fgraph captures with: each metadata leaf cut to its `extra` rows, then padded to the bucket."""
    one = A.build_metadata([1], [1], [[0]], page, max_pages)
    cut = A.AttentionMetadata(one.query_start_loc[:1], one.seq_lens[:0], one.block_table[:0], one.slot_mapping[:0])
    return A.pad_metadata(cut, bucket)


def same(a, b):
    """Bitwise equal, NaN included."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def check_against_reference(batch, routine, max_seq_len=MAX_SEQ):
    """Real rows close to the reference; every real page bitwise as the reference leaves it; unused pages and the
    scratch page's slots past 0 untouched (NaN)."""
    got, kc, vc = batch.run(T, routine, max_seq_len)
    want, want_kc, want_vc = batch.run(_attn_torch, routine, max_seq_len)
    torch.testing.assert_close(got[: batch.n], want[: batch.n], **TOL[got.dtype])
    same(kc[1:], want_kc[1:])
    same(vc[1:], want_vc[1:])
    assert kc[0, 1:].isnan().all() and vc[0, 1:].isnan().all()
    assert kc[batch.unused].isnan().all()
    return got


# ------------------------------------------------------------------------------------------ static choices
def test_split_count_depends_on_static_sizes_only():
    """splits_for takes no lengths: ~WAVES programs per SM below UNSPLIT_WAVES, at least one key block per split, at
    most MAX_SPLITS; no split at or above UNSPLIT_WAVES."""
    assert T.splits_for(1, 2, 1024) == 16  # the 0.5B at B=1: one split per block of 64 keys
    assert T.splits_for(8, 8, 8192) == 16  # the 8B at B=8: 64 programs; 17 wanted, and 16 of 8 blocks each cover
    # the 128 (a 17th would get none)
    assert T.splits_for(64, 2, 8192) == 9  # the 0.5B at B=64: 128 programs -> 1152
    assert T.splits_for(64, 2, 1024) == 8  # the same want, in whole blocks of the 16
    assert T.splits_for(1, 8, 8192) == T.MAX_SPLITS
    assert T.splits_for(128, 2, 8192) == 5  # 256 programs, just under UNSPLIT_WAVES * 132
    assert T.splits_for(256, 2, 8192) == 1  # 512 programs: no split, no merge kernel
    # An unpadded eager call splits as the graph of its bucket does (bitwise the same sums): every N between a
    # default bucket's predecessor and the bucket splits alike.
    buckets = fgraph.default_buckets(512)
    for lo, hi in zip(buckets, buckets[1:]):
        assert {T.splits_for(n, 2, 1024) for n in range(lo + 1, hi + 1)} == {T.splits_for(hi, 2, 1024)}, (lo, hi)
    for b in (1, 3, 8, 64, 256):
        for ctx in (1, 63, 64, 65, 1000, 1024, 1 << 17):
            s, blocks = T.splits_for(b, 2, ctx), -(-ctx // T.BLOCK_N)
            assert 1 <= s <= min(T.MAX_SPLITS, blocks), (b, ctx, s)
            per = -(-blocks // s)  # the kernel's blocks per split: every split starts below max_seq_len
            assert (s - 1) * per < blocks <= s * per, (b, ctx, s)


def test_decode_warps_follow_head_dim_and_programs_per_sm():
    """Head dim 64: 4 warps. Head dim 128: 8 warps while the grid is at most WIDE_WAVES programs per SM (the 8B at
    B=1, split), 2 past it (B=8: 1024 programs)."""
    sms = T.NUM_SMS
    grid = lambda n, hkv, ctx: n * hkv * T.splits_for(n, hkv, ctx)  # noqa: E731
    assert {T._decode_warps(64, grid(n, 2, 1024), sms) for n in (1, 8, 64, 256)} == {4}
    assert T._decode_warps(128, grid(1, 8, 1024), sms) == T._decode_warps(128, grid(1, 8, 8192), sms) == 8
    assert T._decode_warps(128, grid(8, 8, 1024), sms) == T._decode_warps(128, grid(64, 8, 8192), sms) == 2
    assert T._decode_warps(128, T.WIDE_WAVES * sms, sms) == 8 and T._decode_warps(128, T.WIDE_WAVES * sms + 1, sms) == 2


@pytest.mark.parametrize("kv_heads, head_dim", [(2, 64), (8, 128), (4, 128), (1, 128)])
@pytest.mark.parametrize("max_seq", [1024, 8192])
def test_an_unpadded_decode_launches_as_its_bucket_does(kv_heads, head_dim, max_seq):
    """Splits and warps (both change the float sums) are those of the batch's power-of-two bucket at every size, so
    an eager call of N sequences and the graph of N's bucket give the same bits."""
    for n in range(1, 513):
        bucket = 1 << (n - 1).bit_length()
        assert T.decode_launch(n, kv_heads, head_dim, max_seq, T.NUM_SMS) == T.decode_launch(
            bucket, kv_heads, head_dim, max_seq, T.NUM_SMS
        ), n


def test_triton_rejects_head_dims_its_kernels_cannot_tile():
    q, kv = torch.randn(2, 4, 24), torch.randn(2, 2, 24)
    cache = torch.zeros(3, 16, 2, 24)
    meta = A.build_metadata([1, 1], [1, 1], [[1], [2]], 16, 1)
    with pytest.raises(fgraph.FgraphError, match="power of two >= 16"):
        A.attention(q, kv, kv, cache, cache.clone(), meta, backend="triton", routine="decode")


# ------------------------------------------------------------------------------------------ interpreter
@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("shape", [QWEN, LLAMA], ids=["14x2x64", "8x2x128"])
@pytest.mark.parametrize("sms", [T.NUM_SMS, 1], ids=["splits", "one-split"])
@pytest.mark.parametrize("even", [True, False], ids=["even-splits", "max-seq-splits"])
def test_decode_matches_reference(shape, page, dtype, sms, even, monkeypatch):
    """Six sequences of the LENS lengths in a bucket of 8: with the SMs of an H200, 8 splits (each sequence's keys
    in whole blocks over them, or max_seq_len's: most then empty for the short sequences, skipped by the merge);
    with one SM, one split writing `out` directly."""
    monkeypatch.setattr(T, "NUM_SMS", sms)
    monkeypatch.setattr(T, "EVEN_SPLITS", even)
    assert (T.splits_for(8, shape[1], MAX_SEQ, num_sms=sms) > 1) == (sms > 1)
    batch = Batch([1] * len(LENS), LENS, shape, page, dtype, bucket=8)
    got = check_against_reference(batch, "decode")
    # padded rows (seq_len 1, slot 0) attend their own token only: each head's output is its group's new v
    hq, hkv, d = shape
    own = batch.v[batch.n :].repeat_interleave(hq // hkv, dim=1)
    torch.testing.assert_close(got[batch.n :], own, rtol=0, atol=0)


@interpreter
@pytest.mark.parametrize("last_merges", [True, False], ids=["last-program-merges", "merge-kernel"])
def test_split_decode_merges_in_its_last_program_and_leaves_the_counters_at_zero(last_merges, monkeypatch):
    """With splits, the group's last program to finish merges them (no merge kernel), as the merge kernel would,
    and puts its counter back to 0, so the next launch (or replay) counts from zero again."""
    monkeypatch.setattr(T, "LAST_MERGES", last_merges)
    monkeypatch.setattr(T, "_lock_bufs", {})
    batch = Batch([1] * len(LENS), LENS, QWEN, 16, torch.float32, bucket=8)
    assert T.splits_for(8, QWEN[1], MAX_SEQ) > 1
    for _ in range(2):
        check_against_reference(batch, "decode")
    assert [t.tolist() for t in T._lock_bufs.values()] == ([[0] * 8 * QWEN[1]] if last_merges else [])


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("shape", [QWEN, LLAMA], ids=["14x2x64", "8x2x128"])
def test_mixed_matches_reference(shape, page, dtype):
    """Decodes, whole prompts and chunks after a history, in one bucket with padded sequences: query tiles of
    several tokens (9 tokens x 7 heads, 16 x 4), tiles that end inside a sequence, keys past several blocks."""
    qlens, seqlens = [1, 2, 17, 1, 40, 20, 5], [1, 2, 255, 256, 257, 20, 40]
    check_against_reference(Batch(qlens, seqlens, shape, page, dtype, bucket=sum(qlens) + 4), "mixed")


@interpreter
@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_all_padding_batch_touches_only_the_scratch_slot(routine):
    """What fgraph captures with: every sequence padded (seq_len 1, block-table row 0, slot 0)."""
    batch = Batch([1], [1], QWEN, 16, torch.float32, bucket=4)
    batch.meta, batch.n = all_padding(4, 16, batch.max_pages), 0
    got, kc, vc = batch.run(T, routine)
    assert torch.isfinite(got).all()
    same(kc[1:], batch.k_cache[1:])
    assert torch.isfinite(kc[0, 0]).all() and kc[0, 1:].isnan().all()
    if routine == "decode":
        torch.testing.assert_close(got, batch.v.repeat_interleave(7, dim=1), rtol=0, atol=0)


@interpreter
@settings(max_examples=10, deadline=None)
@given(
    routine=st.sampled_from(["decode", "mixed"]),
    page=st.sampled_from([16, 48, 256]),
    seqs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 24)), min_size=1, max_size=5),
    pad=st.integers(0, 3),
    grouping=st.sampled_from([(4, 1, 16), (14, 2, 64), (8, 2, 128)]),
)
def test_random_batches_match_reference(routine, page, seqs, pad, grouping):
    """Random lengths, batch, padding, page size (48: pages that are not a power of two), heads."""
    seqlens = [n for n, _ in seqs]
    qlens = [1] * len(seqs) if routine == "decode" else [min(q, n) for n, q in seqs]
    batch = Batch(qlens, seqlens, grouping, page, torch.float32, bucket=sum(qlens) + pad, max_seq=320)
    check_against_reference(batch, routine, max_seq_len=320)


# ------------------------------------------------------------------------------------------ GPU
def gpu_or_skip():
    try:
        return A.resolve_backend("triton", "cuda")
    except fgraph.FgraphError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("shape", [QWEN, LLAMA, (32, 8, 128)], ids=["14x2x64", "8x2x128", "32x8x128"])
@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_gpu_matches_reference(routine, shape, page):
    gpu_or_skip()
    qlens = [1] * len(LENS) if routine == "decode" else [1, 2, 17, 1, 40, 20]
    batch = Batch(qlens, LENS, shape, page, torch.bfloat16, bucket=sum(qlens) + 2, device="cuda")
    check_against_reference(batch, routine)


@pytest.mark.gpu
@pytest.mark.parametrize("even", [True, False], ids=["even-splits", "max-seq-splits"])
@pytest.mark.parametrize("shape", [QWEN, (32, 8, 128)], ids=["14x2x64", "32x8x128"])
@pytest.mark.parametrize("routine, bucket", [("decode", 1), ("decode", 8), ("decode", 64), ("mixed", 128)])
def test_cuda_graph_replays_equal_eager_calls_bitwise(routine, bucket, shape, even, monkeypatch):
    """Captured once on an all-padding batch, replayed on batches of lengths 1 .. max_seq_len: every replay's
    outputs and caches bitwise those of an eager call on the same inputs, and close to the reference. Decode's
    splits over each sequence's own keys (EVEN_SPLITS) or over max_seq_len's."""
    gpu_or_skip()
    if routine != "decode" and not even:
        pytest.skip("EVEN_SPLITS is decode's")
    monkeypatch.setattr(T, "EVEN_SPLITS", even)
    max_seq, page, g = 1024, 16, torch.Generator().manual_seed(bucket)
    real = bucket if routine == "decode" else 6
    rig = Batch([1] * real, [1] * real, shape, page, torch.bfloat16, bucket, device="cuda", max_seq=max_seq)
    static = all_padding(bucket, page, rig.max_pages).to("cuda")
    q, kv = rig.q.clone(), rig.kv.clone()
    kc, vc = rig.k_cache.clone(), rig.v_cache.clone()
    call = lambda: A.attention(q, kv[:, 0], kv[:, 1], kc, vc, static, backend="triton", routine=routine,
                               max_seq_len=max_seq)  # fmt: skip
    call()  # compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    rnd = lambda lo: int(torch.randint(lo, max_seq + 1, (), generator=g))
    qlens = [1] * real if routine == "decode" else [1, 1, 17, 64, 5, 3]
    for seqlens in ([rnd(q) for q in qlens], [max(1, q) for q in qlens], [max_seq] * real, [rnd(q) for q in qlens]):
        batch = Batch(qlens, seqlens, shape, page, torch.bfloat16, bucket, device="cuda", max_seq=max_seq, seed=rnd(1))
        for dst, src in ((q, batch.q), (kv, batch.kv), (kc, batch.k_cache), (vc, batch.v_cache)):
            dst.copy_(src)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            getattr(static, name).copy_(getattr(batch.meta, name))
        graph.replay()
        eager, ekc, evc = batch.run(T, routine, max_seq)
        torch.cuda.synchronize()
        n = bucket if routine == "decode" else batch.n  # (mixed: padded rows read whichever token won slot 0)
        same(out[:n], eager[:n])
        same(kc[1:], ekc[1:])
        same(vc[1:], evc[1:])
        want, _, _ = batch.run(_attn_torch, routine, max_seq)
        torch.testing.assert_close(out[: batch.n], want[: batch.n], **TOL[torch.bfloat16])
        assert math.isfinite(out[: batch.n].float().sum().item())


def decodes_into(static, seeds, bucket, page, max_seq):
    """Per seed, a decode batch of random lengths (1 to max_seq) on the GPU, copied into the tensors a graph reads,
    static = (q, kv, k_cache, v_cache, metadata); yields the batch, whose eager run is the oracle."""
    q, kv, kc, vc, meta = static
    for seed in seeds:
        lens = torch.randint(1, max_seq + 1, (bucket,), generator=torch.Generator().manual_seed(seed)).tolist()
        batch = Batch([1] * bucket, lens, QWEN, page, torch.bfloat16, bucket, device="cuda", max_seq=max_seq, seed=seed)
        for dst, src in ((q, batch.q), (kv, batch.kv), (kc, batch.k_cache), (vc, batch.v_cache)):
            dst.copy_(src)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            getattr(meta, name).copy_(getattr(batch.meta, name))
        yield batch


@pytest.mark.gpu
def test_decode_counters_first_met_inside_a_capture_belong_to_that_graph(monkeypatch):
    """With LAST_MERGES, a decode of a size no eager call has run: its arrival counters are made zero inside the
    graph (not kept for the process), and every replay merges as an eager call does."""
    gpu_or_skip()
    monkeypatch.setattr(T, "_lock_bufs", {})
    monkeypatch.setattr(T, "LAST_MERGES", True)
    max_seq, page, bucket = 1024, 16, 8
    rig = Batch([1] * bucket, [1] * bucket, QWEN, page, torch.bfloat16, bucket, device="cuda", max_seq=max_seq)
    static = all_padding(bucket, page, rig.max_pages).to("cuda")
    q, kv, kc, vc = rig.q.clone(), rig.kv.clone(), rig.k_cache.clone(), rig.v_cache.clone()
    call = lambda: A.attention(q, kv[:, 0], kv[:, 1], kc, vc, static, backend="triton", routine="decode",
                               max_seq_len=max_seq)  # fmt: skip
    call()  # compiles the kernels
    torch.cuda.synchronize()
    T._lock_bufs.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    assert not T._lock_bufs
    for batch in decodes_into((q, kv, kc, vc, static), range(3), bucket, page, max_seq):
        graph.replay()
        eager, _, _ = batch.run(T, "decode", max_seq)
        torch.cuda.synchronize()
        same(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("last_merges", [True, False], ids=["merged-in-kernel", "merge-kernel"])
def test_decode_launched_with_pdl_replays_the_bits_of_eager_decode_without_it(last_merges, monkeypatch):
    """fgraph.config.pdl: decode (and its merge kernel) may start while the kernel before it runs, waiting for it
    before touching memory; inside a CUDA graph after a kernel that writes q, every replay equals eager decode."""
    gpu_or_skip()
    monkeypatch.setattr(T, "LAST_MERGES", last_merges)
    max_seq, page, bucket = 1024, 16, 8
    assert T.splits_for(bucket, QWEN[1], max_seq) > 1
    rig = Batch([1] * bucket, [1] * bucket, QWEN, page, torch.bfloat16, bucket, device="cuda", max_seq=max_seq)
    q, kv, kc, vc, meta = rig.q.clone(), rig.kv.clone(), rig.k_cache.clone(), rig.v_cache.clone(), rig.meta
    q_in = q.clone()

    def call():
        q.copy_(q_in)  # the kernel before decode writes what it reads
        return A.attention(q, kv[:, 0], kv[:, 1], kc, vc, meta, backend="triton", routine="decode",
                           max_seq_len=max_seq)  # fmt: skip

    monkeypatch.setattr(fgraph.config, "pdl", True)
    call()  # compiles the PDL variants
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for batch in decodes_into((q_in, kv, kc, vc, meta), range(3), bucket, page, max_seq):
        graph.replay()
        with monkeypatch.context() as m:
            m.setattr(fgraph.config, "pdl", False)
            eager, _, _ = batch.run(T, "decode", max_seq)
        torch.cuda.synchronize()
        same(out[: batch.n], eager[: batch.n])


@pytest.mark.gpu
def test_the_in_kernel_merge_records_under_torch_compile_reduce_overhead(monkeypatch):
    """With LAST_MERGES, torch.compile(mode="reduce-overhead") of a function that calls the op, first at this size:
    cudagraph trees warm it up with the calling thread's allocations routed into the tree's pool, where counters
    kept for the process would fail the recording ("tensor(s) in the cudagraph pool not tracked as outputs"). They
    are made outside it, and the recorded replays equal eager calls of the same kernels."""
    gpu_or_skip()
    monkeypatch.setattr(T, "_lock_bufs", {})
    monkeypatch.setattr(T, "LAST_MERGES", True)
    max_seq, page, bucket = 1024, 16, 8
    assert T.splits_for(bucket, QWEN[1], max_seq) > 1
    rig = Batch([1] * bucket, [1] * bucket, QWEN, page, torch.bfloat16, bucket, device="cuda", max_seq=max_seq)
    q, kv, kc, vc, meta = rig.q.clone(), rig.kv.clone(), rig.k_cache.clone(), rig.v_cache.clone(), rig.meta
    for t in (q, kv, kc, vc, *attrs.astuple(meta, recurse=False)):  # (as decode_bench's peer marks its inputs)
        torch._dynamo.mark_static_address(t)

    def step():
        return A.attention(q, kv[:, 0], kv[:, 1], kc, vc, meta, backend="triton", routine="decode",
                           max_seq_len=max_seq)  # fmt: skip

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for batch in decodes_into((q, kv, kc, vc, meta), range(4), bucket, page, max_seq):  # warm-up, record, replays
        got = compiled().clone()
        eager, _, _ = batch.run(T, "decode", max_seq)
        torch.cuda.synchronize()
        same(got[: batch.n], eager[: batch.n])
    assert [t.tolist() for t in T._lock_bufs.values()] == [[0] * bucket * QWEN[1]]
