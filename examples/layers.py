"""Blocks shared by every example model: RMSNorm, RoPE (incl. Llama-3 scaling), gated MLP, embedding, head.

Plain functions over tensors (no nn.Module, no hidden state), written to match Hugging Face transformers'
Llama/Qwen2 numerics op for op, so float32 logits agree to ~1e-6. Shapes: N tokens, H heads, D head dim.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F

from fgraph.ops import attention as A


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [N, dim]. Normalise in float32, cast back before the weight (HF does the same, so bf16 rounds alike).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    # x: [N, in], w: [out, in] (torch/HF layout), b: [out] or None -> [N, out]
    return F.linear(x, w, b)


def gated_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    # x: [N, dim], w13: [2*inter, dim] (gate rows then up rows, fused at load time), w2: [dim, inter]
    gate, up = linear(x, w13).chunk(2, dim=-1)  # [N, inter] each
    return linear(F.silu(gate) * up, w2)


def embed(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # tokens: [N] int64, table: [V, dim] -> [N, dim]
    return F.embedding(tokens, table)


def lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # x: [N, dim], w: [V, dim] (the embedding table when tied) -> logits [N, V] in the model's dtype. An upcast here
    # adds no precision (the matmul rounded already) but doubles the largest output every signature keeps in its
    # graph pool (512 x 152K float32 = 311 MB on Qwen2.5); sampling upcasts the rows it samples.
    return linear(x, w)


@attrs.frozen
class RopeScaling:
    """`rope_scaling` of a HF config. Frozen, so it can live in a static model config."""

    type: str = "llama3"  # "linear" or "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] float32, computed on the CPU exactly as HF does (then moved by the caller)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type != "llama3":
        raise ValueError(f"rope scaling type {scaling.type!r} is not supported (supported: linear, llama3)")
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    s, old = scaling, scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    # inv_freq: [D/2] float32, positions: [N] int64 -> cos, signed sin: [N, 1, D] in `dtype`, once per step.
    # Computed from positions (no table, so no max length); angles in float32 as in HF. The sin's first half is
    # negated so that apply_rope's rotation is one roll (see there).
    freqs = positions[:, None].float() * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    sin = emb.sin()
    signed = torch.cat((-sin[:, : freqs.shape[1]], sin[:, freqs.shape[1] :]), dim=-1)
    return emb.cos().to(dtype)[:, None, :], signed.to(dtype)[:, None, :]


# x [N, H, D]; cos/signed_sin [N, 1, D] (rope_cos_sin) -> x * cos + roll(x, D/2) * signed_sin: HF's "rotate half"
# layout (checkpoints are stored permuted for it), x * cos + cat(-x2, x1) * sin written as one roll with the sin's
# first half negated, the same arithmetic (a sign flip is exact) in one op instead of chunk + neg + cat: half the
# nodes to trace and fewer eager kernels. attention(..., rope=(cos, sin)) applies the same rotation in its break.
apply_rope = A.apply_rope
