"""One decode cell of one tree's fgraph, alone in its process: ms per call (that tree's decode_bench timing), the
kernels of one call and their GPU time (this tree's benchmarks/kernels.py), and how many calls synchronize the host
with the GPU (torch.cuda.set_sync_debug_mode). Run it on an older commit's tree and on this one to say whether a
change between them is GPU work (kernels) or host work showing through (wall time above the kernels' sum).

usage (device, repo root, .gpu carried):
  python3 scripts/ab_kernels.py TREE [--model qwen2.5-0.5b] [--backend flash_attn] [--mode FULL+C] [--cell 1024:1]
TREE: a checkout (git worktree add) whose benchmarks/decode_bench.py has make_jitted(cfg, backend, mode, max_ctx,
buckets), as every version since 2026-11-29 has. Prints one JSON line and the kernel table."""

import argparse
import importlib.util
import json
import os
import sys
import warnings

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_kernels():
    """This tree's benchmarks/kernels.py, whatever tree `benchmarks` resolves to (it imports only torch)."""
    spec = importlib.util.spec_from_file_location("ab_kernels_table", os.path.join(HERE, "benchmarks", "kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def peer_after(a, D, cfg, params, cache, batch, ctx, B, call, kernels, time_ms) -> dict:
    """fgraph's call timed again once torch.compile's peer exists in the process: alone, and in decode_bench's
    alternating rounds (D.timed_rounds) with the peer."""
    import torch

    from benchmarks.common import Budget

    peer = D.CompilePeer(cfg, params, cache, a.backend, ctx, Budget(300), 30)
    got = {}
    with torch.no_grad():
        b = D.on_device(batch, "cuda")
        name, comp = peer.for_batch(B, b, batch.meta, got)
        got["ms_after_peer"] = sorted(time_ms(call, "cuda") for _ in range(5))[2]
        got["gpu_us_after_peer"] = kernels.kernel_table(call)["gpu_us_per_step"]
        rounds = D.timed_rounds({"fgraph": call, name: lambda: comp(b, batch.meta)}, "cuda", 3)
    got["alternating_ms"] = {k: v[0] for k, v in rounds.items()}
    return got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--backend", default="flash_attn")
    p.add_argument("--mode", default="FULL+C")
    p.add_argument("--cell", default="1024:1")
    p.add_argument(
        "--peer-after",
        action="store_true",
        help="then build decode_bench's torch.compile peer (CompilePeer, as decode_bench does before its cells) and "
        "time fgraph's call again, alone and alternating with the peer",
    )
    a = p.parse_args(argv)
    kernels = load_kernels()
    sys.path.insert(0, os.path.abspath(a.tree))
    import torch

    from benchmarks import decode_bench as D
    from benchmarks.common import decode_batch, time_ms
    from examples import llama
    from fgraph.ops import attention as A

    ctx, B = map(int, a.cell.split(":"))
    dev, dtype = "cuda", torch.bfloat16
    cfg = llama.preset(a.model)
    params = llama.init_params(cfg, dtype, dev)
    ps = A.page_size_for(a.backend)
    cache = llama.init_cache(cfg, D.cache_pages([(ctx, B)], ps), ps, dtype, dev)
    f = D.make_jitted(cfg, a.backend, a.mode, ctx, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    batch, _ = decode_batch(cfg.vocab_size, B, ctx, ps, ctx)
    with torch.no_grad():
        call = lambda: f(params, cache, batch, routine="decode")  # noqa: E731
        call()
        torch.cuda.synchronize()
        ms = sorted(time_ms(call, dev) for _ in range(5))[2]
        t = kernels.kernel_table(call)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(5):
                call()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    if a.peer_after:
        row_after = peer_after(a, D, cfg, params, cache, batch, ctx, B, call, kernels, time_ms)
    syncs = sorted({str(w.message).splitlines()[0][:160] for w in seen})
    row = {
        "tree": a.tree,
        "cell": a.cell,
        "backend": a.backend,
        "mode": a.mode,
        "ms": ms,
        "wall_us_per_step": ms * 1e3,
        "gpu_us_per_step": t["gpu_us_per_step"],
        "kernels_per_step": t["kernels_per_step"],
        "sync_warnings_in_5_calls": len(seen),
        "syncs": syncs,
        "stats": f.stats().get("total") if isinstance(f.stats(), dict) else str(f.stats()),
    }
    if a.peer_after:
        row.update(row_after)
    print(json.dumps(row, default=str))
    for line in kernels.table_lines(f"{a.tree} {a.backend} {a.mode}", {**t, "top": t["rows"]}):
        print(line)


if __name__ == "__main__":
    main()
