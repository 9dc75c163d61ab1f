"""Load a Hugging Face model directory (config.json + *.safetensors) into a `LlamaConfig` and `Params`.

No network: everything comes from the directory. q/k/v and gate/up are fused here, once, so the step runs
one matmul for each. Tensors are read straight onto `device` (safetensors can load to CUDA) and cast to
`dtype` there. Anything that does not fit (missing file or tensor, wrong shape, unknown architecture or
option) is a `CheckpointError` naming the file, the tensor or the config key.
"""
from __future__ import annotations

import glob
import json
import os

import torch

import fgraph

from .layers import RopeScaling, rope_inv_freq
from .llama import Layer, LlamaConfig, Params


class CheckpointError(fgraph.FgraphError):
  """A model directory that cannot be loaded as one of the supported architectures."""


def _llama_config(c: dict, where: str, qkv_bias: bool = False) -> LlamaConfig:
  def need(key):
    if key not in c:
      raise CheckpointError(f"{where}: key {key!r} is missing", "use the config.json saved with the checkpoint")
    return c[key]

  if c.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{where}: hidden_act={c['hidden_act']!r} is not supported (only silu)")
  for key, why in (("attention_bias", "the Llama here has no q/k/v/o biases"),
                   ("mlp_bias", "the gated MLP here has no biases"),
                   ("use_sliding_window", "sliding-window attention is not implemented")):
    if c.get(key):
      raise CheckpointError(f"{where}: {key}={c[key]!r} is not supported ({why})",
                            "use a checkpoint without it, or extend examples/llama.py")
  heads = need("num_attention_heads")
  # transformers >= 5 writes `rope_parameters` (theta included); older configs `rope_theta` + `rope_scaling`.
  rope = dict(c.get("rope_scaling") or {}, **(c.get("rope_parameters") or {}))
  theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind == "default":
    scaling = None
  elif kind == "linear":
    scaling = RopeScaling("linear", float(rope["factor"]))
  elif kind == "llama3":
    scaling = RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                          float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
  else:
    raise CheckpointError(f"{where}: rope type {kind!r} is not supported", "supported: default, linear, llama3")
  return LlamaConfig(dim=need("hidden_size"), n_layers=need("num_hidden_layers"), n_heads=heads,
                     n_kv_heads=c.get("num_key_value_heads") or heads,
                     head_dim=c.get("head_dim") or need("hidden_size") // heads,
                     intermediate=need("intermediate_size"), vocab_size=need("vocab_size"),
                     norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
                     qkv_bias=qkv_bias, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                     max_seq_len=c.get("max_position_embeddings", 8192))


# config.json "architectures"[0] -> (config.json dict, where) -> our config. Every entry loads into Params.
ARCHITECTURES = {
  "LlamaForCausalLM": _llama_config,
  "Qwen2ForCausalLM": lambda c, where: _llama_config(c, where, qkv_bias=True),
}


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    raise CheckpointError(f"{path} does not exist", "pass a Hugging Face model directory (config.json + *.safetensors)")
  with open(path) as f:
    return json.load(f)


def read_config(model_dir: str) -> LlamaConfig:
  """config.json -> LlamaConfig, through the architecture table."""
  path = os.path.join(model_dir, "config.json")
  c = _read_json(path)
  arch = (c.get("architectures") or [None])[0]
  if arch not in ARCHITECTURES:
    raise CheckpointError(f"{path}: architecture {arch!r} is not supported",
                          f"supported architectures: {', '.join(sorted(ARCHITECTURES))}")
  return ARCHITECTURES[arch](c, path)


def _dtype(dtype, model_dir: str) -> torch.dtype:
  if dtype is None:  # the checkpoint's own dtype ("torch_dtype" before transformers 5)
    c = _read_json(os.path.join(model_dir, "config.json"))
    dtype = c.get("dtype") or c.get("torch_dtype") or "bfloat16"
  if isinstance(dtype, str):
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
      raise CheckpointError(f"unknown dtype {dtype!r}", "use float32, bfloat16 or float16")
    dtype = getattr(torch, dtype)
  return dtype


