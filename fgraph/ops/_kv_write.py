"""The KV-cache append in one launch: k and v of N tokens into their slots of both caches.

The reference (`_attn_torch.write_kv`) is one index_copy_ per cache: two kernels a layer. On CUDA with Triton,
one program per token loads its k row and v row ([Hkv * D] each, contiguous) and stores both at its slot: one
kernel a layer, the same bytes moved. Elsewhere (CPU, no Triton, rows that are not contiguous, a dtype cast) the
reference runs. A copy either way, so the caches are bitwise the same (tests/ops/test_kv_write.py).

Padded rows share slot 0 of the scratch page; which of them lands there is unspecified, as with index_copy_.
"""

from __future__ import annotations

import functools

import torch

from . import _attn_torch


@functools.cache
def _kernel():
    """The Triton kernel, compiled per (row, block) on first use; None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def append(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_stride, v_stride, ROW: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        kr = tl.load(k_ptr + t.to(tl.int64) * k_stride + cols, mask=mask)
        vr = tl.load(v_ptr + t.to(tl.int64) * v_stride + cols, mask=mask)
        tl.store(kc_ptr + slot * ROW + cols, kr, mask=mask)
        tl.store(vc_ptr + slot * ROW + cols, vr, mask=mask)

    return append, triton.next_power_of_2


def _rows_contiguous(x: torch.Tensor) -> bool:
    """[N, Hkv, D] whose [Hkv, D] part of each token is one contiguous row (e.g. a slice of a fused qkv)."""
    return x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def one_launch(k, v, k_cache, v_cache) -> bool:
    """Whether write_kv takes the one-kernel path for these tensors."""
    return (
        k.is_cuda
        and _kernel() is not None
        and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and _rows_contiguous(k)
        and _rows_contiguous(v)
    )


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k/v [N, Hkv, D] -> slots slot_mapping [N] (int64) of the caches [P, page, Hkv, D]."""
    if not one_launch(k, v, k_cache, v_cache):
        return _attn_torch.write_kv(k, v, k_cache, v_cache, slot_mapping)
    append, next_pow2 = _kernel()
    N, row = k.shape[0], k.shape[1] * k.shape[2]
    if N == 0:
        return None
    with torch.cuda.device(k.device):
        append[(N,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK=next_pow2(row))
    return None
