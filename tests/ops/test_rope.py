"""RoPE inside the attention break (fgraph/ops/_rope.py): `attention(q, k, v, ..., rope=(cos, sin))` with q and k before
RoPE is `attention(apply_rope(q), apply_rope(k), v, ...)`, outputs and caches, bit for bit, for every backend, routine
and dtype (the kernels round the rotation as eager torch does). The example models rotate in the break by default, with
the same numbers as rotating first, and their traces then hold no rotation between the qkv matmul and the break.

CPU: the torch reference; Triton's interpreter (TRITON_INTERPRET=1) for the triton kernels. GPU (gpu marker): every
backend on CUDA, and the triton decode captured in a CUDA graph.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fgraph
from examples import llama
from examples.layers import rope_cos_sin, rope_inv_freq
from fgraph.ops import _attn_torch, _rope
from fgraph.ops import _attn_triton as T
from fgraph.ops import attention as A
from tests.ops.test_attention_gpu import backend_or_skip
from tests.ops.test_attention_triton import LENS, LLAMA, QWEN, Batch, all_padding, interpreter, same

MIXED = ([1, 2, 17, 1, 40, 20], LENS)  # (query lens, seq lens): decodes, a prompt, chunks after a history


def tables(batch, seed=0):
    """cos/sin [bucket, 1, D] at random positions (what a model computes from its padded positions)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4096, (batch.q.shape[0],), generator=g)
    inv = rope_inv_freq(batch.q.shape[2], 10000.0)
    return tuple(t.to(batch.q.device) for t in rope_cos_sin(inv, pos, batch.q.dtype))


def both(batch, backend, routine, cos, sin, max_seq_len=512):
    """(rotated in the break, rotated first): each (out, k_cache, v_cache), on copies of the caches."""
    runs = []
    for fused in (True, False):
        kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
        q, k = (batch.q, batch.k) if fused else (A.apply_rope(batch.q, cos, sin), A.apply_rope(batch.k, cos, sin))
        out = A.attention(q, k, batch.v, kc, vc, batch.meta, backend=backend, routine=routine,
                          max_seq_len=max_seq_len, rope=(cos, sin) if fused else None)  # fmt: skip
        runs.append((out, kc, vc))
    return runs


def check_same(batch, runs):
    (out, kc, vc), (want, wkc, wvc) = runs
    same(out[: batch.n], want[: batch.n])
    same(kc[1:], wkc[1:])
    same(vc[1:], wvc[1:])


# ------------------------------------------------------------------------------------------ the reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("routine", ["decode", "mixed"])
@pytest.mark.parametrize("flat", [False, True], ids=["N1D", "ND"])
def test_rotating_in_the_break_is_rotating_first(routine, dtype, flat):
    qlens, seqlens = ([1] * len(LENS), LENS) if routine == "decode" else MIXED
    batch = Batch(qlens, seqlens, QWEN, 16, dtype, bucket=sum(qlens) + 2)
    cos, sin = tables(batch)
    if flat:  # [N, D] tables are taken as they are; the reference rotation broadcasts [N, 1, D]
        runs = both(batch, "torch", routine, cos, sin)
        fused = A.attention(batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), batch.meta,
                            routine=routine, rope=(cos[:, 0], sin[:, 0]))  # fmt: skip
        same(fused, runs[0][0])
    check_same(batch, both(batch, "torch", routine, cos, sin))


