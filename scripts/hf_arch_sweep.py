"""The README's Hugging Face recipe with compiled pieces across transformers' decoder architectures: a tiny random
model of each (hidden 64, 3 layers; its MoE with 4 experts), generate's tokens and logits against eager's, for each
setting of fgraph.config.compile_parts, and what Inductor compiled. A breadth check of the compiled path (whole, or cut
at every layer's attention) beyond the architectures the specs run.

  python3 scripts/hf_arch_sweep.py [--archs Llama Mixtral ...] [--parts off on] [--out FILE]

One JSON line a model and setting. On CUDA the pieces are the GPU's own; elsewhere they are rewritten as CUDA's are
(sdpa_decode as eager's math), so the cut runs on the CPU too. A model whose eager generate fails at these sizes is
reported (`eager_failed`), not counted; an fgraph error is reported with its first line (`fgraph_error`: a clear
refusal, such as a sliding-window cache's Python counter, which the recipe's full static cache then avoids); any
other error is a defect (`error`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# transformers' <Arch>Config and <Arch>ForCausalLM, each run with the sizes below
ARCHS = (
    "Llama Mistral Ministral Qwen2 Qwen3 Gemma Phi Phi3 Olmo Olmo2 Granite GPTNeoX StableLm Cohere Cohere2 Starcoder2 "
    "Falcon Glm Exaone4 SmolLM3 Helium Ernie4_5 Arcee Apertus Mixtral Qwen2Moe Qwen3Moe Phimoe GraniteMoe"
).split()
SIZES = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64, pad_token_id=None,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip
PROMPT, NEW = 6, 5


def tiny(arch: str, device: str):
    import torch
    import transformers as tf

    from examples.hf_generate import spread

    cfg_cls = getattr(tf, arch + "Config")
    sizes = {k: v for k, v in SIZES.items() if not isinstance(getattr(cfg_cls, k, None), property)}  # (Falcon's)
    cfg = cfg_cls(**sizes)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return spread(getattr(tf, arch + "ForCausalLM")(cfg)).to(device).eval()


def sliding(model) -> bool:
    kinds = getattr(model.config, "layer_types", None) or ()
    return bool(getattr(model.config, "sliding_window", None)) or "sliding_attention" in kinds


def row(arch: str, parts: bool, device: str) -> dict:
    import torch

    import fgraph
    from examples import hf_generate as G
    from fgraph.compile import compiler

    out = {"arch": arch, "compile_parts": parts, "device": device}
    fgraph.config.compile_parts = parts
    ids = torch.randint(1, 128, (3, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    try:
        base, model = tiny(arch, device), tiny(arch, device)
        full = sliding(base)  # (the recipe's cache for sliding-window layers: examples.hf_generate.full_static_cache)
        kw = lambda: dict(  # noqa: E731
            return_dict_in_generate=True, output_logits=True,
            **({G.cache_parameter(base): G.full_static_cache(base, PROMPT + NEW)} if full else {}),
        )  # fmt: skip
        want = [G.generate(base, ids[:b], NEW, **kw()) for b in (3, 2)]
    except Exception as e:
        return {**out, "eager_failed": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    before = dict(compiler.counts)
    t0 = time.perf_counter()
    try:
        G.jit_forward(model, compile=True)
        got = [G.generate(model, ids[:b], NEW, **kw()) for b in (3, 2)]  # (two batch sizes: two signatures)
    except fgraph.FgraphError as e:
        return {**out, "fgraph_error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    except Exception as e:
        return {**out, "error": f"{type(e).__module__}.{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    diff = max(
        ((torch.stack(g.logits) - torch.stack(w.logits)).abs().max() / torch.stack(w.logits).abs().max()).item()
        for g, w in zip(got, want)
    )
    made = {k: compiler.counts[k] - before[k] for k in ("compiled", "loaded", "shared", "sdpa", "cut", "repeats")}
    return {
        **out, "full_static_cache": full, "seconds": round(time.perf_counter() - t0, 1),
        "tokens_equal": all(torch.equal(g.sequences, w.sequences) for g, w in zip(got, want)),
        "logits_rel_diff": float(f"{diff:.2e}"), **made,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", nargs="+", default=list(ARCHS))
    p.add_argument("--parts", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--out", help="also append each row to this .jsonl")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (the repo's packages)
    import torch

    from benchmarks.common import rewrite_cpu_pieces

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        rewrite_cpu_pieces()
    for arch in a.archs:
        for setting in a.parts:
            r = row(arch, setting == "on", device)
            print(json.dumps(r), flush=True)
            if a.out:
                with open(a.out, "a") as fh:
                    fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
