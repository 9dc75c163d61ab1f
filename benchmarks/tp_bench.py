"""Decode-step latency, tensor parallel: TP=1 (one GPU, this process) vs TP=2 (two ranks spawned by examples.tp.launch,
NCCL all-reduces and the logits all-gather inside the CUDA graphs), for the same random bf16 weights.

  eager              the step called directly (batch already on the device)
  fg-NONE / fg-PIECEWISE / fg-FULL   fgraph.jit of the step, batch passed from the host each call

B sequences decoding at position ctx/2; CUDA-event means over back-to-back calls, median of reps; TP=2 times are
rank 0's (every rank runs the same calls: the collectives keep them in step).
usage (device, 2 GPUs): source .gpu/activate.sh; python3 -m benchmarks.tp_bench [--model llama3-8b] [--batches 1 64]
Writes tp.json under $OUT (or benchmarks/results).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch

import fgraph
from examples import llama, tp
from fgraph.ops import attention as A

from .common import decode_batch, gpu_ms


def measure(cfg, params, step, local_cfg, a) -> dict:
    """ms per decode step for every (batch, mode): the same calls in the same order on every rank."""
    backend, dev = A.resolve_backend(a.backend, "cuda"), params.embed.device
    ps = A.page_size_for(backend)
    cache = llama.init_cache(local_cfg, 1 + max(a.batches) * -(-a.ctx // ps), ps, torch.bfloat16, dev)
    spec = llama.Batch(fgraph.Batched(pad=0), fgraph.Batched(pad=0), A.metadata_batching())
    out = {}
    with torch.no_grad():
        for B in a.batches:
            batch, _ = decode_batch(cfg.vocab_size, B, a.ctx, ps)
            on_dev = llama.Batch(batch.tokens.to(dev), batch.positions.to(dev), batch.meta.to(dev))
            out[B, "eager"] = gpu_ms(lambda: step(params, cache, on_dev, "decode"))
            for mode in a.modes:  # a new jitted step per cell: its graphs go when the next one replaces it
                f = fgraph.jit(
                    step,
                    static=["routine"],
                    donate=["cache"],
                    batch={"batch": spec},
                    mode=mode.split("+")[0],
                    compile=mode.endswith("+C"),
                    buckets=[B],
                    copy_outputs=False,  # zero-copy: outputs are read before the next call
                )  # "FULL+C": Inductor-compiled pieces
                f(params, cache, batch, routine="decode")  # trace + capture
                out[B, f"fg-{mode}"] = gpu_ms(lambda: f(params, cache, batch, routine="decode"))
    return out


def _rank(t: tp.TP, a) -> dict:
    cfg = llama.preset(a.model)
    full = llama.init_params(cfg, torch.bfloat16, f"cuda:{torch.cuda.current_device()}", seed=0)
    mine = tp.shard_params(full, cfg, t)  # the same seed on every rank, then each keeps its shard
    del full
    torch.cuda.empty_cache()
    step = tp.make_step(cfg, t, A.resolve_backend(a.backend, "cuda"), a.ctx)
    out = measure(cfg, mine, step, tp.local_config(cfg, t.world), a)
    torch.cuda.synchronize()  # every graph done before the communicator goes with the process group
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--modes", nargs="+", default=["NONE", "PIECEWISE", "FULL"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args()
    if torch.cuda.device_count() < a.world:
        raise SystemExit(f"tp_bench: needs {a.world} GPUs, found {torch.cuda.device_count()}")
    cfg = llama.preset(a.model)
    params = llama.init_params(cfg, torch.bfloat16, "cuda", seed=0)
    one = measure(cfg, params, llama.make_step(cfg, A.resolve_backend(a.backend, "cuda"), a.ctx), cfg, a)
    del params
    gc.collect()
    torch.cuda.empty_cache()
    two = tp.launch(_rank, a.world, a, timeout_s=540)
    modes = ["eager"] + [f"fg-{m}" for m in a.modes]
    rows = [
        {"model": a.model, "batch": B, "ctx": a.ctx, "mode": m, "tp1_ms": one[B, m], f"tp{a.world}_ms": two[B, m]}
        for B in a.batches
        for m in modes
    ]
    os.makedirs(a.out, exist_ok=True)
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "world": a.world,
        "backend": A.resolve_backend(a.backend, "cuda"),
    }
    with open(os.path.join(a.out, "tp.json"), "w") as fh:
        json.dump({"info": info, "rows": rows}, fh, indent=1)
    print(
        f"\n{info['gpu']} x{a.world}, torch {info['torch']}, {info['backend']} attention, ctx {a.ctx}: "
        f"decode step, ms (TP=1 / TP={a.world} speedup)"
    )
    print(f"model | B | mode | TP=1 | TP={a.world} | speedup")
    for r in rows:
        t1, t2 = r["tp1_ms"], r[f"tp{a.world}_ms"]
        print(f"{r['model']} | {r['batch']} | {r['mode']} | {t1:.2f} | {t2:.2f} | {t1 / t2:.2f}x")


if __name__ == "__main__":
    main()
