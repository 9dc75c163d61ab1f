"""Decode-step benchmark on the GPU: one process, the same pure step, side by side.

  eager       the step called directly (batch already on the device)
  graph       the eager step captured once with torch.cuda.graph (the ideal launch cost, no fgraph)
  compile     torch.compile(step, mode="reduce-overhead")
  fg-NONE / fg-PIECEWISE / fg-FULL   fgraph.jit of the same step, batch passed from the host each call
  floor       bytes the step must move (weights + KV read) / copy bandwidth measured in this run

Random bf16 weights (presets), KV context C with every sequence at position C/2. CUDA-event medians.
usage (device): source .gpu/activate.sh; python3 -m benchmarks.decode_bench [--quick]
Writes benchmarks/results/decode.json and decode.png (or under $OUT when set).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

import fgraph
from examples import llama
from fgraph.ops import attention as A

from .common import copy_bandwidth, decode_batch, gpu_ms

DEV = "cuda"


def weight_bytes(params) -> int:
  leaves = [params.norm, params.lm_head if params.lm_head is not None else params.embed]
  leaves += [t for layer in params.layers for t in (layer.attn_norm, layer.wqkv, layer.bqkv, layer.wo,
                                                     layer.mlp_norm, layer.w13, layer.w2) if t is not None]
  return sum(t.numel() * t.element_size() for t in leaves)


def modes_of(backend, modes, compiled):
  return list(modes) + [f"{m}+C" for m in compiled if backend in compiled.get(m, ())]


def fgraph_steps(cfg, backends, modes, compiled, max_ctx):
  """One jitted step per (backend, mode), shared by every cell: buckets >= 2 share one symbolic trace."""
  out = {}
  for backend in backends:
    step = llama.make_step(cfg, backend=backend, max_seq_len=max_ctx)
    for mode in modes_of(backend, modes, compiled):  # "FULL+C": the same mode, Inductor-compiled pieces
      spec = llama.Batch(fgraph.Batched(pad=0), fgraph.Batched(pad=0), A.metadata_batching())
      out[backend, mode] = fgraph.jit(step, static=["routine"], donate=["cache"], batch={"batch": spec},
                                      mode=mode.split("+")[0], compile=mode.endswith("+C"),
                                      buckets=[1, 8, 64, 256])
  return out


def bench_cell(cfg, params, caches, jitted, B, ctx, max_ctx, backends, bw, modes, compiled, peers):
  res = {"batch": B, "ctx": ctx}
  kv_read = cfg.n_layers * 2 * B * (ctx // 2 + 1) * cfg.n_kv_heads * cfg.head_dim * 2
  res["floor_ms"] = (weight_bytes(params) + kv_read) / bw * 1e3
  for backend in backends:
    ps = A.page_size_for(backend)
    batch, _ = decode_batch(cfg.vocab_size, B, ctx, ps, max_ctx)
    cache = caches[backend]
    with torch.no_grad():
      if peers and backend == backends[0]:
        step = llama.make_step(cfg, backend=backend, max_seq_len=max_ctx)
        dev_batch = llama.Batch(batch.tokens.to(DEV), batch.positions.to(DEV), batch.meta.to(DEV))
        res["eager_ms"] = gpu_ms(lambda: step(params, cache, dev_batch, "decode"))
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
          step(params, cache, dev_batch, "decode")
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
          step(params, cache, dev_batch, "decode")
        res["graph_ms"] = gpu_ms(g.replay)
        del g
        if peers == "compile":
          try:
            t0 = time.perf_counter()
            comp = torch.compile(step, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):
              comp(params, cache, dev_batch, "decode")
            res["compile_s"] = time.perf_counter() - t0
            res["compile_ms"] = gpu_ms(lambda: comp(params, cache, dev_batch, "decode"))
          except Exception as e:  # a peer that fails is a result too
            res["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
          torch._dynamo.reset()
      for mode in modes_of(backend, modes, compiled):
        f = jitted[backend, mode]
        t0 = time.perf_counter()
        f(params, cache, batch, routine="decode")  # traces (first bucket of the family) and captures
        res[f"{backend}/{mode}_setup_s"] = time.perf_counter() - t0
        res[f"{backend}/{mode}_ms"] = gpu_ms(lambda: f(params, cache, batch, routine="decode"))
        if mode.startswith("FULL"):
          res[f"{backend}/{mode}/host_us"] = host_time(f, params, cache, batch)
  return res


def host_time(f, params, cache, batch, n=200) -> float:
  """Host µs from entry to return of a replayed call (the GPU drained before each call)."""
  ts = []
  for _ in range(n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f(params, cache, batch, routine="decode")
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e6


def capture_cost(cfg, params, backend):
  """Capture of 2 routines x the default buckets, FULL_AND_PIECEWISE: seconds and pool GiB."""
  ps = A.page_size_for(backend)
  batch, _ = decode_batch(cfg.vocab_size, 1, 1024, ps)
  cache = llama.init_cache(cfg, 2 + 512 * (-(-1024 // ps)), ps, torch.bfloat16, DEV)
  step = llama.make_step(cfg, backend=backend, max_seq_len=4096)
  spec = llama.Batch(fgraph.Batched(pad=0), fgraph.Batched(pad=0), A.metadata_batching())
  f = fgraph.jit(step, static=["routine"], donate=["cache"], batch={"batch": spec}, mode="FULL_AND_PIECEWISE")
  torch.cuda.synchronize()
  t0 = time.perf_counter()
  f.capture(params, cache, batch, routine=["decode", "mixed"], progress=False)
  secs = time.perf_counter() - t0
  st = f.stats()["total"]
  out = {"backend": backend, "capture_s": secs, "graphs": st["captures"], "signatures": len(f.entries),
         "pool_GiB": sum(e.pool_bytes for e in f.entries.values()) / 2**30}
  del f, cache
  gc.collect()
  torch.cuda.empty_cache()
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama3-8b"])
  ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
  ap.add_argument("--ctx", nargs="+", type=int, default=[1024, 8192])
  ap.add_argument("--backends", nargs="+", default=["flash_attn", "flashinfer"])
  ap.add_argument("--modes", nargs="+", default=["NONE", "PIECEWISE", "FULL"])
  ap.add_argument("--no-peers", action="store_true")
  ap.add_argument("--compile-ctx", nargs="+", type=int, default=[1024], help="cells that run torch.compile")
  ap.add_argument("--compile-batches", nargs="+", type=int, default=[1, 64])
  ap.add_argument("--max-kv-gb", type=float, default=30.0)
  ap.add_argument("--compile-modes", nargs="*", default=["FULL"], help="modes also run with Inductor pieces")
  ap.add_argument("--compile-backends", nargs="*", default=["flash_attn"])
  ap.add_argument("--cells", nargs="*", default=None, help="ctx:batch pairs to run (default: all that fit)")
  ap.add_argument("--capture", action="store_true", help="also measure capture time and pool memory")
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  a = ap.parse_args()
  torch.manual_seed(0)
  bw = copy_bandwidth()
  info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_TBps": bw / 1e12,
          "command": "python3 -m benchmarks.decode_bench " + " ".join(os.sys.argv[1:])}
  print(json.dumps(info), flush=True)
  rows, caps = [], []
  max_ctx = max([a_ctx for a_ctx in a.ctx] + [int(c.split(":")[0]) for c in a.cells or []])
  for name in a.models:
    cfg = llama.preset(name)
    params = llama.init_params(cfg, torch.bfloat16, DEV)
    if a.capture and name == a.models[0]:  # the capture target is stated for the 0.5B model
      for backend in a.backends:
        caps.append({"model": name, **capture_cost(cfg, params, backend)})
        emit(a.out, caps[-1])
    cells = [tuple(map(int, c.split(":"))) for c in a.cells] if a.cells else \
        [(ctx, B) for ctx in a.ctx for B in a.batches]
    fits = [(ctx, B) for ctx, B in cells
            if cfg.n_layers * 2 * B * ctx * cfg.n_kv_heads * cfg.head_dim * 2 <= a.max_kv_gb * 1e9]
    for ctx, B in cells:
      if (ctx, B) not in fits:
        print(json.dumps({"model": name, "batch": B, "ctx": ctx, "skipped": f"KV cache over {a.max_kv_gb} GB"}))
    caches = {b: llama.init_cache(cfg, 1 + max(B * -(-ctx // A.page_size_for(b)) for ctx, B in fits),
                                  A.page_size_for(b), torch.bfloat16, DEV) for b in a.backends}
    compiled = {m: a.compile_backends for m in a.compile_modes}
    jitted = fgraph_steps(cfg, a.backends, a.modes, compiled, max_ctx)
    for ctx, B in fits:
      peers = False if a.no_peers else ("compile" if (ctx in a.compile_ctx and B in a.compile_batches) else True)
      r = {"model": name, **bench_cell(cfg, params, caches, jitted, B, ctx, max_ctx, a.backends, bw, a.modes,
                                       compiled, peers)}
      rows.append(r)
      emit(a.out, r)
    del params, caches, jitted
    gc.collect()
    torch.cuda.empty_cache()
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "decode.json"), "w") as fh:
    json.dump({"info": info, "rows": rows, "capture": caps}, fh, indent=1)
  allmodes = list(a.modes) + [f"{m}+C" for m in a.compile_modes]
  print_table(rows, a.backends, allmodes, info)
  plot(rows, a.backends, allmodes, os.path.join(a.out, "decode.png"))


def emit(out: str, row: dict):
  """Print a result and append it to decode.jsonl at once: a run cut short by its time limit keeps its rows."""
  print(json.dumps(row), flush=True)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "decode.jsonl"), "a") as fh:
    fh.write(json.dumps(row) + "\n")


def print_table(rows, backends, modes, info):
  cols = ["eager_ms", "graph_ms", "compile_ms"] + [f"{b}/{m}_ms" for b in backends for m in modes]
  short = {"eager_ms": "eager", "graph_ms": "graph", "compile_ms": "compile"}
  print(f"\n{info['gpu']}, torch {info['torch']}, copy {info['copy_TBps']:.2f} TB/s; ms per decode step "
        f"(x floor); {info['command']}")
  head = ["model", "ctx", "B", "floor"] + [short.get(c, c[:-3].replace("flash_attn", "fa2").replace("flashinfer", "fi"))
                                           for c in cols]
  print(" | ".join(head))
  for r in rows:
    cells = [r["model"], str(r["ctx"]), str(r["batch"]), f"{r['floor_ms']:.2f}"]
    for c in cols:
      v = r.get(c)
      cells.append("-" if v is None else f"{v:.2f} ({v / r['floor_ms']:.2f}x)")
    print(" | ".join(cells))


def plot(rows, backends, modes, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  cols = ["eager_ms", "graph_ms", "compile_ms"] + [f"{b}/{m}_ms" for b in backends for m in modes]
  fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.6), 4.5))
  w = 0.8 / len(cols)
  for k, c in enumerate(cols):
    ax.bar([i + k * w for i in range(len(rows))], [r.get(c, float("nan")) / r["floor_ms"] for r in rows], w,
           label=c[:-3])
  ax.set_xticks([i + 0.4 for i in range(len(rows))], [f"{r['model']}\nctx {r['ctx']} B {r['batch']}" for r in rows],
                fontsize=7)
  ax.set_yscale("log")
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_ylabel("decode step / floor (log)")
  ax.legend(fontsize=6, ncol=3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
