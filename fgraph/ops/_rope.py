"""RoPE inside the attention break: `attention(q, k, v, ..., rope=(cos, sin))` takes q and k *before* RoPE.

    rope(x) = x * cos + roll(x, D / 2) * sin        x [N, H, D]; cos, sin [N, D], one row per token

HF's rotate-half layout, with the first half of `sin` negated so that the rotation is one roll (the tables
examples/layers.rope_cos_sin makes). Rotating inside the break spares the piece before it the elementwise kernels
that rotated q and k between the qkv matmul and attention (docs/performance.md): a backend's kernel that rotates
as it loads (FUSES) runs nothing more; elsewhere `rotate` makes rotated copies of q and k in one launch (CUDA with
Triton) or with the reference's torch ops (`apply_rope`).

Every path rounds as eager torch does in the tensors' dtype: each product rounded to the dtype, then the sum, with
no multiply-add fused (_attn_triton_kernels.rope). So the kernels' rotation equals `apply_rope` bit for bit in every
dtype, and rotating in the break gives what rotating first gives.
"""

from __future__ import annotations

import torch

from fgraph.ops import _attn_triton

# (backend, routine) whose kernel rotates q and k in registers: the break passes it the tensors before RoPE.
FUSES = {("triton", "decode")}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference: x [N, H, D], cos/sin [N, 1, D] in x's dtype -> x * cos + roll(x, D / 2) * sin [N, H, D]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def _launchable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the rotate kernel takes these tensors: one dtype, unit stride in D, and D a power of two (its row is
    one tl.arange tile; FA2 and FlashInfer take head dims such as 80 or 96, which the reference rotates)."""
    D = q.shape[-1]
    tiles = D & (D - 1) == 0
    return tiles and q.dtype == k.dtype and q.stride(-1) == k.stride(-1) == 1 and _attn_triton.kernels() is not None


def _one_launch(q: torch.Tensor, k: torch.Tensor) -> bool:
    return q.is_cuda and _launchable(q, k)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(rope(q), rope(k)), fresh contiguous tensors: q [N, Hq, D], k [N, Hkv, D] (rows of any stride); cos/sin
    [N, D] (unit stride in D)."""
    if not _one_launch(q, k):
        return apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    qo = torch.empty(N, Hq, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(N, Hkv, D, dtype=k.dtype, device=k.device)
    if N:
        with torch.cuda.device(q.device):
            _attn_triton.kernels().rotate[(N, Hq + Hkv)](
                q, k, qo, ko, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), Hq, D=D,
                PTX=True, num_warps=1,
            )  # fmt: skip
    return qo, ko
