"""The triton backend's decode kernel under each of its knobs: the attention op alone, replayed in a CUDA graph, per
shape, batch and context, in one process, alternating rounds; every variant's output checked against the default's.

  python3 scripts/ab_decode_attn.py [--cells 0.5b:1:1024 0.5b:64:1024 ...] [--rounds 3] [--variants default even ...]

A cell is model:B:max_seq_len, every sequence at half of max_seq_len (decode_bench's cells: the graph is sized for
max_seq_len, the sequences are shorter). Variants set `fgraph.ops._attn_triton`'s constants for their timing:
  default     as shipped
  even/uneven EVEN_SPLITS on/off: a sequence's own keys over the splits (none past its end), or max_seq_len's
  waves4/16   WAVES: programs per SM the split count aims at (splits_for)
  splits8/4   MAX_SPLITS
  block32     BLOCK_N 32 (keys per block)
  stages2/4   DECODE_STAGES
  warps2/8    decode's num_warps
  wWsS[e]     num_warps W and DECODE_STAGES S (and with `e`, EVEN_SPLITS)
One JSON line per (cell, variant): us (the median over rounds of CUDA-event means), floor_us (the K and V bytes the
sequences hold, at this run's copy bandwidth), max_diff (largest |out - default's out|); then a line per cell naming
the fastest.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from benchmarks.common import copy_bandwidth, gpu_ms, knobs
from fgraph.ops import _attn_triton as T
from fgraph.ops import attention as A

SHAPES = {"0.5b": (14, 2, 64), "8b": (32, 8, 128)}
VARIANTS = {
    "default": {},
    "even": {"EVEN_SPLITS": True},
    "uneven": {"EVEN_SPLITS": False},
    "waves4": {"WAVES": 4},
    "waves16": {"WAVES": 16},
    "splits8": {"MAX_SPLITS": 8},
    "splits4": {"MAX_SPLITS": 4},
    "block32": {"BLOCK_N": 32},
    "stages2": {"DECODE_STAGES": 2},
    "stages4": {"DECODE_STAGES": 4},
    "warps2": {"_decode_warps": lambda *a: 2},
    "warps8": {"_decode_warps": lambda *a: 8},
    "even+waves16": {"EVEN_SPLITS": True, "WAVES": 16},
}


def settings_of(name: str) -> dict:
    """A VARIANTS name, or wWsS[e]: num_warps W, DECODE_STAGES S, and with `e` EVEN_SPLITS."""
    if name in VARIANTS:
        return VARIANTS[name]
    w, _, rest = name[1:].partition("s")
    got = {"_decode_warps": lambda *a, w=int(w): w, "DECODE_STAGES": int(rest.rstrip("e"))}
    return got | ({"EVEN_SPLITS": True} if rest.endswith("e") else {})


def cell_case(model: str, batch: int, max_seq: int):
    """(step(), out, floor bytes): one decode call of `batch` sequences at max_seq // 2 keys each, scattered pages."""
    hq, hkv, d = SHAPES[model]
    page = A.page_size_for("triton")
    max_pages = math.ceil(max_seq / page)
    g = torch.Generator().manual_seed(0)
    num_pages = 1 + batch * max_pages
    k_cache = torch.randn(num_pages, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    pages = (torch.randperm(num_pages - 1, generator=g) + 1).view(batch, max_pages).tolist()
    n = max_seq // 2
    meta = A.build_metadata([1] * batch, [n] * batch, pages, page, max_pages).to("cuda")
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(batch, hkv, d, dtype=torch.bfloat16, device="cuda"), torch.randn_like(q[:, :hkv])
    out = torch.empty_like(q)

    def step():
        out.copy_(A.attention(q, k, v, k_cache, v_cache, meta, backend="triton", routine="decode", max_seq_len=max_seq))

    return step, out, 2 * batch * n * hkv * d * 2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", nargs="+", default=["0.5b:1:1024", "0.5b:64:1024", "0.5b:8:8192", "0.5b:64:8192",
                                                  "8b:1:1024", "8b:64:1024"])  # fmt: skip
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args(argv)
    bw = copy_bandwidth()
    print(
        json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gb_s": round(bw / 1e9)})
    )
    for cell in args.cells:
        model, batch, max_seq = cell.split(":")
        step, out, kv_bytes = cell_case(model, int(batch), int(max_seq))
        graphs, outs = {}, {}
        for name in args.variants:
            with knobs(T, settings_of(name)):
                step()  # compiles this variant's kernel outside the capture
                torch.cuda.synchronize()
                outs[name] = out.clone()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
                graphs[name] = g
        times = {name: [] for name in graphs}
        for r in range(args.rounds):
            for name in graphs if r % 2 == 0 else list(graphs)[::-1]:
                times[name].append(gpu_ms(graphs[name].replay, args.iters) * 1e3)
        base = statistics.median(times["default"]) if "default" in times else None
        for name in graphs:
            us = statistics.median(times[name])
            row = {"cell": cell, "variant": name, "us": round(us, 2), "spread": round(max(times[name]) - min(times[name]), 2),
                   "floor_us": round(kv_bytes / bw * 1e6, 2), "vs_default": round(us / base, 3) if base else None,
                   "max_diff": float((outs[name].float() - outs["default"].float()).abs().max()) if "default" in outs
                   else None}  # fmt: skip
            print(json.dumps(row), flush=True)
        best = min(graphs, key=lambda k: statistics.median(times[k]))
        default = f"default {base:.2f} us, " if base else ""
        print(f"# {cell}: {default}best {best} {statistics.median(times[best]):.2f} us", flush=True)
        del graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