@settings(max_examples=15, deadline=None)
@given(
    routine=st.sampled_from(["decode", "mixed"]),
    seqs=st.lists(st.tuples(st.integers(1, 90), st.integers(1, 12)), min_size=1, max_size=4),
    pad=st.integers(0, 3),
    heads=st.sampled_from([(2, 1, 16), (4, 2, 32), (8, 2, 64)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_random_batches_rotating_in_the_break_are_rotating_first(routine, seqs, pad, heads, dtype, seed):
    """Random lengths, padding, heads, dtypes and positions: the reference backend, bit for bit."""
    seqlens = [n for n, _ in seqs]
    qlens = [1] * len(seqs) if routine == "decode" else [min(q, n) for n, q in seqs]
    batch = Batch(qlens, seqlens, heads, 16, dtype, bucket=sum(qlens) + pad, max_seq=96, seed=seed)
    cos, sin = tables(batch, seed)
    check_same(batch, both(batch, "torch", routine, cos, sin, max_seq_len=96))


def test_the_reference_rotation_is_rotate_half_with_a_signed_sin():
    """rope(x) = x * cos + rotate_half(x) * sin (HF) with the tables examples/layers makes."""
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    pos = torch.tensor([0, 5, 1000])
    cos, signed = rope_cos_sin(rope_inv_freq(8, 10000.0), pos, torch.float64)
    sin = torch.cat([-signed[..., :4], signed[..., 4:]], dim=-1)
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    torch.testing.assert_close(A.apply_rope(x, cos, signed), x * cos + rotate_half * sin, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "rope, match",
    [
        ("cos", "not a \\(cos, sin\\) pair"),
        ("short", "\\[2, 1, 64\\]"),
        ("dim", "\\[8, 1, 32\\]"),
        ("dtype", "torch.float64"),
    ],
)
def test_a_rope_that_does_not_fit_is_an_fgraph_error(rope, match):
    batch = Batch([1] * 8, [3] * 8, QWEN, 16, torch.float32, bucket=8)
    cos, sin = tables(batch)
    bad = {
        "cos": cos,
        "short": (cos[:2], sin[:2]),
        "dim": (cos[..., :32], sin[..., :32]),
        "dtype": (cos.double(), sin.double()),
    }[rope]
    with pytest.raises(fgraph.FgraphError, match=match):
        A.attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, routine="decode", rope=bad)


def test_the_break_itself_refuses_tables_of_another_token_count():
    """Under a symbolic trace attention() cannot compare cos's rows with q's (module _check_rope): the break does,
    when it runs (an eager call, the warm-up before a capture)."""
    batch = Batch([1] * 8, [3] * 8, QWEN, 16, torch.float32, bucket=8)
    cos, sin = tables(batch)
    m, out = batch.meta, torch.empty_like(batch.q)
    with pytest.raises(fgraph.FgraphError, match="have 2 and 2 rows for 8 tokens"):
        A.attention_p(out, batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens,
                      m.block_table, m.slot_mapping, cos[:2], sin[:2], "torch", "decode", 0.125, 512, 16)  # fmt: skip


@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_a_cache_in_another_dtype_gets_k_rotated_in_qs_dtype_then_cast(routine):
    """As without rope=: k rotated in q's dtype (float32 here), then cast to the cache's (bfloat16)."""
    qlens, seqlens = ([1] * len(LENS), LENS) if routine == "decode" else MIXED
    batch = Batch(qlens, seqlens, QWEN, 16, torch.bfloat16, bucket=sum(qlens) + 2)
    batch.q, batch.k, batch.v = batch.q.float(), batch.k.float(), batch.v.float()
    cos, sin = (t.float() for t in tables(batch))
    check_same(batch, both(batch, "torch", routine, cos, sin))


def test_the_rotate_kernel_is_not_launched_for_a_head_dim_it_cannot_tile():
    """Its row is one tl.arange tile (a power of two); a head dim of 96 (FA2 and FlashInfer take it) rotates in the
    reference's torch ops."""
    q, k = torch.randn(3, 4, 96), torch.randn(3, 2, 96)
    assert not _rope._launchable(q, k)
    if T.kernels() is not None:  # (with Triton installed: the same tensors at a head dim of 64 would launch)
        assert _rope._launchable(q[..., :64].contiguous(), k[..., :64].contiguous())
    cos, sin = torch.randn(3, 96), torch.randn(3, 96)
    got = _rope.rotate(q, k, cos, sin)
    same(got[0], A.apply_rope(q, cos[:, None], sin[:, None]))


# ------------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_the_model_rotating_in_the_break_equals_rotating_first(routine, dtype):
    from benchmarks.common import decode_batch

    cfg = llama.preset("tiny")
    params = llama.init_params(cfg, dtype, "cpu", seed=0)
    batch, _ = decode_batch(cfg.vocab_size, 4, 16, 16, 64)
    outs = []
    for fuse in (True, False):
        cache = llama.init_cache(cfg, 1 + 4 * 4, 16, dtype, "cpu")
        logits, cache = llama.make_step(cfg, max_seq_len=64, fuse_rope=fuse)(params, cache, batch, routine)
        outs.append((logits, cache.k, cache.v))
    same(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1] + outs[0][2], outs[1][1] + outs[1][2]):
        same(a, b)


@pytest.mark.parametrize(
    "fuse, routine, rolls_per_layer",
    [
        (True, "decode", 0),  # the default: every step rotates in the break
        (True, "mixed", 0),
        ("decode", "mixed", 2),  # decode steps only: mixed ones rotate in the piece
        (False, "decode", 2),
    ],
)
def test_the_models_trace_rotates_inside_the_break_where_fuse_rope_says(fuse, routine, rolls_per_layer):
    """The traced step's rolls (the rotation) outside the attention breaks: none where the break rotates, q's and
    k's in each layer's piece where it does not."""
    from benchmarks.common import decode_batch

    cfg = llama.preset("tiny")
    params = llama.init_params(cfg, torch.float32, "cpu")
    batch, _ = decode_batch(cfg.vocab_size, 4, 16, 16, 64)
    cache = llama.init_cache(cfg, 1 + 4 * 4, 16, torch.float32, "cpu")
    step = llama.make_step(cfg, max_seq_len=64, **({} if fuse is True else {"fuse_rope": fuse}))
    gm = make_fx(lambda p, c, b: step(p, c, b, routine), tracing_mode="fake")(params, cache, batch)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten.roll.default) == rolls_per_layer * cfg.n_layers
    assert ops.count(torch.ops.fgraph.attention.default) == cfg.n_layers