class _Tensors:
  """Name -> tensor over one or many safetensors files (with or without model.safetensors.index.json)."""

  def __init__(self, model_dir: str, device):
    from safetensors import safe_open
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
      files = {name: os.path.join(model_dir, f) for name, f in _read_json(index)["weight_map"].items()}
      for name, f in files.items():
        if not os.path.isfile(f):
          raise CheckpointError(f"{index} puts {name!r} in {os.path.basename(f)}, which does not exist",
                                "download every shard named in the index")
    else:
      paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
      if not paths:
        raise CheckpointError(f"{model_dir}: no *.safetensors files", "save the model with safe_serialization")
      files = {}
      for p in paths:
        with safe_open(p, framework="pt") as f:
          files.update({name: p for name in f.keys()})
    self.dir, self.files, self.device, self._open = model_dir, files, str(device), {}

  def __contains__(self, name):
    return name in self.files

  def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    from safetensors import safe_open
    if name not in self.files:
      raise CheckpointError(f"{self.dir}: tensor {name!r} is missing", "check that the checkpoint is complete")
    path = self.files[name]
    if path not in self._open:
      self._open[path] = safe_open(path, framework="pt", device=self.device)
    t = self._open[path].get_tensor(name)
    if tuple(t.shape) != tuple(shape):
      raise CheckpointError(f"{os.path.basename(path)}: tensor {name!r} has shape {list(t.shape)}, config.json "
                            f"implies {list(shape)}", "the config.json does not belong to these weights")
    return t.to(dtype)


def load(model_dir: str, dtype=None, device="cpu") -> tuple[LlamaConfig, Params]:
  """A HF model directory -> (config, params) in `dtype` (default: the checkpoint's) on `device`."""
  cfg, dtype = read_config(model_dir), _dtype(dtype, model_dir)
  ts = _Tensors(model_dir, device)
  D, dim, inter = cfg.head_dim, cfg.dim, cfg.intermediate
  q, kv = cfg.n_heads * D, cfg.n_kv_heads * D

  def layer(i):
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    wqkv = torch.cat([ts.get(a + "q_proj.weight", (q, dim), dtype), ts.get(a + "k_proj.weight", (kv, dim), dtype),
                      ts.get(a + "v_proj.weight", (kv, dim), dtype)])
    bqkv = None
    if cfg.qkv_bias:
      bqkv = torch.cat([ts.get(a + "q_proj.bias", (q,), dtype), ts.get(a + "k_proj.bias", (kv,), dtype),
                        ts.get(a + "v_proj.bias", (kv,), dtype)])
    w13 = torch.cat([ts.get(m + "gate_proj.weight", (inter, dim), dtype),
                     ts.get(m + "up_proj.weight", (inter, dim), dtype)])
    return Layer(attn_norm=ts.get(p + "input_layernorm.weight", (dim,), dtype), wqkv=wqkv, bqkv=bqkv,
                 wo=ts.get(a + "o_proj.weight", (dim, q), dtype),
                 mlp_norm=ts.get(p + "post_attention_layernorm.weight", (dim,), dtype),
                 w13=w13, w2=ts.get(m + "down_proj.weight", (dim, inter), dtype))

  vd = (cfg.vocab_size, dim)
  params = Params(embed=ts.get("model.embed_tokens.weight", vd, dtype), layers=[layer(i) for i in range(cfg.n_layers)],
                  norm=ts.get("model.norm.weight", (dim,), dtype),
                  lm_head=None if cfg.tie_embeddings else ts.get("lm_head.weight", vd, dtype),
                  inv_freq=rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling).to(device))
  return cfg, params


def eos_token_ids(model_dir: str) -> tuple[int, ...]:
  """End-of-sequence ids: generation_config.json's if present (what HF generate uses), else config.json's."""
  for name in ("generation_config.json", "config.json"):
    path = os.path.join(model_dir, name)
    if os.path.isfile(path):
      eos = _read_json(path).get("eos_token_id")
      if eos is not None:
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
  return ()


def load_tokenizer(model_dir: str):
  """The directory's tokenizer.json as a `tokenizers.Tokenizer`, or None when there is none."""
  path = os.path.join(model_dir, "tokenizer.json")
  if not os.path.isfile(path):
    return None
  from tokenizers import Tokenizer
  return Tokenizer.from_file(path)
