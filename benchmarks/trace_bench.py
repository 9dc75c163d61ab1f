"""Trace time of a preset's decoder step on any machine (CPU; nothing runs, make_fx over fake tensors): each
routine's symbolic trace, with the dense layers traced once and copied (fgraph.repeated, the default) and with
every layer traced (repeated off), alternating in one process. Median seconds per trace.

usage: python3 -m benchmarks.trace_bench [--preset qwen2.5-0.5b] [--backend flash_attn] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

import fgraph
from examples import llama
from fgraph.ops import attention as A

from .common import decode_batch
from .decode_bench import make_jitted


def trace_seconds(cfg, backend: str, repeat: bool) -> list[float]:
    """Seconds of each routine's trace (fgraph.explain traces without running anything)."""
    params, cache, batch = _inputs(cfg, backend)
    real, fgraph.repeated = fgraph.repeated, (fgraph.repeated if repeat else lambda fn: fn)
    try:
        f = make_jitted(cfg, backend, "FULL_AND_PIECEWISE", 4096, [8, 16])
        out = []
        for routine in ("decode", "mixed"):
            out.append(fgraph.explain(f, params, cache, batch, routine=routine).entries[0].traced.seconds)
        return out
    finally:
        fgraph.repeated = real


@functools.cache
def _inputs(cfg, backend):
    """bf16 weights on the CPU (the trace reads only their shapes; 1 GB for 0.5B) and a 1-page-per-sequence cache."""
    ps = A.page_size_for(backend)
    batch, _ = decode_batch(cfg.vocab_size, 8, 1024, ps, 4096)
    return llama.init_params(cfg, torch.bfloat16, "cpu"), llama.init_cache(cfg, 2, ps, torch.bfloat16, "cpu"), batch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--backend", default="flash_attn", help="its break is opaque: the trace never calls the kernel")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    cfg = llama.preset(a.preset)
    trace_seconds(cfg, a.backend, True)  # the process's one-off first trace (imports of the symbolic machinery)
    got = {True: [], False: []}
    for _ in range(a.rounds):
        for repeat in (True, False):
            got[repeat] += trace_seconds(cfg, a.backend, repeat)
    print(f"{a.preset}, {cfg.n_layers} layers, {a.backend} break: seconds per routine trace (median of {2 * a.rounds})")
    for repeat, xs in got.items():
        print(
            f"  layers {'traced once, copied' if repeat else 'each traced':22s} {statistics.median(xs):6.2f}"
            f"  (min {min(xs):.2f}, max {max(xs):.2f})"
        )


if __name__ == "__main__":
    main()
