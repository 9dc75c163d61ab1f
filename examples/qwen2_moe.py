"""Qwen2-MoE (and Mixtral) as one pure decoder step: the Llama/Qwen2 attention block + a MoE break per layer.

A MoE layer's MLP is one call of the break `torch.ops.fgraph.moe` (router, experts, shared expert: see
fgraph/ops/moe.py); its `backend` is a static model option (`MoEConfig.moe_backend`), so the trace sees it
and fgraph's split rule decides per backend: local/allgather stay inside full graphs, all2all (host-synced
token counts) is cut out and the step is captured piecewise around it. Layers listed in `mlp_only_layers`
(Qwen2-MoE) keep a dense gated MLP. HF transformers' modeling_qwen2_moe.py / modeling_mixtral.py are the
numerical references (tests/test_moe_model.py).

  python -m examples.qwen2_moe                                  # embedded tiny random MoE, CPU or GPU
  python -m examples.qwen2_moe --model ~/Qwen1.5-MoE-A2.7B --prompt "Hello" --greedy --moe-backend local
  python -m examples.qwen2_moe --moe-backend all2all --mode FULL --explain   # FULL resolves to piecewise
Every other flag is `python -m examples.generate`'s.
"""
from __future__ import annotations

import argparse
import math

import attrs
import torch

import fgraph
from fgraph.ops import attention as A
from fgraph.ops.moe import MoEWeights, moe

from . import checkpoint, engine, llama
from .layers import apply_rope, embed, gated_mlp, linear, lm_head, rms_norm, rope_cos_sin, rope_inv_freq


@attrs.frozen
class MoEConfig(llama.LlamaConfig):
  """A LlamaConfig (attention, dense MLP of mlp_only layers) plus the MoE shape. Frozen: closed over."""
  num_experts: int = 8
  top_k: int = 2
  moe_intermediate: int = 128
  shared_intermediate: int = 0        # 0: no shared expert (Mixtral)
  shared_gate: bool = True            # Qwen2-MoE's sigmoid(shared_expert_gate . x) on the shared expert
  renormalize: bool = False           # norm_topk_prob (Qwen2-MoE); always True for Mixtral
  scoring: str = "softmax"
  mlp_only_layers: tuple[int, ...] = ()
  moe_backend: str = "local"          # fgraph.ops.moe backend: local | allgather | all2all

  def is_moe(self, i: int) -> bool:
    return i not in self.mlp_only_layers


presets = {
  "tiny-moe": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, intermediate=512, vocab_size=1024,
                   norm_eps=1e-6, rope_theta=1e6, qkv_bias=True, max_seq_len=4096, num_experts=8, top_k=2,
                   moe_intermediate=128, shared_intermediate=256),
  "qwen1.5-moe-a2.7b": dict(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, head_dim=128, intermediate=5632,
                            vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qkv_bias=True, max_seq_len=8192,
                            num_experts=60, top_k=4, moe_intermediate=1408, shared_intermediate=5632),
}


def preset(name: str, **overrides) -> MoEConfig:
  if name not in presets:
    raise fgraph.FgraphError(f"unknown MoE preset {name!r}", f"pick one of {sorted(presets)}")
  return MoEConfig(**{**presets[name], **overrides})


