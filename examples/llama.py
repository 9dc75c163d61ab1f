"""Llama 2/3 and Qwen2/2.5 as one pure decoder step over a parameter pytree and a paged KV-cache pytree.

Qwen2 is Llama plus a bias on q/k/v (and, on small sizes, an lm_head tied to the embedding), so both are
`LlamaConfig`s. The step is a pure function: it takes every tensor it reads as an argument and writes only
the KV cache (inside the attention op), so `fgraph.jit` can trace and capture it, and calling it directly is
the eager oracle. References: gpt-fast's model.py, HF transformers' modeling_llama.py / modeling_qwen2.py.
"""

from __future__ import annotations

import attrs
import torch

import fgraph
from fgraph.ops import attention as A

from .layers import RopeScaling, apply_rope, embed, gated_mlp, linear, lm_head, rms_norm, rope_cos_sin, rope_inv_freq


@attrs.frozen
class LlamaConfig:
    """Static model shape. Frozen and hashable: it is closed over by the step, never traced."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8  # < n_heads: grouped-query attention
    head_dim: int = 128
    intermediate: int = 14336
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2
    tie_embeddings: bool = False
    max_seq_len: int = 8192  # max_position_embeddings

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


presets = {
    # The embedded default of `python -m examples.generate`: Qwen-shaped, small enough for any CPU, with
    # head_dim 64 so that every GPU attention backend has kernels for it.
    "tiny": dict(
        dim=256,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        intermediate=512,
        vocab_size=1024,
        norm_eps=1e-6,
        rope_theta=1e6,
        qkv_bias=True,
        tie_embeddings=True,
        max_seq_len=4096,
    ),
    "qwen2.5-0.5b": dict(
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        head_dim=64,
        intermediate=4864,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1e6,
        qkv_bias=True,
        tie_embeddings=True,
        max_seq_len=32768,
    ),
    "llama3-8b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        intermediate=14336,
        vocab_size=128256,
        norm_eps=1e-5,
        rope_theta=500000.0,
        max_seq_len=131072,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
    ),
}


def preset(name: str) -> LlamaConfig:
    if name not in presets:
        raise fgraph.FgraphError(f"unknown preset {name!r}", f"pick one of {sorted(presets)}")
    return LlamaConfig(**presets[name])


@fgraph.register
@attrs.frozen  # frozen (and layers a tuple): fgraph's replay path proves an immutable tree unchanged by identity alone
class Layer:
    attn_norm: torch.Tensor  # [dim]
    wqkv: torch.Tensor  # [(Hq + 2*Hkv) * D, dim]: q, k, v rows fused at load time
    bqkv: torch.Tensor | None  # [(Hq + 2*Hkv) * D] (Qwen2) or None
    wo: torch.Tensor  # [dim, Hq * D]
    mlp_norm: torch.Tensor  # [dim]
    w13: torch.Tensor  # [2 * inter, dim]: gate rows then up rows
    w2: torch.Tensor  # [dim, inter]


@fgraph.register
@attrs.frozen
class Params:
    embed: torch.Tensor  # [V, dim]
    layers: tuple[Layer, ...] = attrs.field(converter=tuple)
    norm: torch.Tensor  # [dim]
    lm_head: torch.Tensor | None  # [V, dim], None when tied to `embed`
    inv_freq: torch.Tensor  # [D/2] float32 RoPE frequencies (scaling applied)


@fgraph.register
@attrs.define
class Batch:
    tokens: torch.Tensor  # [N] int64: the new tokens of every scheduled sequence, back to back
    positions: torch.Tensor  # [N] int64: their positions in their sequences
    meta: A.AttentionMetadata  # where each sequence's queries start, its KV length and its pages


def init_params(cfg: LlamaConfig, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> Params:
    """Random weights (normal, std 0.02 like HF's init; norms at 1), generated on `device` in `dtype`."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=g)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    layers = [
        Layer(
            attn_norm=ones(cfg.dim),
            wqkv=rand(cfg.qkv_dim, cfg.dim),
            bqkv=rand(cfg.qkv_dim) if cfg.qkv_bias else None,
            wo=rand(cfg.dim, cfg.n_heads * cfg.head_dim),
            mlp_norm=ones(cfg.dim),
            w13=rand(2 * cfg.intermediate, cfg.dim),
            w2=rand(cfg.dim, cfg.intermediate),
        )
        for _ in range(cfg.n_layers)
    ]
    return Params(
        embed=rand(cfg.vocab_size, cfg.dim),
        layers=layers,
        norm=ones(cfg.dim),
        lm_head=None if cfg.tie_embeddings else rand(cfg.vocab_size, cfg.dim),
        inv_freq=rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device),
    )


