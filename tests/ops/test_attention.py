"""Paged attention on the CPU: the torch backend against a float64 reference, the padding contract, the KV
write, backend resolution, the break's trace and capture support, and the flashinfer backend's planning logic
(with a stand-in flashinfer whose kernels compute from the *plan*, so a stale plan gives wrong numbers).

Shapes are tiny (head dim 8, pages of 4 tokens) so every sequence spans several pages.
"""

import re
import subprocess
import sys

import pytest
import torch

import fgraph
from fgraph import Support
from fgraph._primitives import support_rules
from fgraph.ops import _attn_flash, _backends
from fgraph.ops import attention as A
from tests.ops.attention_cases import DECODE, GQA, MIXED, PAGE, Case, D, same


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
    "missing, head_dim, want",
    [
        ((), 64, "triton/flashinfer"),  # padded metadata: FlashInfer's mixed kernel, capturable and faster
        (("flashinfer",), 64, "triton/flash_attn"),
        ((), 80, "flashinfer"),  # a head dim triton cannot tile: FlashInfer runs both routines
        (("flashinfer", "flash_attn"), 64, "triton"),
    ],
)
def test_auto_for_padded_metadata_puts_flashinfers_mixed_kernel_first(missing, head_dim, want, monkeypatch):
    monkeypatch.setattr(_backends, "_importable", lambda b: "absent" if b in missing else None)
    assert A.resolve_backend("auto", "cuda", head_dim, padded_metadata=True) == want


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
    """Resolving a backend on the CPU imports neither optional extra nor fgraph's own Triton kernels (Triton itself
    may come in with torch._dynamo where it is installed: torch/utils/_triton.py imports it)."""
    lazy = {"flash_attn", "flashinfer", "fgraph.ops._attn_triton_kernels", "fgraph.kernels._gemv_kernels"}
    code = (
        "import sys, fgraph, fgraph.ops.attention as A; A.resolve_backend('auto', 'cpu'); "
        f"assert not {lazy!r} & set(sys.modules), sorted({lazy!r} & set(sys.modules))"
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
