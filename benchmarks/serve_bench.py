"""Continuous batching on the GPU: PIECEWISE vs FULL_AND_PIECEWISE per attention backend (seed 1's comparison).

A synthetic ShareGPT-like workload with a fixed seed (~200 requests, prompts 4-1024 tokens, outputs 4-512, all
submitted at once), greedy, on the random-weight Qwen2.5-0.5B preset in bf16. Reports output throughput, TTFT
and TPOT, checks that greedy tokens are identical across modes, and writes benchmarks/results/serve.json.
usage (device): source .gpu/activate.sh; python3 -m benchmarks.serve_bench
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from examples import engine, llama


def workload(n: int, seed: int, vocab: int):
  """Log-normal-ish lengths like ShareGPT: many short prompts/answers, a long tail, clipped to the ranges."""
  g = torch.Generator().manual_seed(seed)
  plen = torch.exp(torch.randn(n, generator=g) * 1.0 + 5.0).clamp(4, 1024).long().tolist()
  olen = torch.exp(torch.randn(n, generator=g) * 1.0 + 4.8).clamp(4, 512).long().tolist()
  return [(torch.randint(1, vocab, (p,), generator=g).tolist(), o) for p, o in zip(plen, olen)]


def run(cfg, params, backend, mode, reqs, max_seqs, max_batch_tokens):
  t0 = time.perf_counter()
  eng = engine.build(cfg, params, backend=backend, mode=mode, max_seqs=max_seqs, max_seq_len=2048,
                     max_batch_tokens=max_batch_tokens)
  setup = time.perf_counter() - t0
  for prompt, out in reqs:
    eng.add(prompt, max_new_tokens=out)
  torch.cuda.synchronize()
  rep = eng.run(progress=False)
  med = lambda xs: statistics.median([x for x in xs if x is not None]) * 1e3
  res = {"backend": backend, "mode": mode, "setup_s": setup, "elapsed_s": rep.elapsed, "steps": rep.steps,
         "output_tokens": rep.output_tokens, "throughput_tok_s": rep.throughput, "ttft_p50_ms": med(rep.ttft),
         "tpot_p50_ms": med(rep.tpot), "fallbacks": eng.step_fn.stats()["fallbacks"]}
  return res, rep.tokens


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen2.5-0.5b")
  ap.add_argument("--requests", type=int, default=200)
  ap.add_argument("--backends", nargs="+", default=["flash_attn", "flashinfer"])
  ap.add_argument("--modes", nargs="+", default=["PIECEWISE", "FULL_AND_PIECEWISE"])
  ap.add_argument("--max-seqs", type=int, default=128)
  ap.add_argument("--max-batch-tokens", type=int, default=512)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  a = ap.parse_args()
  cfg = llama.preset(a.preset)
  params = llama.init_params(cfg, torch.bfloat16, "cuda")
  reqs = workload(a.requests, a.seed, cfg.vocab_size)
  info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "requests": len(reqs),
          "prompt_tokens": sum(len(p) for p, _ in reqs), "max_output_tokens": sum(o for _, o in reqs),
          "command": "python3 -m benchmarks.serve_bench " + " ".join(os.sys.argv[1:])}
  print(json.dumps(info), flush=True)
  rows = []
  for backend in a.backends:
    tokens = {}
    for mode in a.modes:
      r, tokens[mode] = run(cfg, params, backend, mode, reqs, a.max_seqs, a.max_batch_tokens)
      rows.append(r)
      print(json.dumps(r), flush=True)
    same = all(t == tokens[a.modes[0]] for t in tokens.values())
    for r in rows[-len(a.modes):]:
      r["tokens_identical_across_modes"] = same
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "serve.json"), "w") as fh:
    json.dump({"info": info, "rows": rows}, fh, indent=1)
  print(f"\n{info['gpu']}; {info['requests']} requests, {info['prompt_tokens']} prompt tokens; {info['command']}")
  print("backend | mode | setup s | tok/s | TTFT p50 ms | TPOT p50 ms | identical tokens | vs PIECEWISE")
  for r in rows:
    base = next(x for x in rows if x["backend"] == r["backend"] and x["mode"] == "PIECEWISE")
    print(f"{r['backend']} | {r['mode']} | {r['setup_s']:.1f} | {r['throughput_tok_s']:.0f} | "
          f"{r['ttft_p50_ms']:.0f} | {r['tpot_p50_ms']:.2f} | {r['tokens_identical_across_modes']} | "
          f"{r['throughput_tok_s'] / base['throughput_tok_s'] - 1:+.1%}")


if __name__ == "__main__":
  main()