# ------------------------------------------------------------------------------------------ interpreter
@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [QWEN, LLAMA], ids=["14x2x64", "8x2x128"])
@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_triton_rotating_in_the_break_is_rotating_first(routine, shape, dtype):
    """decode rotates in its kernel (FUSES); mixed through `rotate`, on the CPU its reference. Bitwise in float32
    (numpy fuses no multiply-add); in bfloat16 close, since the interpreter truncates float32 -> bfloat16 casts
    where CUDA rounds to nearest (bitwise there: the GPU specs below)."""
    qlens, seqlens = ([1] * len(LENS), LENS) if routine == "decode" else MIXED
    batch = Batch(qlens, seqlens, shape, 16, dtype, bucket=sum(qlens) + 2)
    cos, sin = tables(batch)
    runs = both(batch, "triton", routine, cos, sin)
    if dtype == torch.float32 or routine == "mixed":
        check_same(batch, runs)
    else:
        (out, kc, _), (want, wkc, _) = runs
        torch.testing.assert_close(out[: batch.n], want[: batch.n], rtol=1.6e-2, atol=3e-2)
        torch.testing.assert_close(kc[1:], wkc[1:], rtol=1.6e-2, atol=1e-2, equal_nan=True)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 96])  # 96: not a tile of the kernel's, the reference rotates
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_rotate_is_the_reference_bitwise_on_cuda(dtype, D):
    backend_or_skip("triton")
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(37, (14 + 2 * 2) * D, generator=g).to("cuda", dtype)  # strided views of a fused qkv
    q, k = qkv[:, : 14 * D].view(37, 14, D), qkv[:, 14 * D : 16 * D].view(37, 2, D)
    pos = torch.randint(0, 1 << 15, (37,), generator=g).cuda()
    cos, sin = rope_cos_sin(rope_inv_freq(D, 1e6).cuda(), pos, dtype)
    assert _rope._one_launch(q, k) == (D == 64)
    got = _rope.rotate(q, k, cos[:, 0], sin[:, 0])
    for a, b in zip(got, (A.apply_rope(q, cos, sin), A.apply_rope(k, cos, sin))):
        assert a.is_contiguous()
        same(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton", "flash_attn", "flashinfer"])
@pytest.mark.parametrize("routine", ["decode", "mixed"])
@pytest.mark.parametrize("shape", [QWEN, (32, 8, 128)], ids=["14x2x64", "32x8x128"])
def test_every_backend_rotating_in_the_break_is_rotating_first_bitwise(backend, routine, shape):
    """bf16 on CUDA: each backend's kernels, after the break's rotation or the reference's, bit for bit."""
    backend_or_skip(backend)
    qlens, seqlens = ([1] * len(LENS), LENS) if routine == "decode" else MIXED
    page = A.page_size_for(backend)
    batch = Batch(qlens, seqlens, shape, page, torch.bfloat16, bucket=sum(qlens) + 2, device="cuda")
    cos, sin = tables(batch)
    check_same(batch, both(batch, backend, routine, cos, sin))


@pytest.mark.gpu
@pytest.mark.parametrize("bucket", [1, 8, 64])
def test_triton_decode_rotating_in_a_cuda_graph_equals_eager_bitwise(bucket):
    """Captured once on an all-padding batch, replayed on real ones: the replay equals an eager call of the same
    kernel, and the reference rotated first (outputs close, caches bitwise)."""
    backend_or_skip("triton")
    shape, page, max_seq = QWEN, 16, 1024
    rig = Batch([1] * bucket, [1] * bucket, shape, page, torch.bfloat16, bucket, device="cuda", max_seq=max_seq)
    static = all_padding(bucket, page, rig.max_pages).to("cuda")
    q, kv, (cos, sin) = rig.q.clone(), rig.kv.clone(), (t.clone() for t in tables(rig))
    kc, vc = rig.k_cache.clone(), rig.v_cache.clone()
    call = lambda: A.attention(q, kv[:, 0], kv[:, 1], kc, vc, static, backend="triton", routine="decode",
                               max_seq_len=max_seq, rope=(cos, sin))  # fmt: skip
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    g = torch.Generator().manual_seed(bucket)
    for seed in range(3):
        lens = torch.randint(1, max_seq + 1, (bucket,), generator=g).tolist()
        batch = Batch([1] * bucket, lens, shape, page, torch.bfloat16, bucket, device="cuda", max_seq=max_seq,
                      seed=seed)  # fmt: skip
        bcos, bsin = tables(batch, seed)
        for dst, src in ((q, batch.q), (kv, batch.kv), (kc, batch.k_cache), (vc, batch.v_cache), (cos, bcos),
                         (sin, bsin)):  # fmt: skip
            dst.copy_(src)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            getattr(static, name).copy_(getattr(batch.meta, name))
        graph.replay()
        (eager, ekc, _), (want, wkc, _) = both(batch, "triton", "decode", bcos, bsin, max_seq)
        torch.cuda.synchronize()
        same(out, eager)
        same(kc[1:], ekc[1:])
        same(kc[1:], wkc[1:])
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        ref_kc = batch.k_cache.clone()
        _attn_torch.write_kv(A.apply_rope(batch.k, bcos, bsin), batch.v, ref_kc, batch.v_cache.clone(),
                             batch.meta.slot_mapping)  # fmt: skip
        same(kc[1:], ref_kc[1:])
