"""Decode-step latency, tensor parallel: TP=1 (one GPU, this process) vs TP=2 (two ranks spawned by examples.tp.launch)
with each all-reduce implementation, for the same random bf16 weights.

  eager                                  the step called directly (batch already on the device)
  fg-NONE / fg-PIECEWISE / fg-FULL[+C]   fgraph.jit of the step, batch passed from the host each call
  all-reduce impls (TP=2)                nccl: functional NCCL collectives; symm: symmetric-memory one-shot for
                                         small messages (examples/allreduce.py). Both inside the CUDA graphs.

B sequences decoding at position ctx/2. Each cell is timed in alternating rounds (nccl, symm, nccl, symm, ...):
CUDA-event means over back-to-back calls; the table shows the median over rounds and the spread (max - min).
TP=2 times are rank 0's (the collectives keep the ranks in step). The all-reduce's own time: one CUDA graph of
65 all-reduces of a [B, dim] bf16 message (a decode step's count for 32 layers), replayed, per all-reduce.
usage (device, 2 GPUs): source .gpu/activate.sh; python3 -m benchmarks.tp_bench [--model llama3-8b]
  [--batches 1 8 64] [--modes NONE PIECEWISE FULL FULL+C] [--all-reduce nccl symm] [--rounds 3]
Writes tp.json under $OUT (or benchmarks/results).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import attrs
import torch

from examples import llama, tp
from fgraph.ops import attention as A

from .common import decode_batch, gpu_ms, jit_step


def measure(cfg, params, steps: dict, local_cfg, a) -> dict:
    """{(B, mode, impl): (median ms, spread ms)} per decode step; `steps`: impl -> this rank's step. The same
    calls in the same order on every rank."""
    backend, dev = A.resolve_backend(a.backend, "cuda"), params.embed.device
    ps = A.page_size_for(backend)
    cache = llama.init_cache(local_cfg, 1 + max(a.batches) * -(-a.ctx // ps), ps, torch.bfloat16, dev)
    out = {}
    with torch.no_grad():
        for B in a.batches:
            batch, _ = decode_batch(cfg.vocab_size, B, a.ctx, ps)
            on_dev = llama.Batch(batch.tokens.to(dev), batch.positions.to(dev), batch.meta.to(dev))
            for mode in ["eager", *a.modes]:
                calls, made = {}, []
                for impl, step in steps.items():
                    if mode == "eager":
                        calls[impl] = lambda s=step: s(params, cache, on_dev, "decode")
                    else:
                        f = jit_step(step, mode, [B])
                        made.append(f)
                        f(params, cache, batch, routine="decode")  # trace + capture
                        calls[impl] = lambda f=f: f(params, cache, batch, routine="decode")
                times = {impl: [] for impl in calls}
                for _ in range(a.rounds):  # alternating rounds: drift hits every impl alike
                    for impl, call in calls.items():
                        times[impl].append(gpu_ms(call))
                for impl, ts in times.items():
                    out[B, mode, impl] = (statistics.median(ts), max(ts) - min(ts))
                for f in made:  # the cache is the step's (shared per function and options): free its graphs now
                    f.reset()
                del calls, made
                gc.collect()
    return out


def all_reduce_us(t: tp.TP, dim: int, batches: list[int], impls: list[str]) -> dict:
    """{(B, impl): us per all-reduce} from one CUDA graph of 65 all-reduces of [B, dim] bf16 (no launch cost)."""
    out = {}
    for B in batches:
        x = torch.randn(B, dim, dtype=torch.bfloat16, device="cuda")
        for impl in impls:
            ti = attrs.evolve(t, all_reduce_impl=impl)
            for _ in range(3):
                ti.all_reduce(x)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = x
                for _ in range(65):
                    y = ti.all_reduce(y) * 0.5  # keeps values bounded; one small elementwise kernel each
            out[B, impl] = 1e3 * gpu_ms(g.replay) / 65
            del g, y
    return out


def _rank(t: tp.TP, a) -> dict:
    cfg = llama.preset(a.model)
    full = llama.init_params(cfg, torch.bfloat16, f"cuda:{torch.cuda.current_device()}", seed=0)
    mine = tp.shard_params(full, cfg, t)  # the same seed on every rank, then each keeps its shard
    del full
    torch.cuda.empty_cache()
    backend = A.resolve_backend(a.backend, "cuda")
    steps = {i: tp.make_step(cfg, attrs.evolve(t, all_reduce_impl=i), backend, a.ctx) for i in a.all_reduce}
    out = {"steps": measure(cfg, mine, steps, tp.local_config(cfg, t.world), a)}
    out["all_reduce"] = all_reduce_us(t, cfg.dim, a.batches, a.all_reduce)
    torch.cuda.synchronize()  # every graph done before the communicator goes with the process group
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--modes", nargs="+", default=["NONE", "PIECEWISE", "FULL", "FULL+C"])
    ap.add_argument("--all-reduce", nargs="+", default=["nccl", "symm"], choices=["nccl", "symm"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args()
    if torch.cuda.device_count() < a.world:
        raise SystemExit(f"tp_bench: needs {a.world} GPUs, found {torch.cuda.device_count()}")
    cfg = llama.preset(a.model)
    params = llama.init_params(cfg, torch.bfloat16, "cuda", seed=0)
    step = llama.make_step(cfg, A.resolve_backend(a.backend, "cuda"), a.ctx)
    one = measure(cfg, params, {"-": step}, cfg, a)
    del params, step
    gc.collect()
    torch.cuda.empty_cache()
    two = tp.launch(_rank, a.world, a, timeout_s=540, all_reduce="symm" if "symm" in a.all_reduce else "nccl")
    rows = [
        {
            "model": a.model,
            "batch": B,
            "ctx": a.ctx,
            "mode": m,
            "tp1_ms": one[B, m, "-"][0],
            "tp1_spread_ms": one[B, m, "-"][1],
            **{f"tp{a.world}_{i}_ms": two["steps"][B, m, i][0] for i in a.all_reduce},
            **{f"tp{a.world}_{i}_spread_ms": two["steps"][B, m, i][1] for i in a.all_reduce},
        }
        for B in a.batches
        for m in ["eager", *a.modes]
    ]
    ar = [{"batch": B, "impl": i, "us": two["all_reduce"][B, i]} for B in a.batches for i in a.all_reduce]
    os.makedirs(a.out, exist_ok=True)
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "world": a.world,
        "backend": A.resolve_backend(a.backend, "cuda"),
        "rounds": a.rounds,
    }
    with open(os.path.join(a.out, "tp.json"), "w") as fh:
        json.dump({"info": info, "rows": rows, "all_reduce": ar}, fh, indent=1)
    w = a.world
    print(
        f"\n{info['gpu']} x{w}, torch {info['torch']}, {info['backend']} attention, ctx {a.ctx}, {a.rounds} "
        "alternating rounds: decode step, ms, median (spread); speedup = TP=1 / TP=2"
    )
    head = " | ".join(f"TP={w} {i} | speedup" for i in a.all_reduce)
    print(f"model | B | mode | TP=1 | {head}")
    for r in rows:
        t1 = r["tp1_ms"]
        cells = " | ".join(
            f"{r[f'tp{w}_{i}_ms']:.2f} ({r[f'tp{w}_{i}_spread_ms']:.2f}) | {t1 / r[f'tp{w}_{i}_ms']:.2f}x"
            for i in a.all_reduce
        )
        print(f"{r['model']} | {r['batch']} | {r['mode']} | {t1:.2f} ({r['tp1_spread_ms']:.2f}) | {cells}")
    print(f"\nall-reduce of [B, {cfg.dim}] bf16, us per call (65 in one CUDA graph)")
    print("B | " + " | ".join(a.all_reduce))
    for B in a.batches:
        print(f"{B} | " + " | ".join(f"{two['all_reduce'][B, i]:.1f}" for i in a.all_reduce))


if __name__ == "__main__":
    main()
