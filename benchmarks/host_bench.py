"""Host time of fgraph's replay path on the CPU: what a FULL decode call costs in Python before and after the
graph launch, with the launch itself stubbed (no GPU needed, so any machine can repeat it).

The model has the leaf layout of a preset (its layer count: 24 for Qwen2.5-0.5B, 32 for Llama-3-8B) with tiny
dims, so the call does no real work; the CPU has no pinned mirror or H2D copy, so this times bind + flatten +
key lookup (dispatch), padding into the input buffers (write) and output slicing (outputs). On the H200's host the
same Python has run ~3x slower on a slower host (benchmarks/NOTES.md); this is the dev-loop number, not the target's.
Each cell twice: inputs copied by the call, and by the graph (fgraph.config.inputs_in_graph, the default: on
the CPU the write then pads into the graph's own mirror; the copy is the stubbed replay's).

Then the cost of guarded Python values (fgraph/trace/_callable.py: guard_values): the replay path of a small FULL
function reading 0, 1 and 10 globals, the launch stubbed; the difference per value is what a guard costs a call.

usage: python3 -m benchmarks.host_bench [--presets qwen2.5-0.5b llama3-8b] [--batches 1 64] [--calls 5000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
import torch

import fgraph
from examples import llama
from fgraph.ops import attention as A

from .common import decode_batch, device_name
from .decode_bench import make_jitted


def median_us(fn, calls: int) -> float:
    for _ in range(min(calls, 500)):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def cell(preset: str, B: int, calls: int, in_graph: bool = False) -> dict:
    cfg = llama.preset(preset)
    cfg = attrs.evolve(cfg, dim=64, intermediate=128, vocab_size=256, n_heads=2, n_kv_heads=1, head_dim=32)
    params = llama.init_params(cfg, torch.float32, "cpu")
    ps = A.page_size_for("flashinfer")
    batch, pages = decode_batch(cfg.vocab_size, B, 1024, ps, 4096)
    cache = llama.init_cache(cfg, pages + 1, ps, torch.float32, "cpu")
    default, fgraph.config.inputs_in_graph = fgraph.config.inputs_in_graph, in_graph
    try:
        f = make_jitted(cfg, "torch", "FULL", 4096, [B])
        f(params, cache, batch, routine="decode")
    finally:
        fgraph.config.inputs_in_graph = default
    (entry,) = f.entries.values()
    out = entry.full.out
    entry.full.replay = lambda: out  # the launch, stubbed: everything else is the real replay path
    call = lambda: f(params, cache, batch, routine="decode")  # noqa: E731
    total = median_us(call, calls)
    leaves = [
        batch.tokens,
        batch.positions,
        *(getattr(batch.meta, k) for k in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")),
    ]
    write = median_us(lambda: entry.buffers.write(leaves, entry.specs, in_graph=True), calls)
    return {
        "preset": preset,
        "batch": B,
        "in_graph": in_graph,
        "leaves": len(entry.tensor_ix),
        "call_us": total,
        "write_us": write,
        "rest_us": total - write,
    }


def guard_cell(k: int, calls: int) -> dict:
    """us per replay of `x * (G0 + ... + G{k-1})` (k globals guarded; k = 0: a constant), the launch stubbed."""
    names = [f"G{i}" for i in range(k)]
    scope = {name: float(i) for i, name in enumerate(names)}
    exec(f"def read(x):\n    return x * ({' + '.join(names) or '1.0'})", scope)  # noqa: S102 (a benchmark's own)
    f = fgraph.jit(scope["read"], mode="FULL")
    x = torch.ones(4)
    f(x)
    (entry,) = f.entries.values()
    out = entry.full.out
    entry.full.replay = lambda: out
    assert len(f.lifted.guards) == k
    return {"guards": k, "call_us": median_us(lambda: f(x), calls)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "llama3-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--calls", type=int, default=5000)
    a = ap.parse_args(argv)
    rows = [cell(p, B, a.calls, g) for p in a.presets for B in a.batches for g in (False, True)]
    print(
        f"fgraph replay path on {device_name('cpu')}, torch {torch.__version__}: us per FULL decode call, the "
        "launch stubbed (median)\n"
    )
    print(
        "| preset (leaf layout) | B | inputs copied by | leaves | call | write (pad into buffers) | rest (dispatch, "
        "outputs) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['batch']} | {'the graph' if r['in_graph'] else 'the call'} | {r['leaves']} | "
            f"{r['call_us']:.1f} | {r['write_us']:.1f} | {r['rest_us']:.1f} |"
        )
    guards = [guard_cell(k, a.calls) for k in (0, 1, 10)]
    print("\n| globals guarded | call | over none |\n|---|---|---|")
    for r in guards:
        print(f"| {r['guards']} | {r['call_us']:.1f} | {r['call_us'] - guards[0]['call_us']:+.1f} |")
    return rows + guards


if __name__ == "__main__":
    main()
