"""HF generate decode tokens/s: eager, torch.compile's static-cache recipe and fgraph.jit's, side by side.

    python3 -m benchmarks.hf_bench            # GPU: a Qwen2.5-0.5B-shaped random-weight model, bf16, ctx 1024
    python3 -m benchmarks.hf_bench --smoke    # CPU: a tiny model, a few seconds

B=1 and B=8. Contenders: HF eager (its default DynamicCache, and the static cache), HF + torch.compile (`model.forward =
torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`, cache_implementation="static") and HF +
fgraph.jit (`model.forward = fgraph.jit(model.forward, donate=["cache"])`, the static cache). The static-cache
contenders pass cache_implementation="static": generate makes the cache (its first prefill, eagerly for fgraph: the
cache's tensors are made lazily) and reuses it, reset, in later calls of no more tokens (the first call makes the
largest). Tokens are checked
against eager's before timing (with its DynamicCache, and with the static cache: the same math as the compiled
contenders'; bf16 kernels may differ between the two; the eager static row's own check says whether eager repeats
itself, and `first_different_token` where tokens part); rounds alternate between contenders; decode tokens/s = B * (N - 1) / (t(N) - t(1))
over generate calls of N and 1 new tokens; median and spread over rounds. One JSON line per cell to
$OUT/hf_bench.jsonl (and stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from examples import hf_generate


def make_model(smoke: bool, device: str, dtype):
    import transformers as tf

    if smoke:
        cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)  # fmt: skip
    else:  # Qwen2.5-0.5B's shapes
        cfg = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
    none = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    config = tf.Qwen2Config(**cfg, max_position_embeddings=4096, attn_implementation="sdpa", **none)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.Qwen2ForCausalLM(config).to(dtype).eval()
    model.generation_config.update(**none)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.hf_bench", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny model, no torch.compile")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ctx", type=int, default=None, help="prompt tokens (default 1024; smoke 32)")
    p.add_argument("--new", type=int, default=None, help="new tokens per timed generate (default 64; smoke 6)")
    p.add_argument("--rounds", type=int, default=None)
    args = p.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    ctx, new = args.ctx or (32 if smoke else 1024), args.new or (6 if smoke else 64)
    rounds = args.rounds or (2 if smoke else 5)
    base = make_model(smoke, device, dtype)
    contenders = {"hf_eager": base, "hf_eager_static": base}  # the reference of the static-cache contenders' math
    if not smoke:
        m = make_model(smoke, device, dtype)
        m.load_state_dict(base.state_dict())
        m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
        contenders["hf_compile_static"] = m
    m = make_model(smoke, device, dtype)
    m.load_state_dict(base.state_dict())
    hf_generate.jit_forward(m, "FULL_AND_PIECEWISE", buckets=[1, 8])  # `cache` (5.x) or `past_key_values` (4.x)
    contenders["hf_fgraph_static"] = m
    if not smoke:  # the same with Inductor-compiled pieces (an HF model has no break: its forward is one piece)
        m = make_model(smoke, device, dtype)
        m.load_state_dict(base.state_dict())
        hf_generate.jit_forward(m, "FULL_AND_PIECEWISE", buckets=[1, 8], compile=True)
        contenders["hf_fgraph_static_compiled"] = m
    out_dir = os.environ.get("OUT", ".")
    rows = []
    for B in args.batches:
        ids = torch.randint(0, base.config.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(B))
        ids = ids.to(device)
        if B != args.batches[0]:
            torch._dynamo.reset()  # torch.compile's recompile limit counts every shape met; each batch starts anew

        def gen(name, n):
            kw = {} if name == "hf_eager" else {"cache_implementation": "static"}  # the cache generate makes
            with torch.no_grad():
                return contenders[name].generate(
                    ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, disable_compile=True, **kw
                )

        want, want_static = gen("hf_eager", new), gen("hf_eager_static", new)
        got = {name: gen(name, new) for name in contenders}  # (also the warm-up)
        equal = {name: bool(torch.equal(t, want)) for name, t in got.items()}
        equal_static = {name: bool(torch.equal(t, want_static)) for name, t in got.items()}
        # the first new token that differs from eager's with the static cache (in any row; None: all equal)
        differs = {name: _first_difference(t[:, ctx:], want_static[:, ctx:]) for name, t in got.items()}
        times = {name: {1: [], new: []} for name in contenders}
        for _ in range(rounds):
            for n in (1, new):
                for name in contenders:  # alternating: every contender in every round
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    gen(name, n)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times[name][n].append(time.perf_counter() - t0)
        for name in contenders:
            rates = [B * (new - 1) / max(tn - t1, 1e-9) for t1, tn in zip(times[name][1], times[name][new])]
            row = {
                "bench": "hf_bench", "device": device, "dtype": str(dtype).removeprefix("torch."), "B": B, "ctx": ctx,
                "new_tokens": new, "contender": name, "tokens_equal_eager": equal[name],
                "tokens_equal_eager_static": equal_static[name], "first_different_token": differs[name],
                "decode_tok_s_median": statistics.median(rates), "decode_tok_s_min": min(rates),
                "decode_tok_s_max": max(rates), "rounds": rounds,
            }  # fmt: skip
            if name.startswith("hf_fgraph"):
                s = contenders[name].forward.stats()
                row["fgraph"] = {"total": s["total"], "fallbacks": s["fallbacks"], "signatures": len(s["signatures"])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "hf_bench.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    cols = (a != b).any(0).nonzero()
    return int(cols[0]) if len(cols) else None


if __name__ == "__main__":
    main()
