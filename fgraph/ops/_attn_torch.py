"""The torch attention backend: the reference. Runs on CPU and GPU, any page size, any GQA ratio.

Static shapes and no host syncs, so it can sit inside a CUDA graph (Support.ALWAYS); one code path serves both
routines (a decode batch is a mixed batch whose sequences have one query each). Each query token finds its
sequence on the device (`searchsorted` over the query offsets), gathers that sequence's pages through the
block table and attends to the keys at positions <= its own (causal, aligned to the sequence's tail).
Memory: the gathered keys of `chunk` tokens at a time ([chunk, pages * page_size, Hkv, D]), not of the batch.

`write_kv` here is one index_copy_ per cache: the reference of the one-launch write the other backends use
(_kv_write).
"""

from __future__ import annotations

import torch

# Elements of gathered K (and again of V) per chunk of query tokens: bounds the reference's memory.
GATHER_BUDGET = 1 << 25


def token_layout(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, n_tokens: int):
    """(seq id [N], absolute KV position [N]) of every query token. query_start_loc: [S+1], seq_lens: [S].

    Token t belongs to the sequence whose query range [qsl[s], qsl[s+1]) holds it; it sits at position
    seq_len[s] - (qsl[s+1] - t) of that sequence (the new tokens are the sequence's tail).
    """
    ends = query_start_loc[1:].to(torch.int64)  # [S]
    tok = torch.arange(n_tokens, device=ends.device, dtype=torch.int64)  # [N]
    sid = torch.searchsorted(ends, tok, right=True).clamp_(max=ends.shape[0] - 1)  # [N]
    pos = seq_lens.to(torch.int64)[sid] - (ends[sid] - tok)  # [N]
    return sid, pos


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k/v [N, Hkv, D] (the caches' dtype) -> slots slot_mapping [N] int64 of the caches [P, page, Hkv, D]."""
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping, v)


def forward(
    out, q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, *, routine, scale, max_seq_len
):
    """out, q: [N, Hq, D]; k/v: [N, Hkv, D]; k_cache/v_cache: [P, page, Hkv, D]; block_table: [S, max_pages].

    Writes k/v into their slots, then out."""
    del routine, max_seq_len  # one path for both routines; the block table's width bounds the keys
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    N, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    g = Hq // Hkv
    L = block_table.shape[1] * page  # key positions a block table row can address
    cdt = torch.promote_types(q.dtype, torch.float32)  # float32 for bf16/fp16, float64 stays float64
    sid, pos = token_layout(query_start_loc, seq_lens, N)
    keys = torch.arange(L, device=q.device)  # [L]
    chunk = max(1, GATHER_BUDGET // max(1, L * Hkv * D))
    for c0 in range(0, N, chunk):  # a static loop: the same kernels every call
        c1 = min(N, c0 + chunk)
        pages = block_table[sid[c0:c1]].to(torch.int64)  # [C, max_pages]
        kg = k_cache[pages].reshape(c1 - c0, L, Hkv, D)  # [C, L, Hkv, D]
        vg = v_cache[pages].reshape(c1 - c0, L, Hkv, D)
        visible = keys[None, :] <= pos[c0:c1, None]  # [C, L]
        qc = q[c0:c1].reshape(c1 - c0, Hkv, g, D).to(cdt)  # [C, Hkv, g, D]
        s = torch.einsum("chgd,clhd->chgl", qc, kg.to(cdt)) * scale  # [C, Hkv, g, L]
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        # Invisible slots may hold anything (NaN in a poisoned page): 0 * NaN is NaN, so zero them, not just p.
        vg = torch.where(visible[:, :, None, None], vg.to(cdt), torch.zeros((), dtype=cdt, device=q.device))
        o = torch.einsum("chgl,clhd->chgd", p, vg)  # [C, Hkv, g, D]
        out[c0:c1] = o.reshape(c1 - c0, Hq, D).to(out.dtype)