@fgraph.register
@attrs.define
class MoELayer:
  attn_norm: torch.Tensor          # [dim]
  wqkv: torch.Tensor               # [(Hq + 2*Hkv) * D, dim]
  bqkv: torch.Tensor | None        # [(Hq + 2*Hkv) * D] (Qwen2-MoE) or None (Mixtral)
  wo: torch.Tensor                 # [dim, Hq * D]
  mlp_norm: torch.Tensor           # [dim]
  moe: MoEWeights | None           # MoE layers: router, experts (this rank's for EP backends), shared expert
  w13: torch.Tensor | None = None  # mlp_only layers: [2 * inter, dim]
  w2: torch.Tensor | None = None   # mlp_only layers: [dim, inter]


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
    attn = dict(attn_norm=ones(dim), wqkv=rand(cfg.qkv_dim, dim), bqkv=rand(cfg.qkv_dim) if cfg.qkv_bias else None,
                wo=rand(dim, cfg.n_heads * cfg.head_dim), mlp_norm=ones(dim))
    if not cfg.is_moe(i):
      layers.append(MoELayer(**attn, moe=None, w13=rand(2 * cfg.intermediate, dim), w2=rand(dim, cfg.intermediate)))
      continue
    w = MoEWeights(rand(E, dim), rand(E, 2 * I, dim), rand(E, dim, I), rand(2 * Is, dim) if Is else None,
                   rand(dim, Is) if Is else None, rand(1, dim) if Is and cfg.shared_gate else None,
                   top_k=cfg.top_k, scoring=cfg.scoring, renormalize=cfg.renormalize)
    layers.append(MoELayer(**attn, moe=w.shard(*_ep(cfg))))
  return llama.Params(embed=rand(cfg.vocab_size, dim), layers=layers, norm=ones(dim),
                      lm_head=None if cfg.tie_embeddings else rand(cfg.vocab_size, dim),
                      inv_freq=rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device))


def forward(cfg: MoEConfig, params: llama.Params, cache: A.KVCache, batch: llama.Batch, routine: str = "mixed",
            backend: str = "torch", max_seq_len: int | None = None):
  """One step over N new tokens -> (logits [N, V] float32, cache). Attention exactly as examples/llama.py."""
  tokens, positions = batch.tokens, batch.positions  # [N], [N]
  N, Hq, Hkv, D = tokens.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  x = embed(tokens, params.embed)  # [N, dim]
  cos, sin = rope_cos_sin(params.inv_freq, positions, x.dtype)  # [N, D] each
  for i, layer in enumerate(params.layers):
    qkv = linear(rms_norm(x, layer.attn_norm, cfg.norm_eps), layer.wqkv, layer.bqkv)  # [N, (Hq+2Hkv)*D]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = apply_rope(q.view(N, Hq, D), cos, sin)  # [N, Hq, D]
    k = apply_rope(k.view(N, Hkv, D), cos, sin)  # [N, Hkv, D]
    o = A.attention(q, k, v.view(N, Hkv, D), cache.k[i], cache.v[i], batch.meta, scale=D ** -0.5,
                    backend=backend, routine=routine, max_seq_len=max_seq_len or cfg.max_seq_len)  # [N, Hq, D]
    x = x + linear(o.reshape(N, Hq * D), layer.wo)
    h = rms_norm(x, layer.mlp_norm, cfg.norm_eps)  # [N, dim]
    x = x + (moe(h, layer.moe, cfg.moe_backend) if layer.moe is not None else gated_mlp(h, layer.w13, layer.w2))
  x = rms_norm(x, params.norm, cfg.norm_eps)
  return lm_head(x, params.embed if params.lm_head is None else params.lm_head), cache


def make_step(cfg: MoEConfig, backend: str = "torch", max_seq_len: int | None = None):
  """`step(params, cache, batch, routine)` with the config (MoE backend included) closed over."""
  def step(params: llama.Params, cache: A.KVCache, batch: llama.Batch, routine: str = "mixed"):
    return forward(cfg, params, cache, batch, routine, backend, max_seq_len)
  return step


def build(cfg: MoEConfig, params: llama.Params, *, backend: str = "auto", max_seqs: int = 64,
          max_seq_len: int = 2048, page_size: int | None = None, num_pages: int | None = None,
          **kw) -> engine.Engine:
  """examples.engine.build for this model (same cache sizing; the step is this module's)."""
  device = params.embed.device
  backend = A.resolve_backend(backend, device)
  page_size = page_size or A.page_size_for(backend)
  max_seq_len = min(max_seq_len, cfg.max_seq_len)
  num_pages = num_pages or max_seqs * math.ceil(max_seq_len / page_size) + 1  # + the scratch page
  cache = llama.init_cache(cfg, num_pages, page_size, params.embed.dtype, device)
  step = make_step(cfg, backend, max_seq_len)
  return engine.Engine(step, params, cache, max_seq_len=max_seq_len, max_seqs=max_seqs,
                       vocab_size=cfg.vocab_size, **kw)


