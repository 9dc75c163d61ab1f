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


def llama_config(c: dict, where: str, qkv_bias: bool = False) -> LlamaConfig:
    """The attention/dense part of a config.json dict (`where` names it in errors). examples/qwen2_moe.py builds
    its MoEConfig on top of this."""

    def need(key):
        if key not in c:
            raise CheckpointError(f"{where}: key {key!r} is missing", "use the config.json saved with the checkpoint")
        return c[key]

    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act={c['hidden_act']!r} is not supported (only silu)")
    for key, why in (
        ("attention_bias", "the Llama here has no q/k/v/o biases"),
        ("mlp_bias", "the gated MLP here has no biases"),
        ("use_sliding_window", "sliding-window attention is not implemented"),
    ):
        if c.get(key):
            raise CheckpointError(
                f"{where}: {key}={c[key]!r} is not supported ({why})",
                "use a checkpoint without it, or extend examples/llama.py",
            )
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
        scaling = RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    else:
        raise CheckpointError(f"{where}: rope type {kind!r} is not supported", "supported: default, linear, llama3")
    return LlamaConfig(
        dim=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or need("hidden_size") // heads,
        intermediate=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=c.get("max_position_embeddings", 8192),
    )


# config.json "architectures"[0] -> (config.json dict, where) -> our config. Every entry loads into Params.
ARCHITECTURES = {
    "LlamaForCausalLM": llama_config,
    "Qwen2ForCausalLM": lambda c, where: llama_config(c, where, qkv_bias=True),
}


def read_json(path: str) -> dict:
    """A JSON file of the model directory; a missing one is a CheckpointError."""
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} does not exist", "pass a Hugging Face model directory (config.json + *.safetensors)"
        )
    with open(path) as f:
        return json.load(f)


def architecture(model_dir: str) -> str | None:
    """config.json's "architectures"[0] (what examples.generate picks the loader by), or None."""
    return (read_json(os.path.join(model_dir, "config.json")).get("architectures") or [None])[0]


def read_config(model_dir: str) -> LlamaConfig:
    """config.json -> LlamaConfig, through the architecture table."""
    path = os.path.join(model_dir, "config.json")
    c = read_json(path)
    arch = (c.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architecture {arch!r} is not supported",
            f"supported architectures: {', '.join(sorted(ARCHITECTURES))} (MoE ones: "
            "examples.qwen2_moe.load; examples.generate picks the loader by architecture)",
        )
    return ARCHITECTURES[arch](c, path)


def dtype_of(dtype, model_dir: str) -> torch.dtype:
    """A torch dtype from a dtype, its name, or None (the checkpoint's own dtype)."""
    if dtype is None:  # the checkpoint's own dtype ("torch_dtype" before transformers 5)
        c = read_json(os.path.join(model_dir, "config.json"))
        dtype = c.get("dtype") or c.get("torch_dtype") or "bfloat16"
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise CheckpointError(f"unknown dtype {dtype!r}", "use float32, bfloat16 or float16")
        dtype = getattr(torch, dtype)
    return dtype


class Tensors:
    """Name -> tensor over one or many safetensors files (with or without model.safetensors.index.json).
    `get(name, shape, dtype)` checks the shape against the config's and casts on the device."""

    def __init__(self, model_dir: str, device):
        from safetensors import safe_open

        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            files = {name: os.path.join(model_dir, f) for name, f in read_json(index)["weight_map"].items()}
            for name, f in files.items():
                if not os.path.isfile(f):
                    raise CheckpointError(
                        f"{index} puts {name!r} in {os.path.basename(f)}, which does not exist",
                        "download every shard named in the index",
                    )
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
            raise CheckpointError(
                f"{os.path.basename(path)}: tensor {name!r} has shape {list(t.shape)}, config.json "
                f"implies {list(shape)}",
                "the config.json does not belong to these weights",
            )
        return t.to(dtype)


def attention_weights(ts: Tensors, cfg: LlamaConfig, i: int, dtype: torch.dtype) -> dict:
    """Layer i's attention and both norms, q/k/v fused: the Layer fields every model here shares (dense or MoE)."""
    p, D, dim = f"model.layers.{i}.", cfg.head_dim, cfg.dim
    a, q, kv = p + "self_attn.", cfg.n_heads * D, cfg.n_kv_heads * D

    def get(name, *shape):
        return ts.get(name, shape, dtype)

    wqkv = torch.cat(
        [get(a + "q_proj.weight", q, dim), get(a + "k_proj.weight", kv, dim), get(a + "v_proj.weight", kv, dim)]
    )
    bqkv = (
        torch.cat([get(a + "q_proj.bias", q), get(a + "k_proj.bias", kv), get(a + "v_proj.bias", kv)])
        if cfg.qkv_bias
        else None
    )
    return dict(
        attn_norm=get(p + "input_layernorm.weight", dim),
        wqkv=wqkv,
        bqkv=bqkv,
        wo=get(a + "o_proj.weight", dim, q),
        mlp_norm=get(p + "post_attention_layernorm.weight", dim),
    )


def gated_mlp_weights(ts: Tensors, prefix: str, inter: int, dim: int, dtype: torch.dtype) -> dict:
    """`prefix`{gate,up,down}_proj -> w13 [2*inter, dim] (gate rows, then up rows) and w2 [dim, inter]."""
    w13 = torch.cat(
        [
            ts.get(prefix + "gate_proj.weight", (inter, dim), dtype),
            ts.get(prefix + "up_proj.weight", (inter, dim), dtype),
        ]
    )
    return dict(w13=w13, w2=ts.get(prefix + "down_proj.weight", (dim, inter), dtype))


def assemble(ts: Tensors, cfg: LlamaConfig, dtype: torch.dtype, device, layer, shard=None) -> Params:
    """Params from `layer(i)` for every layer, plus the embedding, final norm, head and RoPE frequencies.

    shard: None, or `(what, value) -> value` called as each part is read, with what = "layer" (a Layer),
      "embed" or "lm_head" ([V, dim]): a tensor-parallel rank keeps only its slice of each (examples/tp.py),
      so it never holds more than its shard plus one layer.
    """
    shard = shard or (lambda what, value: value)
    vd = (cfg.vocab_size, cfg.dim)
    return Params(
        embed=shard("embed", ts.get("model.embed_tokens.weight", vd, dtype)),
        layers=[shard("layer", layer(i)) for i in range(cfg.n_layers)],
        norm=ts.get("model.norm.weight", (cfg.dim,), dtype),
        lm_head=None if cfg.tie_embeddings else shard("lm_head", ts.get("lm_head.weight", vd, dtype)),
        inv_freq=rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device),
    )


def load(model_dir: str, dtype=None, device="cpu", shard=None) -> tuple[LlamaConfig, Params]:
    """A HF model directory -> (config, params) in `dtype` (default: the checkpoint's) on `device`.
    shard: see `assemble` (examples/tp.py's tensor-parallel loading)."""
    cfg, dtype = read_config(model_dir), dtype_of(dtype, model_dir)
    ts = Tensors(model_dir, device)

    def layer(i):
        return Layer(
            **attention_weights(ts, cfg, i, dtype),
            **gated_mlp_weights(ts, f"model.layers.{i}.mlp.", cfg.intermediate, cfg.dim, dtype),
        )

    return cfg, assemble(ts, cfg, dtype, device, layer, shard)


def eos_token_ids(model_dir: str) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's if present (what HF generate uses), else config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            eos = read_json(path).get("eos_token_id")
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
