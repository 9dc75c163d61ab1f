"""CPU start-up of compiled pieces: the tiny preset with 8 layers, 8 buckets, both routines compiled and captured up
front, in a fresh process on an empty Inductor cache (cold), then in another on the cache it left (warm).

  python3 -m benchmarks.cpu_startup [--layers 8]

Prints one line per row (seconds from the process's start to a captured engine) and the warm/cold ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]


def child(layers: int) -> None:
    import torch

    from examples import engine, llama

    cfg = llama.LlamaConfig(**{**llama.presets["tiny"], "n_layers": layers})
    params = llama.init_params(cfg, torch.float32, "cpu", seed=0)
    engine.build(
        cfg, params, backend="torch", mode="FULL", buckets=BUCKETS, max_batch_tokens=max(BUCKETS),
        max_seqs=max(BUCKETS), max_seq_len=64, page_size=4, compile=True, capture=True,
    )  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.cpu_startup", description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.layers)
        return {}
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for row in ("cold", "warm"):
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "benchmarks.cpu_startup", "--child", "--layers", str(a.layers)]
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            out[row] = time.perf_counter() - t0
            print(f"{row}: {out[row]:.1f} s", flush=True)
    print(f"warm / cold: {out['warm'] / out['cold']:.2f}")
    return out


if __name__ == "__main__":
    main()
