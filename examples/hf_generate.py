"""An unmodified Hugging Face model's `generate` through fgraph: `python -m examples.hf_generate [--model DIR]`.

The static-cache recipe: the model's forward is jitted with its cache donated, and `generate` runs as it is.

    model.forward = fgraph.jit(model.forward, donate=["cache"])   # `past_key_values` on transformers < 5.24
    model.generate(ids, cache_implementation="static", max_new_tokens=...)

The StaticCache generate makes is seen into as a pytree of its tensors (keys, values, cumulative_length of every
layer): donated state, written in place. Its layers are made lazily by the first forward (prefill), which runs
eagerly; every decode step then replays one signature's graphs. On the GPU generate wraps the call in torch.compile,
to which the jitted call is opaque: the same graphs run (`generate` below passes `disable_compile=True`, which only
saves that compile).
By default a tiny random-weight Qwen2 (no network, runs on CPU in seconds);
`--model DIR` loads a checkpoint; `--compile` compiles the pieces with Inductor (the speed: docs/performance.md).
Prints the tokens, whether they equal eager generate's, and fgraph's stats.
"""

from __future__ import annotations

import argparse
import json

import torch

import fgraph

NO_SPECIAL_TOKENS = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)


def tiny(
    arch: str = "qwen2",
    device: str = "cpu",
    dtype=torch.float32,
    seed: int = 0,
    layers: int = 2,
    max_positions: int = 256,
    special_tokens: dict = NO_SPECIAL_TOKENS,
    sliding_window: int | None = None,
):
    """A random Qwen2, Llama, Mistral or Qwen2-MoE (2 layers by default): hidden 64, 4 heads (2 KV heads), vocab 128,
    weights ~0.15; the MoE's 4 experts, 2 a token, and a shared expert.

    special_tokens: none by default, so generate never stops early ({}: the config's own); sliding_window: Mistral's
    (its StaticCache then has sliding-window layers: see full_static_cache)."""
    import transformers as tf

    cfg_cls, model_cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
    }[arch]
    extra = {"sliding_window": sliding_window} if arch == "mistral" else {}
    if arch == "qwen2_moe":
        extra = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64)
    cfg = cfg_cls(
        **extra,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        attn_implementation="eager",
        **special_tokens,
    )
    torch.manual_seed(seed)
    model = spread(model_cls(cfg))
    model.generation_config.update(**special_tokens)
    return model.to(device=device, dtype=dtype).eval()


def spread(model):
    """The random model's weights drawn again away from init's tiny values, so that its tokens differ per position:
    norms ~1 +- 0.1, the rest ~0.15 (from torch's global generator)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def cache_parameter(model) -> str:
    """`cache` (recent transformers) or `past_key_values` (transformers before 5.24): its cache parameter."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def jit_forward(model, mode: str = "FULL_AND_PIECEWISE", **options):
    """The recipe: the model's own forward, jitted, its cache donated (in place, on the model)."""
    model.forward = fgraph.jit(model.forward, donate=[cache_parameter(model)], mode=mode, **options)
    return model.forward


def full_static_cache(model, max_cache_len: int):
    """A static cache whose every layer keeps all `max_cache_len` positions, for a model with sliding-window layers.

    transformers' StaticCache gives such layers (Mistral's with `sliding_window`, Gemma 2's) a Python int counting
    their tokens, which a captured graph cannot update (fgraph refuses it at trace time). In these layers the model's
    sliding-window mask, built from its config, still limits each query to its window, so generate gives eager's
    tokens; the cache holds `max_cache_len` positions (the prompt and the new tokens) instead of the window."""
    import transformers as tf

    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return tf.Cache(layers=[tf.StaticLayer(max_cache_len=max_cache_len) for _ in range(layers)])


def generate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> torch.Tensor:
    """Greedy generate of `new_tokens`, with a static cache: generate's own, or the one passed (cache=...)."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, disable_compile=True)
    kw.update(kwargs)
    if not {"cache", "past_key_values"} & kwargs.keys():
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids, **kw)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m examples.hf_generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a checkpoint directory (default: a tiny random Qwen2)")
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama", "mistral", "qwen2_moe"])
    p.add_argument("--mode", default="FULL_AND_PIECEWISE")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="Inductor-compiled pieces (compile=True); default: on CUDA, as Engine and the CLI (an HF model's "
        "attention is no fgraph break, so uncompiled graphs replay eager's kernels; compiled ones fuse them, at a "
        "compilation's cost on first use); --no-compile: graphs of eager's own kernels",
    )
    args = p.parse_args(argv)
    if args.compile is None:
        args.compile = args.device.startswith("cuda")
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()
    else:
        model = tiny(args.arch, args.device)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    want = generate(model, ids, args.new_tokens)
    jitted = jit_forward(model, args.mode, compile=args.compile)
    got = generate(model, ids, args.new_tokens)
    stats = jitted.stats()
    out = {
        "device": args.device,
        "mode": args.mode,
        "compile": args.compile,
        "tokens_equal": bool(torch.equal(got, want)),
        "tokens": got[:, args.prompt_len :].tolist(),
        "signatures": len(jitted.entries),
        "stats": {k: stats["total"][k] for k in ("traces", "captures", "replays", "fast", "copies")},
        "fallbacks": {k: v for k, v in stats["fallbacks"].items() if v},
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