# ------------------------------------------------------------------------------------------------ checkpoints
# architecture -> (MoE block prefix, names of expert i's gate/up/down, router, config keys, fixed options)
_ARCH = {
  "Qwen2MoeForCausalLM": dict(block="mlp", expert=("gate_proj", "up_proj", "down_proj"), router="gate",
                              experts="num_experts", qkv_bias=True),
  "MixtralForCausalLM": dict(block="block_sparse_moe", expert=("w1", "w3", "w2"), router="gate",
                             experts="num_local_experts", qkv_bias=False),
}


def read_config(model_dir: str, moe_backend: str = "local") -> MoEConfig:
  """config.json of a Qwen2-MoE or Mixtral directory -> MoEConfig (attention keys through checkpoint's)."""
  path = f"{model_dir}/config.json"
  c = checkpoint._read_json(path)
  arch = (c.get("architectures") or [None])[0]
  if arch not in _ARCH:
    raise checkpoint.CheckpointError(f"{path}: architecture {arch!r} is not a supported MoE",
                                     f"supported: {', '.join(sorted(_ARCH))} (dense ones: examples.checkpoint)")
  a = _ARCH[arch]
  qwen = arch.startswith("Qwen2Moe")
  base = checkpoint._llama_config(dict(c, intermediate_size=c.get("intermediate_size") or 1), path,
                                  qkv_bias=a["qkv_bias"] and c.get("qkv_bias", True))
  step = c.get("decoder_sparse_step", 1) if qwen else 1
  dense = tuple(i for i in range(base.n_layers)
                if (qwen and i in (c.get("mlp_only_layers") or [])) or (i + 1) % step != 0)
  if qwen and c.get("num_experts", 0) == 0:
    dense = tuple(range(base.n_layers))
  return MoEConfig(**attrs.asdict(base, recurse=False), num_experts=c[a["experts"]], top_k=c["num_experts_per_tok"],
                   moe_intermediate=c["moe_intermediate_size"] if qwen else c["intermediate_size"],
                   shared_intermediate=c.get("shared_expert_intermediate_size", 0) if qwen else 0,
                   renormalize=bool(c.get("norm_topk_prob", False)) if qwen else True,
                   mlp_only_layers=dense, moe_backend=moe_backend)


