"""The flash_attn (FlashAttention-2, >= 2.8) attention backend. CUDA only; page size a multiple of 256.

Both routines are full-graph capturable (Support.ALWAYS), each with its own kernels (its own graph set):
  decode  flash_attn_with_kvcache: one query per sequence, GQA folded into the query tile. The split count is
          chosen here on the host from the signature alone (batch bucket, heads, block-table width), so a graph
          replays the same grid whatever the lengths; lengths come from the device tensor `seq_lens`.
  mixed   flash_attn_varlen_func over the paged cache (block_table), with upper bounds for the host-side grid
          arguments: max_seqlen_q = the bucket's token count, max_seqlen_k = the model's max length. The
          per-sequence query offsets and KV lengths come from device tensors.
The KV write happens here, inside the break:
  decode  fused into flash_attn_with_kvcache: given k/v [B, 1, Hkv, D] and cache_seqlens = seq_lens - 1, the
          kernel writes them at position cache_seqlens[b] of sequence b through the block table (page
          block_table[b, p // page], row p % page), syncs the CTA, then attends over cache_seqlens[b] + 1 keys.
          That position is the token's slot_mapping entry (build_metadata: page of position L - 1 of a sequence
          of length L), and a padded row (seq_len 1, block-table row of page 0) writes page 0 slot 0, as its
          slot_mapping 0 says. Read from flash-attn's source (flash_api.cpp mha_fwd_kvcache: k/v with a block
          table take the split kernel; block_info.h: seqlen_k_cache = cache_seqlens[b], actual_seqlen_k =
          seqlen_k_cache + seqlen_knew; flash_fwd_kernel.h: the Append_KV loop walks the block table from
          n_block_copy_min = seqlen_k_cache / kBlockN; with split-KV only the split holding that block writes).
  mixed   write_kv (one kernel for both caches: _kv_write), then flash_attn_varlen_func.
Both kernels write into the break's `out` (the extension's own entry points, which take an output tensor; the
public functions pass none, and a copy into `out` was one more kernel per layer). With GQA and one query per
sequence, mha_fwd_kvcache folds the group into the query length (q viewed [B, G, Hkv, D], "seqlenq_ngroups_swapped")
and checks `out` in that shape: `out` [B, Hq, D] viewed [B, Hkv, G, D] then transposed has it, with strides that
put every head where `out` keeps it, and the kernel (and the split-KV combine) write through those strides. Where
a kernel still returns a tensor of its own (varlen folds the group too, at max_seqlen_q == 1, and then computes in a
temporary), the result is copied into `out`.
flash_attn is imported on first use only.
"""

from __future__ import annotations

import functools
import math

import torch

from fgraph.extend import once_per_execution
from fgraph.ops._kv_write import write_kv

MAX_SPLITS = 128  # flash-attn's limit
# The cap in a graph (vLLM's for FA under CUDA graphs too): past 16 splits the combine kernel costs more than the
# wider split kernel saves (docs/performance.md, "Why the code is shaped this way").
GRAPH_MAX_SPLITS = 16


@functools.cache
def _api():
    """flash_attn_2_cuda, the extension behind flash_attn's functions (fwd_kvcache, varlen_fwd: module docstring)."""
    from flash_attn import flash_attn_interface

    return flash_attn_interface.flash_attn_gpu


def _into(out: torch.Tensor, o: torch.Tensor) -> None:
    """Make sure the kernel's result is in `out` (a no-op when it wrote there)."""
    if o.data_ptr() != out.data_ptr():
        out.copy_(o.reshape(out.shape))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_heuristic(work: int, slots: int, n_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """flash-attn's own split-KV heuristic: the smallest split count within 85% of the best wave efficiency."""
    if work >= 0.8 * slots:
        return 1
    max_splits = min(max_splits, slots, n_blocks)
    ceil = lambda a, b: -(-a // b)
    eff = {}
    for s in range(1, max_splits + 1):
        if s > 1 and ceil(n_blocks, s) == ceil(n_blocks, s - 1):
            continue  # same blocks per split as s - 1: not a distinct choice
        waves = work * s / slots
        eff[s] = waves / math.ceil(waves)
    best = max(eff.values(), default=1.0)
    return next((s for s, e in sorted(eff.items()) if e >= 0.85 * best), 1)


def decode_num_splits(batch: int, num_kv_heads: int, group: int, head_dim: int, max_seqlen_k: int, num_sms: int) -> int:
    """The split count for a decode signature: a function of static shapes only (never of lengths).

    With GQA flash-attn folds the group into the query length (seqlen_q = group, heads = Hkv), tiles of 64
    queries; KV blocks of 256 (D <= 64), 128 (D <= 128) or 64 keys; 2 CTAs per SM.
    """
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    m_blocks = -(-group // 64)
    n_blocks = -(-max_seqlen_k // block_n)
    return split_heuristic(batch * num_kv_heads * m_blocks, 2 * num_sms, n_blocks, GRAPH_MAX_SPLITS)


def forward(
    out, q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, *, routine, scale, max_seq_len
):
    """The flash-attn backend's eager rule: write k/v into their cache slots, then attend.

    out, q: [N, Hq, D]; k/v: [N, Hkv, D]; k_cache/v_cache: [P, page, Hkv, D] (page % 256 == 0); block_table: [S,
    max_pages]. Writes k/v into their slots, then out."""
    fa = _api()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # as flash_attn's functions do
    N, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    L = block_table.shape[1] * page
    if routine == "decode":
        del slot_mapping  # the kernel derives each slot from cache_seqlens and the block table (module docstring)
        splits = decode_num_splits(N, Hkv, Hq // Hkv, D, L, _num_sms(q.device.index or 0))
        # the KV lengths before this token, the same for every layer: one kernel a step, made at the first layer
        before = once_per_execution(("fa2 cache_seqlens", id(seq_lens)), lambda: seq_lens - 1)
        G = Hq // Hkv
        o_view = out.view(N, Hkv, G, D).transpose(1, 2) if G > 1 and D % 8 == 0 else out.unsqueeze(1)  # docstring
        # (q, k_cache, v_cache, k, v, cache_seqlens, rotary cos, sin, cache_batch_idx, leftpad_k, block_table, alibi,
        #  out, scale, causal, window left, right, softcap, rotary_interleaved, num_splits), as flash_attn_with_kvcache
        o, _ = fa.fwd_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            k.unsqueeze(1),
            v.unsqueeze(1),
            before,
            None,
            None,
            None,
            None,
            block_table,
            None,
            o_view,
            scale,
            True,
            -1,
            -1,
            0.0,
            True,
            splits,
        )
        _into(out, o)  # [N, 1, Hq, D]
    else:
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        # cu_seqlens_k: with a block table flash-attn reads each sequence's KV length as cu[s+1] - cu[s].
        cu_k = torch.nn.functional.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))  # [S+1]
        # (q, k, v, out, cu_q, cu_k, seqused_k, leftpad_k, block_table, alibi, max_q, max_k, dropout, scale,
        #  zero_tensors, causal, window left, right, softcap, return_softmax, generator), as _flash_attn_varlen_forward
        o = fa.varlen_fwd(
            q,
            k_cache,
            v_cache,
            out,
            query_start_loc,
            cu_k,
            None,
            None,
            block_table,
            None,
            N,
            min(max_seq_len, L),
            0.0,
            scale,
            False,
            True,
            -1,
            -1,
            0.0,
            False,
            None,
        )[0]
        _into(out, o)
