"""config.json -> the examples' model config, read as transformers reads it (examples/checkpoint.py loads the weights).

Anything the config asks for that the models here do not implement, or that is not a valid value, is a
`CheckpointError` naming the key.
"""

from __future__ import annotations

import json
import os

import fgraph

from .layers import RopeScaling
from .llama import LlamaConfig


class CheckpointError(fgraph.FgraphError):
    """A model directory that cannot be loaded as one of the supported architectures."""


# transformers' values for keys a config.json leaves out, per architecture family: rope theta, rms_norm_eps, and
# whether `sliding_window` alone turns a sliding window on (Mixtral: no `use_sliding_window` key)
LLAMA_DEFAULTS = (1e4, 1e-6, False)
MIXTRAL_DEFAULTS = (1e6, 1e-5, True)


def llama_config(c: dict, where: str, qkv_bias: bool = False, defaults: tuple = LLAMA_DEFAULTS) -> LlamaConfig:
    """The attention/dense part of a config.json dict (`where` names it in errors). examples/qwen2_moe.py builds
    its MoEConfig on top of this. Every value is checked for its type: a string where a number belongs is refused,
    not read (`"false"` as True, `"1e-6"` failing at the first step)."""
    theta0, eps0, windowed = defaults

    def need(key, default=None):
        if key not in c and default is None:
            raise CheckpointError(f"{where}: key {key!r} is missing", "use the config.json saved with the checkpoint")
        v = c.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError(f"{where}: {key}={v!r} is not a positive integer", "fix config.json")
        return v

    def number(key, default: float) -> float:
        v = c.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise CheckpointError(f"{where}: {key}={v!r} is not a finite number >= 0", "fix config.json")
        return float(v)

    def flag(key) -> bool:
        v = c.get(key, False)
        if not isinstance(v, bool):
            raise CheckpointError(f"{where}: {key}={v!r} is not true or false", "fix config.json")
        return v

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
    if windowed and c.get("sliding_window") is not None:  # Mixtral: the window applies whenever it is set
        raise CheckpointError(
            f"{where}: sliding_window={c['sliding_window']!r} is not supported (sliding-window attention is not "
            "implemented)",
            "set it to null in config.json if the model never attends past it, or extend examples/llama.py",
        )
    heads = need("num_attention_heads")
    kv = need("num_key_value_heads") if c.get("num_key_value_heads") is not None else heads
    if heads % kv:
        raise CheckpointError(
            f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}", "fix config.json"
        )
    # transformers >= 5 writes `rope_parameters` (theta included); older configs `rope_theta` + `rope_scaling`.
    # transformers reads `rope_scaling` first: where both are given and disagree, which one is meant is unclear
    legacy, params = c.get("rope_scaling") or {}, c.get("rope_parameters") or {}
    kind_of = lambda d: d.get("rope_type", d.get("type", "default"))  # noqa: E731
    if (
        legacy
        and params
        and (
            kind_of(legacy) != kind_of(params)
            or any(params.get(k, v) != v for k, v in legacy.items() if k not in ("type", "rope_type"))
        )
    ):
        raise CheckpointError(
            f"{where}: rope_scaling {legacy} and rope_parameters {params} disagree",
            "keep one of the two in config.json",
        )
    rope = dict(legacy, **params)
    theta = rope.get("rope_theta", c.get("rope_theta", theta0))
    kind = kind_of(rope)
    try:
        if kind == "default":
            scaling = None
        elif kind == "linear":
            scaling = RopeScaling("linear", float(rope["factor"]))
        elif kind == "llama3":
            top = c.get("original_max_position_embeddings")  # transformers prefers it to the rope dict's
            scaling = RopeScaling(
                "llama3",
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(top if top is not None else rope["original_max_position_embeddings"]),
            )
        else:
            raise CheckpointError(f"{where}: rope type {kind!r} is not supported", "supported: default, linear, llama3")
        theta = float(theta)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: rope parameters {rope} ({type(e).__name__}: {e})", "fix config.json") from None
    return LlamaConfig(
        dim=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=need("head_dim") if c.get("head_dim") is not None else need("hidden_size") // heads,
        intermediate=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        norm_eps=number("rms_norm_eps", eps0),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        tie_embeddings=flag("tie_word_embeddings"),
        max_seq_len=need("max_position_embeddings", 8192),
    )


# config.json "architectures"[0] -> (config.json dict, where) -> our config. Every entry loads into Params.
ARCHITECTURES = {
    "LlamaForCausalLM": llama_config,
    "Qwen2ForCausalLM": lambda c, where: llama_config(c, where, qkv_bias=True),
}


def read_json(path: str) -> dict:
    """A JSON object from a file of the model directory; a missing or invalid one is a CheckpointError."""
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} does not exist", "pass a Hugging Face model directory (config.json + *.safetensors)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not valid JSON ({e})", "restore the file from the checkpoint") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: a JSON {type(out).__name__}, not an object", "restore the file")
    return out


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