def load(model_dir: str, dtype=None, device="cpu", moe_backend: str = "local") -> tuple[MoEConfig, llama.Params]:
  """A HF Qwen2-MoE / Mixtral directory -> (config, params). EP backends read only this rank's experts.
  Experts may be stored per expert (hub format) or fused (`experts.gate_up_proj` / `experts.down_proj`)."""
  cfg = read_config(model_dir, moe_backend)
  arch = checkpoint._read_json(f"{model_dir}/config.json")["architectures"][0]
  a, dtype = _ARCH[arch], checkpoint._dtype(dtype, model_dir)
  ts = checkpoint._Tensors(model_dir, device)
  D, dim, E, I, Is = cfg.head_dim, cfg.dim, cfg.num_experts, cfg.moe_intermediate, cfg.shared_intermediate
  q, kv = cfg.n_heads * D, cfg.n_kv_heads * D
  rank, world = _ep(cfg)
  if E % world:
    raise checkpoint.CheckpointError(f"{model_dir}: {E} experts do not split over {world} ranks",
                                     "use a world size that divides the number of experts, or moe_backend='local'")
  mine = range(rank * E // world, (rank + 1) * E // world)

  def get(name, *shape):
    return ts.get(name, shape, dtype)

  def layer(i):
    p = f"model.layers.{i}."
    at, m = p + "self_attn.", p + a["block"] + "."
    wqkv = torch.cat([get(at + "q_proj.weight", q, dim), get(at + "k_proj.weight", kv, dim),
                      get(at + "v_proj.weight", kv, dim)])
    bqkv = torch.cat([get(at + "q_proj.bias", q), get(at + "k_proj.bias", kv), get(at + "v_proj.bias", kv)]) \
        if cfg.qkv_bias else None
    attn = dict(attn_norm=get(p + "input_layernorm.weight", dim), wqkv=wqkv, bqkv=bqkv,
                wo=get(at + "o_proj.weight", dim, q), mlp_norm=get(p + "post_attention_layernorm.weight", dim))
    if not cfg.is_moe(i):
      w13 = torch.cat([get(p + "mlp.gate_proj.weight", cfg.intermediate, dim),
                       get(p + "mlp.up_proj.weight", cfg.intermediate, dim)])
      return MoELayer(**attn, moe=None, w13=w13, w2=get(p + "mlp.down_proj.weight", dim, cfg.intermediate))
    g, u, d = a["expert"]
    if m + "experts.gate_up_proj" in ts:  # fused layout (transformers >= 5 in memory)
      w13 = get(m + "experts.gate_up_proj", E, 2 * I, dim)[mine.start:mine.stop].contiguous()
      w2 = get(m + "experts.down_proj", E, dim, I)[mine.start:mine.stop].contiguous()
    else:
      w13 = torch.stack([torch.cat([get(f"{m}experts.{e}.{g}.weight", I, dim),
                                    get(f"{m}experts.{e}.{u}.weight", I, dim)]) for e in mine])
      w2 = torch.stack([get(f"{m}experts.{e}.{d}.weight", dim, I) for e in mine])
    shared = (None, None, None)
    if Is:
      s = m + "shared_expert."
      shared = (torch.cat([get(s + "gate_proj.weight", Is, dim), get(s + "up_proj.weight", Is, dim)]),
                get(s + "down_proj.weight", dim, Is),
                get(m + "shared_expert_gate.weight", 1, dim) if cfg.shared_gate else None)
    w = MoEWeights(get(m + a["router"] + ".weight", E, dim), w13, w2, *shared, top_k=cfg.top_k,
                   scoring=cfg.scoring, renormalize=cfg.renormalize)
    return MoELayer(**attn, moe=w)

  vd = (cfg.vocab_size, dim)
  params = llama.Params(embed=get("model.embed_tokens.weight", *vd), layers=[layer(i) for i in range(cfg.n_layers)],
                        norm=get("model.norm.weight", dim),
                        lm_head=None if cfg.tie_embeddings else get("lm_head.weight", *vd),
                        inv_freq=rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling).to(device))
  return cfg, params


# ------------------------------------------------------------------------------------------------ command
def main(argv=None) -> dict:
  """`python -m examples.generate` for MoE models: its flags, plus --moe-backend and --moe-preset."""
  from . import generate
  p = argparse.ArgumentParser(add_help=False)
  p.add_argument("--moe-backend", default="local", choices=["local", "allgather", "all2all"])
  p.add_argument("--moe-preset", default="tiny-moe", choices=sorted(presets))
  own, rest = p.parse_known_args(argv)

  def load_model(args, device, dtype):
    if args.model:
      cfg, params = load(args.model, dtype, device, own.moe_backend)
      return cfg, params, checkpoint.eos_token_ids(args.model), checkpoint.load_tokenizer(args.model)
    cfg = preset(own.moe_preset, moe_backend=own.moe_backend)
    return cfg, init_params(cfg, dtype, device, seed=args.seed), (), None

  # generate.main is the command; this model swaps in its loader and engine builder for the call.
  saved = generate.load_model, generate.engine
  generate.load_model, generate.engine = load_model, _EngineModule()
  try:
    return generate.main(rest)
  finally:
    generate.load_model, generate.engine = saved


class _EngineModule:
  build = staticmethod(build)


if __name__ == "__main__":
  main()
