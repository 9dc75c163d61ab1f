"""Load a Hugging Face model directory (config.json + *.safetensors) into a `LlamaConfig` and `Params`.

No network: everything comes from the directory. q/k/v and gate/up are fused here, once, so the step runs
one matmul for each. Tensors are read straight onto `device` (safetensors can load to CUDA) and cast to
`dtype` there. A directory either is the model its config.json describes or the load fails saying why: anything
that does not fit (a missing, unreadable or invalid file; a missing, extra, duplicated, misshapen, non-float or
non-finite tensor; an architecture or layer count the tensors contradict; an unknown option) is a
`CheckpointError` naming the file, the tensor or the config key.
"""

from __future__ import annotations

import glob
import os

import torch

# config.json is read in hf_config; its names stay importable from here, the loader's public module
from .hf_config import (  # noqa: F401
    ARCHITECTURES,
    CheckpointError,
    architecture,
    llama_config,
    read_config,
    read_json,
)
from .layers import rope_inv_freq
from .llama import Layer, LlamaConfig, Params


def dtype_of(dtype, model_dir: str) -> torch.dtype:
    """A torch dtype from a dtype, its name, or None: the checkpoint's own, as transformers' dtype="auto" reads it
    (config.json's `dtype`, else its `torch_dtype`, else the first float tensor's in the weights)."""
    if dtype is None:
        c = read_json(os.path.join(model_dir, "config.json"))
        dtype = c.get("dtype") or c.get("torch_dtype") or weights_dtype(model_dir) or "bfloat16"
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"dtype {dtype!r} is not a float dtype torch has", "use float32, bfloat16 or float16")
    return dtype


# safetensors' names of the float dtypes
SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def weights_dtype(model_dir: str) -> torch.dtype | None:
    """The dtype of the first float tensor of the first *.safetensors file (read from its header), or None."""
    paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not paths:
        return None
    with _safe_open(paths[0]) as f:
        return next(
            (SAFETENSORS_FLOATS[t] for n in f.keys() if (t := f.get_slice(n).get_dtype()) in SAFETENSORS_FLOATS), None
        )


def _safe_open(path: str, device: str = "cpu"):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device=device)
    except Exception as e:  # SafetensorError, OSError: truncated, empty, not safetensors at all
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})", "re-download this file") from None