def init_cache(cfg: LlamaConfig, num_pages: int, page_size: int, dtype, device) -> A.KVCache:
    """The paged KV cache: per layer k/v [num_pages, page_size, Hkv, D]; page 0 is the scratch page."""
    return A.KVCache.allocate(cfg.n_layers, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim, dtype, device)


def forward(
    cfg: LlamaConfig,
    params: Params,
    cache: A.KVCache,
    batch: Batch,
    routine: str = "mixed",
    backend: str = "torch",
    max_seq_len: int | None = None,
    mlp=None,
    tp=None,
    fuse_rope: bool | str = True,
):
    """One step over N new tokens of S sequences -> (logits [N, V] in the model dtype, cache with their k/v written).

    mlp: None for the dense gated MLP of `layer.w13`/`layer.w2`, or `(layer, h [N, dim]) -> [N, dim]` reading its
      weights from `layer` (examples/qwen2_moe.py's MoE block); the attention block is the same for every model.
    tp: None, or this rank's `examples.tp.TP`. Then cfg and params are the rank's shard (its q/kv heads, MLP
      columns and vocab rows) and tp adds the collectives: vocab-parallel embedding, an all-reduce of the
      attention and MLP outputs (partial sums over this rank's heads / columns), an all-gather of the logits.
    fuse_rope: where attention rotates q and k inside its break (`rope=`), so that no kernel between the qkv matmul
      and the break does: True (every step: both routines then share their compiled pieces), "decode" (decode steps
      only) or False (none: rotated here first). The same numbers either way (docs/performance.md).
    """
    tokens, positions = batch.tokens, batch.positions  # [N], [N]
    assert tokens.ndim == 1 and positions.shape == tokens.shape, (tokens.shape, positions.shape)
    N, Hq, Hkv, D = tokens.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    reduce = tp.all_reduce if tp is not None else (lambda y: y)
    x = embed(tokens, params.embed) if tp is None else tp.embed(tokens, params.embed)  # [N, dim]
    cos, sin = rope_cos_sin(params.inv_freq, positions, x.dtype)  # [N, 1, D] each (sin signed for apply_rope)

    @fgraph.repeated  # every tensor through the arguments: traced once per layer kind, copied for the rest
    def block(layer, k_cache, v_cache, x, cos, sin, meta):  # one decoder layer: [N, dim] -> [N, dim]
        qkv = linear(rms_norm(x, layer.attn_norm, cfg.norm_eps), layer.wqkv, layer.bqkv)  # [N, (Hq+2Hkv)*D]
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        if fuse_rope is True or fuse_rope == routine:  # views of qkv; attention rotates q and k in its break
            q, k, v, rope = q.view(N, Hq, D), k.view(N, Hkv, D), v.view(N, Hkv, D), (cos, sin)
        else:
            # k (roped) and v in one fresh tensor (one kernel under Inductor): attention takes them as strided views
            # of it (a .contiguous() would ask whether N == 1: a trace per bucket 1).
            q, rope = apply_rope(q.view(N, Hq, D), cos, sin), None  # [N, Hq, D]
            kv = torch.cat([apply_rope(k.view(N, Hkv, D), cos, sin), v.view(N, Hkv, D)], dim=1)  # [N, 2 Hkv, D]
            k, v = kv[:, :Hkv], kv[:, Hkv:]
        o = A.attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta,
            scale=D**-0.5,
            backend=backend,
            routine=routine,
            max_seq_len=max_seq_len or cfg.max_seq_len,
            rope=rope,
        )  # [N, Hq, D]
        x = x + reduce(linear(o.reshape(N, Hq * D), layer.wo))
        h = rms_norm(x, layer.mlp_norm, cfg.norm_eps)  # [N, dim]
        return x + reduce(gated_mlp(h, layer.w13, layer.w2) if mlp is None else mlp(layer, h))

    for i, layer in enumerate(params.layers):
        x = block(layer, cache.k[i], cache.v[i], x, cos, sin, batch.meta)
    x = rms_norm(x, params.norm, cfg.norm_eps)
    w = params.embed if params.lm_head is None else params.lm_head  # [V, dim] (this rank's rows under tp)
    return (lm_head(x, w) if tp is None else tp.lm_head(x, w, cfg.vocab_size)), cache


def make_step(
    cfg: LlamaConfig, backend: str = "torch", max_seq_len: int | None = None, tp=None, fuse_rope: bool | str = True
):
    """`step(params, cache, batch, routine)`: the contract's pure step, with config, backend and tp closed over."""

    def step(params: Params, cache: A.KVCache, batch: Batch, routine: str = "mixed"):
        return forward(cfg, params, cache, batch, routine, backend, max_seq_len, tp=tp, fuse_rope=fuse_rope)

    return step
