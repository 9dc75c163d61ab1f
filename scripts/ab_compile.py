"""Compiled pieces, symbolic or specialised: one decode step (FULL+C) served by the shared symbolic compilation
against the same step with its pieces compiled for the bucket's own static shapes (fgraph.config.compile_static_max),
in one process, alternating rounds; with graph count, pool memory, host time per call and the logits checked.

  python3 scripts/ab_compile.py [--preset qwen2.5-0.5b] [--backend flash_attn] [--batches 1 64] [--ctx 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.utils._pytree as pytree

import fgraph
from benchmarks.common import decode_batch, device_name, jit_step, sync, time_ms
from examples import llama
from fgraph.compile import compiler
from fgraph.ops import attention as A


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--backend", default="flash_attn")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: a check of the script, tiny preset, torch)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = llama.preset(a.preset)
    params = llama.init_params(cfg, dtype, dev, seed=0)
    ps = A.page_size_for(a.backend)
    pages = 1 + max(a.batches) * -(-a.ctx // ps)
    cache = llama.init_cache(cfg, pages, ps, dtype, dev)
    step = llama.make_step(cfg, backend=a.backend, max_seq_len=a.ctx)
    batches = {B: decode_batch(cfg.vocab_size, B, a.ctx, ps)[0] for B in a.batches}
    with torch.no_grad():
        on = {
            B: pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, b) for B, b in batches.items()
        }
        eager = {B: step(params, cache, on[B], "decode")[0].float() for B in batches}
    jitted = {}
    for name, static_max in (("symbolic", 0), ("static", max(a.batches))):
        fgraph.config.compile_static_max = static_max
        before = dict(compiler.counts)
        t0 = time.perf_counter()
        f = jit_step(llama.make_step(cfg, backend=a.backend, max_seq_len=a.ctx), "FULL+C", a.batches)
        f.capture(params, cache, batches[a.batches[0]], routine="decode", progress=False)
        secs = time.perf_counter() - t0
        d = {k: round(compiler.counts[k] - before[k], 1) for k in before}
        es = list(f.entries.values())
        print(json.dumps({"variant": name, "capture_s": round(secs, 1), "inductor": d,
                          "graphs": sum(len(e.graphs) for e in es),
                          "pool_gib": round(sum(e.pool_bytes for e in es) / 2**30, 3),
                          "hows": sorted({c.how for e in es for c in e.compiled.values()})}), flush=True)  # fmt: skip
        jitted[name] = f
    fgraph.config.compile_static_max = 0
    for B, b in batches.items():
        for name, f in jitted.items():
            got = f(params, cache, b, routine="decode")[0].float()
            err = ((got - eager[B]).abs().max() / eager[B].abs().max()).item()
            print(json.dumps({"B": B, "variant": name, "rel_err_vs_eager": round(err, 4)}), flush=True)
        times = {name: [] for name in jitted}
        for _ in range(a.rounds):  # alternating: symbolic, static, symbolic, ...
            for name, f in jitted.items():
                times[name].append(time_ms(lambda f=f: f(params, cache, b, routine="decode"), device=dev))
        for name, ts in times.items():
            host = []
            for _ in range(50):  # the host's part of a call: the time until the call returns, the GPU idle before it
                sync(dev)
                t0 = time.perf_counter()
                jitted[name](params, cache, b, routine="decode")
                host.append((time.perf_counter() - t0) * 1e6)
            sync(dev)
            print(json.dumps({"B": B, "variant": name, "ms_median": round(statistics.median(ts), 4),
                              "ms_spread": round(max(ts) - min(ts), 4), "host_us_median": round(statistics.median(host), 1),
                              "device": device_name(dev)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
