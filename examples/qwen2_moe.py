"""Qwen2-MoE (and Mixtral) as one pure decoder step: examples/llama.py's decoder with a MoE break per layer.

A MoE layer's MLP is one call of the break `torch.ops.fgraph.moe` (router, experts, shared expert: see
fgraph/ops/moe.py), passed to `llama.forward` as its `mlp` hook; its `backend` is a static model option
(`MoEConfig.moe_backend`), so the trace sees it and fgraph's split rule decides per backend: local/allgather
stay inside full graphs, all2all (host-synced token counts) is cut out and the step is captured piecewise
around it. Layers listed in `mlp_only_layers` (Qwen2-MoE) keep a dense gated MLP. HF transformers'
modeling_qwen2_moe.py / modeling_mixtral.py are the numerical references (tests/examples/test_moe_model.py).
`python -m examples.generate` runs these models: it picks this loader by the checkpoint's architecture.

  python -m examples.generate --preset tiny-moe    # embedded tiny random MoE (= python -m examples.qwen2_moe)
  python -m examples.generate --model ~/Qwen1.5-MoE-A2.7B --prompt "Hello" --greedy --moe-backend local
  python -m examples.generate --preset tiny-moe --moe-backend all2all --mode FULL --explain  # -> piecewise
"""

from __future__ import annotations

import functools

import attrs
import torch

import fgraph
from fgraph.ops import attention as A
from fgraph.ops.moe import MoEWeights, moe

from . import checkpoint, engine, hf_config, llama
from .layers import gated_mlp, rope_inv_freq


@attrs.frozen
class MoEConfig(llama.LlamaConfig):
    """A LlamaConfig (attention, dense MLP of mlp_only layers) plus the MoE shape. Frozen: closed over."""

    num_experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 128
    shared_intermediate: int = 0  # 0: no shared expert (Mixtral)
    shared_gate: bool = True  # Qwen2-MoE's sigmoid(shared_expert_gate . x) on the shared expert
    renormalize: bool = False  # norm_topk_prob (Qwen2-MoE); always True for Mixtral
    scoring: str = "softmax"
    mlp_only_layers: tuple[int, ...] = ()
    moe_backend: str = "local"  # fgraph.ops.moe backend: local | allgather | all2all

    def is_moe(self, i: int) -> bool:
        return i not in self.mlp_only_layers


presets = {
    "tiny-moe": dict(
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
        max_seq_len=4096,
        num_experts=8,
        top_k=2,
        moe_intermediate=128,
        shared_intermediate=256,
    ),
    "qwen1.5-moe-a2.7b": dict(
        dim=2048,
        n_layers=24,
        n_heads=16,
        n_kv_heads=16,
        head_dim=128,
        intermediate=5632,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1e6,
        qkv_bias=True,
        max_seq_len=8192,
        num_experts=60,
        top_k=4,
        moe_intermediate=1408,
        shared_intermediate=5632,
    ),
}


def preset(name: str, **overrides) -> MoEConfig:
    if name not in presets:
        raise fgraph.FgraphError(f"unknown MoE preset {name!r}", f"pick one of {sorted(presets)}")
    return MoEConfig(**{**presets[name], **overrides})


@fgraph.register
@attrs.define
class MoELayer:
    attn_norm: torch.Tensor  # [dim]
    wqkv: torch.Tensor  # [(Hq + 2*Hkv) * D, dim]
    bqkv: torch.Tensor | None  # [(Hq + 2*Hkv) * D] (Qwen2-MoE) or None (Mixtral)
    wo: torch.Tensor  # [dim, Hq * D]
    mlp_norm: torch.Tensor  # [dim]
    moe: MoEWeights | None  # MoE layers: router, experts (this rank's for EP backends), shared expert
    w13: torch.Tensor | None = None  # mlp_only layers: [2 * inter, dim]
    w2: torch.Tensor | None = None  # mlp_only layers: [dim, inter]


