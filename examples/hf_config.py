"""config.json -> the examples' model config, read as transformers reads it (examples/checkpoint.py loads the weights).

Anything the config asks for that the models here do not implement, or that is not a valid value, is a
`CheckpointError` naming the key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import attrs

import fgraph

from .layers import RopeScaling
from .llama import LlamaConfig


class CheckpointError(fgraph.FgraphError):
    """A model directory that cannot be loaded as one of the supported architectures."""


class Keys:
    """Typed reads of one config.json dict; every error starts with `where` (its path) and names the key. A string
    where a number belongs is refused, not read (`"false"` as True, `"1e-6"` failing at the first step)."""

    def __init__(self, c: dict, where: str):
        self.c, self.where = c, where

    def error(self, what: str, fix: str = "fix config.json") -> CheckpointError:
        return CheckpointError(f"{self.where}: {what}", fix)

    def positive(self, key: str, default: int | None = None) -> int:
        """A positive integer; a key left out is an error unless it has a default."""
        if key not in self.c and default is None:
            raise self.error(f"key {key!r} is missing", "use the config.json saved with the checkpoint")
        v = self.c.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise self.error(f"{key}={v!r} is not a positive integer")
        return v

    def number(self, key: str, default: float) -> float:
        v = self.c.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise self.error(f"{key}={v!r} is not a finite number >= 0")
        return float(v)

    def flag(self, key: str, default: bool = False) -> bool:
        v = self.c.get(key, default)
        if not isinstance(v, bool):
            raise self.error(f"{key}={v!r} is not true or false")
        return v


def _qwen2_windowed(i: int, first: int, window) -> bool:  # Qwen2Config: the layers from max_window_layers on
    return window is not None and i >= first


def _qwen2_moe_windowed(i: int, last: int, window) -> bool:  # Qwen2MoeConfig: even layers below max_window_layers
    return bool((i + 1) % 2) and i < last


@attrs.frozen
class Family:
    """How transformers reads one architecture's config.json: its value for each key a config leaves out (its
    config class's defaults), and which keys it reads at all: a key the architecture ignores (Qwen2's
    `attention_bias`, Llama's `sliding_window`) must neither refuse the checkpoint nor change the model."""

    theta: float = 1e4  # rope_theta (transformers' default_theta)
    eps: float = 1e-6  # rms_norm_eps
    kv_heads: int | None = None  # num_key_value_heads left out; None: num_attention_heads
    kv_null: bool = True  # num_key_value_heads null means the heads (else transformers fails on it)
    max_pos: int = 2048  # max_position_embeddings
    qkv_bias: bool = False  # q/k/v biases (o_proj never has one here)...
    qkv_bias_key: str | None = None  # ...unless this key says otherwise (Qwen2-MoE's `qkv_bias`)
    refused_biases: tuple[str, ...] = ()  # bias keys it reads that the models here lack (Llama's: o_proj, MLP)
    # which layers have a sliding window: None: those `layer_types` names (its KV cache keeps only the window
    # there; Llama's attention ignores `sliding_window`); "all": every one whenever `sliding_window` is set
    # (Mistral, Mixtral); else (i, max_window_layers, window) -> whether layer i has it, when `use_sliding_window`
    # is on and config.json has no `layer_types` list (Qwen2, Qwen2-MoE)
    windowed: Callable[[int, int, object], bool] | str | None = None
    window: int | None = None  # sliding_window left out
    mask_always: bool = False  # builds a sliding-window mask whatever the layers (Qwen2-MoE): it fails on a null window


