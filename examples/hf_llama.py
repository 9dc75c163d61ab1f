"""An unmodified Hugging Face model through fgraph.jit: `python -m examples.hf_llama [--mode FULL] [--device cuda]`.

A tiny random `LlamaForCausalLM` (made with `transformers` from a config: no network, no checkpoint) is jitted
as it is, `fgraph.jit(model)`: its parameters and buffers become inputs of the traced function, read in place,
and `input_ids` [B, T] is Batched along the sequences (B is padded to a bucket, the logits sliced back). Greedy
generation without a KV cache (`use_cache=False`: the whole sequence each step, a new signature per length) checks
every step's logits and tokens against the eager model.

What the model needed, and nothing else: `use_cache=False` (a DynamicCache is Python state that grows per call)
and no `attention_mask` (all sequences are full length; the causal mask is built from shapes alone).
"""

from __future__ import annotations

import argparse
import json

import torch

import fgraph


def tiny_llama(device: str = "cpu", dtype=torch.float32, seed: int = 0, layers: int = 2):
    """A random 2-layer Llama: hidden 64, 4 heads (2 KV heads), vocab 128 (the config's own special tokens)."""
    from examples.hf_generate import tiny

    return tiny("llama", device, dtype, seed, layers=layers, max_positions=128, special_tokens={})


def jit_model(model, mode: str = "FULL_AND_PIECEWISE", buckets=(1, 2, 4, 8)):
    """The model as it is, jitted: `input_ids` [B, T] Batched along B (sequences), everything else fixed."""
    return fgraph.jit(model, batch={"input_ids": fgraph.Batched(axis=0)}, mode=mode, buckets=list(buckets))


def logits(fn, input_ids: torch.Tensor) -> torch.Tensor:
    return fn(input_ids=input_ids, use_cache=False).logits


@torch.no_grad()
def generate(fn, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy: returns the ids [B, T + new_tokens] and each step's last-position logits [B, V]."""
    ids, steps = prompts, []
    for _ in range(new_tokens):
        last = logits(fn, ids)[:, -1].clone()  # (jitted outputs live in graph memory until the next call)
        steps.append(last)
        ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
    return ids, steps


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m examples.hf_llama", description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="FULL", help="NONE, PIECEWISE, FULL, FULL_AND_PIECEWISE")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=3, help="sequences (padded to a bucket)")
    p.add_argument("--prompt-len", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=4)
    args = p.parse_args(argv)
    model = tiny_llama(args.device)
    prompts = torch.randint(0, 128, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    prompts = prompts.to(args.device)
    jitted = jit_model(model, args.mode)
    want_ids, want = generate(model, prompts, args.new_tokens)
    got_ids, got = generate(jitted, prompts, args.new_tokens)
    out = {
        "device": args.device,
        "mode": args.mode,
        "tokens_equal": bool(torch.equal(got_ids, want_ids)),
        "logits_equal": all(torch.equal(a, b) for a, b in zip(got, want)),
        "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got, want)),
        "tokens": got_ids[:, args.prompt_len :].tolist(),
        "signatures": len(jitted.entries),  # one per sequence length (no KV cache)
        "stats": {
            k: sum(e.stats.as_dict()[k] for e in jitted.entries.values()) for k in ("traces", "captures", "replays")
        },
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
