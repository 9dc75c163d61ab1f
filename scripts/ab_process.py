"""Which piece of torch.compile's presence in a process slows fgraph's already-captured decode step: one decode cell
of fgraph, timed (benchmarks.common.time_ms) and profiled after each of these, added one by one in one process:
  baseline          fgraph alone
  dynamo-imported   torch._dynamo and torch._inductor imported, params and cache marked static addresses
  compiled-plain    torch.compile(step, fullgraph=True, dynamic=False) without CUDA graphs, built and called
  compiled-ro       decode_bench's peer (mode="reduce-overhead": cudagraph trees), built and called
Per stage: ms per call, the kernels' GPU time per step and the span per step (first kernel start to last kernel
end over back-to-back profiled calls, / calls): span - kernels is the GPU idle time between kernels.

usage (device, repo root, .gpu carried):
  python3 scripts/ab_process.py [--model qwen2.5-0.5b] [--backend flash_attn] [--mode FULL+C] [--cell 1024:1]"""

import argparse
import importlib
import json
import statistics

import torch


def profile_span(fn, steps: int = 20) -> dict:
    """Kernel GPU time and wall span per step over `steps` back-to-back calls, from the profiler's kernel events."""
    from benchmarks.kernels import profile_calls

    prof = profile_calls(fn, steps)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {"kernels_us": None, "span_us": None}
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    return {"kernels_us": busy / steps, "span_us": (end - start) / steps, "launches": len(kernels) / steps}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--backend", default="flash_attn")
    p.add_argument("--mode", default="FULL+C")
    p.add_argument("--cell", default="1024:1")
    a = p.parse_args(argv)

    from benchmarks import decode_bench as D
    from benchmarks.common import Budget, decode_batch, time_ms
    from examples import llama
    from fgraph.ops import attention as A

    ctx, B = map(int, a.cell.split(":"))
    cfg = llama.preset(a.model)
    params = llama.init_params(cfg, torch.bfloat16, "cuda")
    ps = A.page_size_for(a.backend)
    cache = llama.init_cache(cfg, D.cache_pages([(ctx, B)], ps), ps, torch.bfloat16, "cuda")
    f = D.make_jitted(cfg, a.backend, a.mode, ctx, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    batch, _ = decode_batch(cfg.vocab_size, B, ctx, ps, ctx)
    b = D.on_device(batch, "cuda")
    call = lambda: f(params, cache, batch, routine="decode")  # noqa: E731
    rows = []

    def stage(name):
        torch.cuda.synchronize()
        ms = [time_ms(call, "cuda") for _ in range(5)]
        row = {"stage": name, "ms": statistics.median(ms), "ms_spread": max(ms) - min(ms), **profile_span(call)}
        row["idle_us"] = row["span_us"] - row["kernels_us"] if row["span_us"] is not None else None
        rows.append(row)
        print(json.dumps(row), flush=True)

    with torch.no_grad():
        call()
        stage("baseline")
        importlib.import_module("torch._inductor")
        for t in torch.utils._pytree.tree_leaves((params, cache)):
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t)
        stage("dynamo-imported")
        step = llama.make_step(cfg, backend=a.backend, max_seq_len=ctx)
        plain = torch.compile(step, fullgraph=True, dynamic=False)
        for _ in range(3):
            plain(params, cache, b, "decode")
        stage("compiled-plain")
        peer = D.CompilePeer(cfg, params, cache, a.backend, ctx, Budget(300), 30)
        got = {}
        peer.for_batch(B, b, batch.meta, got)
        stage("compiled-ro")
        print(json.dumps({"peer": got, "fgraph_stats": f.stats().get("total")}, default=str))


if __name__ == "__main__":
    main()
