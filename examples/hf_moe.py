"""Hugging Face Qwen2-MoE blocks through fgraph's MoE primitive (`fgraph.ops.moe`, a break) instead of transformers' own
experts code.

`use_fgraph_moe(model)` swaps each `Qwen2MoeSparseMoeBlock`'s forward, in place, for one call of the primitive over
the block's own weights: the router, the experts' fused `gate_up_proj` [E, 2*inter, dim] and `down_proj`
[E, dim, inter] as they are, and the shared expert's gate and up projections made one [2*inter_s, dim] weight whose
halves the block's own Linear layers then view (no second copy). The math is transformers': routing in the hidden
dtype, scores in float32, top-k, renormalised where the config says so; the shared expert gated by a sigmoid.
"""

from __future__ import annotations

import types

import torch

from fgraph.ops.moe import MoEWeights, moe


def _forward(block, hidden_states: torch.Tensor) -> torch.Tensor:
    """hidden_states [B, S, dim] -> [B, S, dim]: the block's routed experts plus its gated shared expert."""
    b, s, d = hidden_states.shape
    e, sh = block.experts, block.shared_expert
    w = MoEWeights(
        router=block.gate.weight,
        w13=e.gate_up_proj,
        w2=e.down_proj,
        shared_w13=block._fgraph_shared_w13,
        shared_w2=sh.down_proj.weight,
        shared_gate=block.shared_expert_gate.weight,
        top_k=block.gate.top_k,
        scoring="softmax",
        renormalize=bool(block.gate.norm_topk_prob),
    )
    return moe(hidden_states.reshape(-1, d), w).reshape(b, s, d)


def is_moe_block(m: torch.nn.Module) -> bool:
    """A transformers Qwen2-MoE sparse block with fused experts (transformers >= 5)."""
    return all(hasattr(m, a) for a in ("gate", "experts", "shared_expert", "shared_expert_gate")) and hasattr(
        m.experts, "gate_up_proj"
    )


def use_fgraph_moe(model: torch.nn.Module) -> int:
    """Route every Qwen2-MoE block of `model` through fgraph's MoE primitive; returns how many were swapped."""
    n = 0
    for m in model.modules():
        if not is_moe_block(m) or "_fgraph_shared_w13" in m._buffers:
            continue
        sh = m.shared_expert
        g, u = sh.gate_proj.weight, sh.up_proj.weight
        with torch.no_grad():
            w13 = torch.cat([g, u])  # [2*inter_s, dim]: gate rows, then up rows
        m.register_buffer("_fgraph_shared_w13", w13, persistent=False)
        # the Linear layers view the fused weight: one copy of the shared expert in memory, as before
        sh.gate_proj.weight = torch.nn.Parameter(w13[: g.shape[0]], requires_grad=g.requires_grad)
        sh.up_proj.weight = torch.nn.Parameter(w13[g.shape[0] :], requires_grad=u.requires_grad)
        m.forward = types.MethodType(_forward, m)
        n += 1
    return n