# Tensors a checkpoint may hold that no model here reads: RoPE frequencies (recomputed from the config).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class Tensors:
    """Name -> tensor over one or many safetensors files (with or without model.safetensors.index.json).

    `get(name, shape, dtype)` checks the shape against the config's and that the tensor is a float, casts on the
    device, and counts the name as used; `skip(name)` counts one as used without reading it (another rank's
    experts). `finish()` then fails on any tensor left unused (HF's "unexpected keys", an error here unless
    `allow_unused`) and on non-finite values in any that was read (`check_finite`: one float32 sum per tensor,
    all read back in one host sync at the end: a pass over the weights at memory speed, about a millisecond per GB
    on the GPU and 0.1-0.2 s per GB on a small CPU)."""

    def __init__(self, model_dir: str, device, check_finite: bool = True):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(
                    f'{index}: no "weight_map" object (tensor name -> file)',
                    "restore the index from the checkpoint, or delete it to read every *.safetensors file",
                )
            files = {name: os.path.join(model_dir, str(f)) for name, f in weight_map.items()}
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
                with _safe_open(p) as f:
                    for name in f.keys():
                        if name in files:
                            raise CheckpointError(
                                f"{model_dir}: tensor {name!r} is in both {os.path.basename(files[name])} and "
                                f"{os.path.basename(p)}",
                                "remove the stale file (or add the model.safetensors.index.json that says which)",
                            )
                        files[name] = p
        self.dir, self.files, self.device, self._open = model_dir, files, str(device), {}
        self.used: set[str] = {n for n in files if n.endswith(IGNORED_SUFFIXES)}
        self.check_finite, self._finite = check_finite, []  # [(name, 0-d bool tensor on the device)]

    def __contains__(self, name):
        return name in self.files

    def skip(self, name: str) -> None:
        self.used.add(name)

    def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing", "check that the checkpoint is complete")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = _safe_open(path, self.device)
        try:
            t = self._open[path].get_tensor(name)
        except Exception as e:  # a tensor the header lists but the file cannot give (truncated data, an index lie)
            raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({e})", "re-download this file") from None
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{os.path.basename(path)}: tensor {name!r} has shape {list(t.shape)}, config.json "
                f"implies {list(shape)}",
                "the config.json does not belong to these weights",
            )
        if not t.dtype.is_floating_point:
            raise CheckpointError(
                f"{os.path.basename(path)}: tensor {name!r} is {str(t.dtype).removeprefix('torch.')}, not a float "
                "(a quantized checkpoint?)",
                "use the checkpoint's unquantized (bf16 / fp16 / fp32) weights",
            )
        self.used.add(name)
        t = t.to(dtype)
        if self.check_finite:
            # a sum is finite iff every element is (a float32 sum of weights does not overflow); no sync per tensor
            self._finite.append((name, torch.isfinite(t.sum(dtype=torch.float32))))
        return t

    def finish(self, allow_unused: bool = False) -> None:
        """Fail on tensors never used (unless allow_unused) and on non-finite values (one host sync for all)."""
        unused = sorted(set(self.files) - self.used)
        if unused and not allow_unused:
            shown = ", ".join(unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
            raise CheckpointError(
                f"{self.dir}: {len(unused)} tensors the model does not use: {shown}",
                "check that config.json (architecture, layer count, options) describes these weights, or pass "
                "allow_unused=True (examples.generate --allow-unused-weights) to load them anyway",
            )
        if self._finite:
            ok = torch.stack([f for _, f in self._finite]).tolist()
            bad = [name for (name, _), good in zip(self._finite, ok) if not good]
            self._finite = []
            if bad:
                raise CheckpointError(
                    f"{self.dir}: non-finite values (NaN or inf) in {', '.join(bad[:6])}"
                    + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
                    + " (after the cast to the load dtype)",
                    "re-download the checkpoint; if it overflows in float16, load it in bfloat16 or float32",
                )


def check_layout(ts: Tensors, cfg: LlamaConfig, arch: str, path: str) -> None:
    """The architecture and layer count of config.json against the tensors present, before reading any: a
    mismatch is named here rather than left to the unused-tensor list (or, worse, to a silently wrong model)."""
    layers = {int(n.split(".")[2]) for n in ts.files if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if layers and max(layers) + 1 != cfg.n_layers:
        raise CheckpointError(
            f"{path}: num_hidden_layers={cfg.n_layers}, the weights have layers 0..{max(layers)}",
            "use the config.json saved with these weights",
        )
    experts = next((n for n in ts.files if ".experts." in n), None)
    if experts is not None and type(cfg) is LlamaConfig:
        raise CheckpointError(
            f"{path}: architecture {arch} is dense, but the weights hold MoE experts ({experts!r})",
            'set "architectures" to the MoE model the weights are (Qwen2MoeForCausalLM, MixtralForCausalLM)',
        )
    bias = "model.layers.0.self_attn.q_proj.bias"
    if (bias in ts) != cfg.qkv_bias:
        raise CheckpointError(
            f"{path}: architecture {arch} {'has' if cfg.qkv_bias else 'has no'} q/k/v biases, but the weights "
            f"{'have' if bias in ts else 'lack'} {bias!r}",
            'set "architectures" to the model the weights are (Qwen2ForCausalLM has the biases, LlamaForCausalLM not)',
        )


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
    embed = ts.get("model.embed_tokens.weight", vd, dtype)
    if cfg.tie_embeddings and "lm_head.weight" in ts:  # saved anyway by some exporters: it must be the embedding
        if not torch.equal(ts.get("lm_head.weight", vd, dtype), embed):
            raise CheckpointError(
                f"{ts.dir}: config.json ties lm_head to the embedding, the weights hold a different 'lm_head.weight'",
                "set tie_word_embeddings=false in config.json if the head is its own",
            )
    return Params(
        embed=shard("embed", embed),
        layers=[shard("layer", layer(i)) for i in range(cfg.n_layers)],
        norm=ts.get("model.norm.weight", (cfg.dim,), dtype),
        lm_head=None if cfg.tie_embeddings else shard("lm_head", ts.get("lm_head.weight", vd, dtype)),
        inv_freq=rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device),
    )


def load(
    model_dir: str, dtype=None, device="cpu", shard=None, allow_unused: bool = False, check_finite: bool = True
) -> tuple[LlamaConfig, Params]:
    """A HF model directory -> (config, params) in `dtype` (default: the checkpoint's) on `device`.
    shard: see `assemble` (examples/tp.py's tensor-parallel loading). allow_unused, check_finite: see Tensors."""
    cfg, dtype = read_config(model_dir), dtype_of(dtype, model_dir)
    ts = Tensors(model_dir, device, check_finite)
    check_layout(ts, cfg, architecture(model_dir), os.path.join(model_dir, "config.json"))

    def layer(i):
        return Layer(
            **attention_weights(ts, cfg, i, dtype),
            **gated_mlp_weights(ts, f"model.layers.{i}.mlp.", cfg.intermediate, cfg.dim, dtype),
        )

    params = assemble(ts, cfg, dtype, device, layer, shard)
    ts.finish(allow_unused)
    return cfg, params


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

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise CheckpointError(
            f"{path}: not a valid tokenizer ({e})", "restore tokenizer.json from the checkpoint"
        ) from None