def _ep(cfg: MoEConfig) -> tuple[int, int]:
    """(rank, world) the experts are sharded over: the default process group for EP backends."""
    if cfg.moe_backend != "local" and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def init_params(cfg: MoEConfig, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> llama.Params:
    """Random weights (std 0.02 like HF's init, norms at 1); EP backends keep only this rank's experts."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=g)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    E, I, Is, dim = cfg.num_experts, cfg.moe_intermediate, cfg.shared_intermediate, cfg.dim
    layers = []
    for i in range(cfg.n_layers):
        attn = dict(
            attn_norm=ones(dim),
            wqkv=rand(cfg.qkv_dim, dim),
            bqkv=rand(cfg.qkv_dim) if cfg.qkv_bias else None,
            wo=rand(dim, cfg.n_heads * cfg.head_dim),
            mlp_norm=ones(dim),
        )
        if not cfg.is_moe(i):
            layers.append(
                MoELayer(**attn, moe=None, w13=rand(2 * cfg.intermediate, dim), w2=rand(dim, cfg.intermediate))
            )
            continue
        w = MoEWeights(
            rand(E, dim),
            rand(E, 2 * I, dim),
            rand(E, dim, I),
            rand(2 * Is, dim) if Is else None,
            rand(dim, Is) if Is else None,
            rand(1, dim) if Is and cfg.shared_gate else None,
            top_k=cfg.top_k,
            scoring=cfg.scoring,
            renormalize=cfg.renormalize,
        )
        layers.append(MoELayer(**attn, moe=w.shard(*_ep(cfg))))
    return llama.Params(
        embed=rand(cfg.vocab_size, dim),
        layers=layers,
        norm=ones(dim),
        lm_head=None if cfg.tie_embeddings else rand(cfg.vocab_size, dim),
        inv_freq=rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device),
    )


def forward(
    cfg: MoEConfig,
    params: llama.Params,
    cache: A.KVCache,
    batch: llama.Batch,
    routine: str = "mixed",
    backend: str = "torch",
    max_seq_len: int | None = None,
):
    """One step over N new tokens -> (logits [N, V], cache): llama's step with the MoE block as its MLP."""

    def mlp(layer: MoELayer, h: torch.Tensor) -> torch.Tensor:  # h: [N, dim] -> [N, dim]
        return moe(h, layer.moe, cfg.moe_backend) if layer.moe is not None else gated_mlp(h, layer.w13, layer.w2)

    return llama.forward(cfg, params, cache, batch, routine, backend, max_seq_len, mlp=mlp)


def make_step(cfg: MoEConfig, backend: str = "torch", max_seq_len: int | None = None):
    """`step(params, cache, batch, routine)` with the config (MoE backend included) closed over."""

    def step(params: llama.Params, cache: A.KVCache, batch: llama.Batch, routine: str = "mixed"):
        return forward(cfg, params, cache, batch, routine, backend, max_seq_len)

    return step


def build(cfg: MoEConfig, params: llama.Params, **kw) -> engine.Engine:
    """examples.engine.build for this model (same cache sizing; the step is this module's). Under expert
    parallelism (an EP backend in a process group of several ranks) each rank serves its own requests through
    ep.EPEngine, which keeps the ranks' steps paired and their signatures equal (see there)."""
    if _ep(cfg)[1] > 1:
        from . import ep, tp

        kw["cls"] = functools.partial(ep.EPEngine, tp=tp.init())
    return engine.build(cfg, params, make_step=make_step, **kw)


# ------------------------------------------------------------------------------------------------ checkpoints
# architecture -> (MoE block prefix, names of expert i's gate/up/down, router, experts key); the attention part of
# each is read by hf_config's family of the same name
ARCHITECTURES = {
    "Qwen2MoeForCausalLM": dict(
        block="mlp", expert=("gate_proj", "up_proj", "down_proj"), router="gate", experts="num_experts"
    ),
    "MixtralForCausalLM": dict(
        block="block_sparse_moe", expert=("w1", "w3", "w2"), router="gate", experts="num_local_experts"
    ),
}


def read_config(model_dir: str, moe_backend: str = "local") -> MoEConfig:
    """config.json of a Qwen2-MoE or Mixtral directory -> MoEConfig (attention keys through checkpoint's)."""
    path = f"{model_dir}/config.json"
    c = checkpoint.read_json(path)
    arch = (c.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise checkpoint.CheckpointError(
            f"{path}: architecture {arch!r} is not a supported MoE",
            f"supported: {', '.join(sorted(ARCHITECTURES))} (dense ones: examples.checkpoint)",
        )
    a, k = ARCHITECTURES[arch], hf_config.Keys(c, path)
    qwen = arch.startswith("Qwen2Moe")
    # Mixtral's intermediate_size is its experts'; Qwen2-MoE's that of its dense layers (none, maybe): read below
    base = checkpoint.llama_config(dict(c, intermediate_size=c.get("intermediate_size") or 1), path, arch)
    experts = a["experts"]
    for key in (experts, "num_experts_per_tok", "moe_intermediate_size" if qwen else "intermediate_size"):
        if not isinstance(c.get(key), int) or isinstance(c[key], bool):
            raise k.error(f"key {key!r} is missing or not an integer", "use the config.json saved with the checkpoint")
    if c["num_experts_per_tok"] > c[experts] and c[experts] > 0:
        raise k.error(f"num_experts_per_tok={c['num_experts_per_tok']} is more than the {c[experts]} experts")
    step, only = (k.positive("decoder_sparse_step", 1), c.get("mlp_only_layers") or []) if qwen else (1, [])
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise k.error(f"mlp_only_layers={only!r} is not a list of layer indices")
    dense = tuple(i for i in range(base.n_layers) if i in only or (i + 1) % step != 0)
    if qwen and c[experts] == 0:
        dense = tuple(range(base.n_layers))
    return MoEConfig(
        **attrs.asdict(base, recurse=False),
        num_experts=c[experts],
        top_k=c["num_experts_per_tok"],
        moe_intermediate=c["moe_intermediate_size"] if qwen else c["intermediate_size"],
        # transformers' default where the key is left out: a shared expert the weights must then hold
        shared_intermediate=k.positive("shared_expert_intermediate_size", 5632) if qwen else 0,
        renormalize=k.flag("norm_topk_prob") if qwen else True,
        mlp_only_layers=dense,
        moe_backend=moe_backend,
    )


def load(
    model_dir: str,
    dtype=None,
    device="cpu",
    moe_backend: str = "local",
    allow_unused: bool = False,
    check_finite: bool = True,
) -> tuple[MoEConfig, llama.Params]:
    """A HF Qwen2-MoE / Mixtral directory -> (config, params). EP backends read only this rank's experts.
    Experts may be stored per expert (hub format) or fused (`experts.gate_up_proj` / `experts.down_proj`).
    allow_unused, check_finite: see checkpoint.Tensors (every tensor must be used, every weight finite)."""
    cfg = read_config(model_dir, moe_backend)
    arch = checkpoint.architecture(model_dir)
    a, dtype = ARCHITECTURES[arch], checkpoint.dtype_of(dtype, model_dir)
    ts = checkpoint.Tensors(model_dir, device, check_finite)
    checkpoint.check_layout(ts, cfg, arch, f"{model_dir}/config.json")
    dim, E, I, Is = cfg.dim, cfg.num_experts, cfg.moe_intermediate, cfg.shared_intermediate
    rank, world = _ep(cfg)
    if E % world:
        raise checkpoint.CheckpointError(
            f"{model_dir}: {E} experts do not split over {world} ranks",
            "use a world size that divides the number of experts, or moe_backend='local'",
        )
    mine = range(rank * E // world, (rank + 1) * E // world)

    def get(name, *shape):
        return ts.get(name, shape, dtype)

    def layer(i):
        attn = checkpoint.attention_weights(ts, cfg, i, dtype)
        if not cfg.is_moe(i):
            return MoELayer(
                **attn,
                moe=None,
                **checkpoint.gated_mlp_weights(ts, f"model.layers.{i}.mlp.", cfg.intermediate, dim, dtype),
            )
        m = f"model.layers.{i}.{a['block']}."
        g, u, d = a["expert"]
        if m + "experts.gate_up_proj" in ts:  # fused layout (transformers >= 5 in memory)
            w13 = get(m + "experts.gate_up_proj", E, 2 * I, dim)[mine.start : mine.stop].contiguous()
            w2 = get(m + "experts.down_proj", E, dim, I)[mine.start : mine.stop].contiguous()
        else:
            w13 = torch.stack(
                [
                    torch.cat([get(f"{m}experts.{e}.{g}.weight", I, dim), get(f"{m}experts.{e}.{u}.weight", I, dim)])
                    for e in mine
                ]
            )
            w2 = torch.stack([get(f"{m}experts.{e}.{d}.weight", dim, I) for e in mine])
            for e in set(range(E)) - set(mine):  # the other ranks' experts: theirs to read
                for w in (g, u, d):
                    ts.skip(f"{m}experts.{e}.{w}.weight")
        shared = (None, None, None)
        if Is:
            sw = checkpoint.gated_mlp_weights(ts, m + "shared_expert.", Is, dim, dtype)
            shared = (sw["w13"], sw["w2"], get(m + "shared_expert_gate.weight", 1, dim) if cfg.shared_gate else None)
        w = MoEWeights(
            get(m + a["router"] + ".weight", E, dim),
            w13,
            w2,
            *shared,
            top_k=cfg.top_k,
            scoring=cfg.scoring,
            renormalize=cfg.renormalize,
        )
        return MoELayer(**attn, moe=w)

    params = checkpoint.assemble(ts, cfg, dtype, device, layer)
    ts.finish(allow_unused)
    return cfg, params


if __name__ == "__main__":  # the former command, kept: examples.generate runs MoE models now (tiny-moe by default)
    import sys

    from . import generate

    argv = sys.argv[1:]
    generate.main(argv if {"--model", "--preset"} & set(argv) else ["--preset", "tiny-moe", *argv])