FAMILIES = {
    "LlamaForCausalLM": Family(refused_biases=("attention_bias", "mlp_bias")),
    "MistralForCausalLM": Family(kv_heads=8, kv_null=False, max_pos=131072, windowed="all", window=4096),
    "Qwen2ForCausalLM": Family(kv_heads=32, max_pos=32768, qkv_bias=True, windowed=_qwen2_windowed, window=4096),
    "Qwen2MoeForCausalLM": Family(
        kv_heads=16,
        kv_null=False,
        max_pos=32768,
        qkv_bias=True,
        qkv_bias_key="qkv_bias",
        windowed=_qwen2_moe_windowed,
        window=4096,
        mask_always=True,
    ),
    "MixtralForCausalLM": Family(theta=1e6, eps=1e-5, kv_heads=8, kv_null=False, max_pos=131072, windowed="all"),
}
ROPE_TYPES = ("default", "linear", "llama3")


def rope(k: Keys, fam: Family, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) as transformers 5 reads them: from the legacy `rope_scaling` dict if there is one, else from
    `rope_parameters` (transformers >= 5 writes it, theta included). Where both are given and read as different
    RoPE, which one is meant is unclear: refused."""
    legacy, params = k.c.get("rope_scaling") or {}, k.c.get("rope_parameters") or {}
    read = _rope(k, fam, max_pos, legacy or params)
    if legacy and params:
        try:
            other = _rope(k, fam, max_pos, params)
        except CheckpointError:
            other = None
        if other != read:
            raise k.error(
                f"rope_scaling {legacy} and rope_parameters {params} disagree", "keep one of them in config.json"
            )
    return read


def _rope(k: Keys, fam: Family, max_pos: int, d: dict) -> tuple[float, RopeScaling | None]:
    """One rope dict, completed as transformers completes it: theta from the top-level `rope_theta` (else the
    family's), `original_max_position_embeddings` from the top level (which it prefers) or max_position_embeddings."""
    c = k.c
    if not isinstance(d, dict):
        raise k.error(f"rope parameters {d!r} are not an object")
    r = {key: v for key, v in d.items() if key != "type"}
    r["rope_type"] = kind = d.get("rope_type", d.get("type", "default"))
    r.setdefault("rope_theta", c.get("rope_theta", fam.theta))
    if c.get("partial_rotary_factor") is not None:
        r.setdefault("partial_rotary_factor", c["partial_rotary_factor"])
    if kind not in ROPE_TYPES:
        raise k.error(f"rope type {kind!r} is not supported", "supported: " + ", ".join(ROPE_TYPES))
    # transformers' default RoPE of these architectures rotates the whole head whatever the factor says; its
    # other types rotate a fraction of it (and then fail in these models' attention): not the model here
    if kind != "default" and r.get("partial_rotary_factor", 1.0) != 1.0:
        raise k.error(
            f"partial_rotary_factor={r['partial_rotary_factor']!r} with rope type {kind!r} is not supported (RoPE "
            "here rotates the whole head)",
            "use a checkpoint without it, or extend examples/layers.py",
        )
    if kind == "llama3" and c.get("original_max_position_embeddings") is not None:
        r["original_max_position_embeddings"] = c["original_max_position_embeddings"]

    def num(key, default=None):
        v = r.get(key, default)
        if v is None:
            raise KeyError(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):  # transformers computes with it, then fails
            raise TypeError(f"{key}={v!r} is not a number")
        return float(v)

    try:
        if kind == "default":
            scaling = None
        elif kind == "linear":
            scaling = RopeScaling("linear", num("factor"))
        else:
            orig = int(num("original_max_position_embeddings", max_pos))
            scaling = RopeScaling("llama3", num("factor"), num("low_freq_factor"), num("high_freq_factor"), orig)
        return num("rope_theta"), scaling
    except (KeyError, TypeError, ValueError) as e:
        raise k.error(f"rope parameters {r} ({type(e).__name__}: {e})") from None


def check_windows(k: Keys, fam: Family, n_layers: int, max_pos: int) -> None:
    """Refuses a sliding window, as transformers reads it, that can hide a key from a query: attention here is
    full. A window of at least max_position_embeddings never does (examples.engine serves no longer sequence)."""
    types = k.c.get("layer_types")  # transformers 5 writes it; its KV cache is sliding where it says so
    if types is not None and (not isinstance(types, list) or not set(types) <= {"full_attention", "sliding_attention"}):
        raise k.error(f"layer_types={types!r} is not supported (only full_attention and sliding_attention)")
    sliding = [i for i, t in enumerate((types or [])[:n_layers]) if t == "sliding_attention"]
    if not callable(fam.windowed):  # sliding layers without a window fail in transformers
        window = k.c.get("sliding_window", fam.window)
        layers = list(range(n_layers)) if fam.windowed == "all" and window is not None else sliding
    else:
        on = k.flag("use_sliding_window")
        # without use_sliding_window, Qwen2 sets the window to None (its sliding layers then fail), Qwen2-MoE to 0
        window = k.c.get("sliding_window", fam.window) if on else None
        if on and window is None and fam.mask_always:
            raise k.error(
                "sliding_window=None with use_sliding_window=True is not supported (transformers fails on it)",
                "set use_sliding_window to false in config.json, or give the window",
            )
        layers = sliding
        if types is None:  # transformers 4's configs: the layers follow from max_window_layers
            m = k.c.get("max_window_layers", 28)
            if isinstance(m, bool) or not isinstance(m, int):
                raise k.error(f"max_window_layers={m!r} is not an integer")
            layers = [i for i in range(n_layers) if on and fam.windowed(i, m, window)]
    if layers and (isinstance(window, bool) or not isinstance(window, int) or window < max_pos):
        raise k.error(
            f"sliding_window={window!r} is not supported on layers {layers} (sliding-window attention is not "
            f"implemented; only a window of at least max_position_embeddings={max_pos} changes nothing)",
            "use a checkpoint without it, or extend examples/llama.py",
        )


def llama_config(c: dict, where: str, arch: str) -> LlamaConfig:
    """The attention/dense part of a config.json dict of architecture `arch` (a FAMILIES key; `where` names the
    file in errors). examples/qwen2_moe.py builds its MoEConfig on top of this."""
    k, fam = Keys(c, where), FAMILIES[arch]
    if c.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' "swish" is SiLU too
        raise k.error(f"hidden_act={c['hidden_act']!r} is not supported (only silu, alias swish)")
    for key in fam.refused_biases:
        if k.flag(key):
            raise k.error(
                f"{key}=True is not supported (the {arch} here has no such biases)",
                "use a checkpoint without it, or extend examples/llama.py",
            )
    heads = k.positive("num_attention_heads")
    kv = c.get("num_key_value_heads", fam.kv_heads)
    kv = heads if kv is None and fam.kv_null else k.positive("num_key_value_heads", kv)
    if heads % kv:
        raise k.error(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    n_layers, max_pos = k.positive("num_hidden_layers"), k.positive("max_position_embeddings", fam.max_pos)
    check_windows(k, fam, n_layers, max_pos)
    theta, scaling = rope(k, fam, max_pos)
    return LlamaConfig(
        dim=k.positive("hidden_size"),
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=k.positive("head_dim") if c.get("head_dim") is not None else k.positive("hidden_size") // heads,
        intermediate=k.positive("intermediate_size"),
        vocab_size=k.positive("vocab_size"),
        norm_eps=k.number("rms_norm_eps", fam.eps),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=k.flag(fam.qkv_bias_key, fam.qkv_bias) if fam.qkv_bias_key else fam.qkv_bias,
        tie_embeddings=k.flag("tie_word_embeddings"),
        max_seq_len=max_pos,
    )


# The dense architectures (examples/qwen2_moe.py has the MoE ones); every one loads into Params. Mistral is Llama
# without biases, with a sliding window whenever `sliding_window` is set (refused unless it covers the context).
ARCHITECTURES = {a: FAMILIES[a] for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")}


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
    return llama_config(c, path, arch)
