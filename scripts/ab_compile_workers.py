"""The tuner's compile phase for one few-row matmul key, its candidates compiled for sm_90 (H100/H200) with no GPU:
in threads alone (fgraph.config.compile_workers 0), then with N worker processes; each in a fresh process and Triton
cache. Seconds and the workers' counts, one line each.

  python3 scripts/ab_compile_workers.py [--workers 0 2] [--m 1 --n 896 --k 4864]

The workers are started and given --settle seconds for their imports (in a step they start while Inductor compiles
the piece); then the candidates are queued for them as a piece's rewrite queues them (`_workers.ahead`) and the
tuner's compile runs at once, taking back what no worker has begun. Launch handles are not made (no GPU): the GPU's
share of `compile_and_load` is not in these seconds."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one(workers: int, m: int, n: int, k: int, settle: float) -> dict:
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime import driver

    import fgraph
    from fgraph.kernels import _gemv, _workers

    driver.set_active(_workers._Target(GPUTarget("cuda", 90, 32)))
    CompiledKernel._init_handles = lambda self: None  # (loading needs the GPU)
    fgraph.config.compile_workers = workers
    x, w, y = (torch.empty(*s, dtype=torch.bfloat16) for s in ((m, k), (n, k), (m, n)))
    todo = _gemv.builds(_gemv.candidates(m, n, k))
    _workers.prestart()
    time.sleep(settle if workers else 0)
    t0 = time.perf_counter()
    for c in todo:  # (queued for the workers, as compile_ahead does; nothing with 0)
        _gemv._launch(c, x, w, None, y, warm="ahead")
    unfit = _workers.make(todo, lambda c, warm: _gemv._launch(c, x, w, None, y, warm=warm))  # (as the tuner does)
    return {"workers": workers, "M": m, "N": n, "K": k, "kernels": len(todo), "unfit": len(unfit), "cpus": os.cpu_count(),
            "compile_s": round(time.perf_counter() - t0, 2), "counts": dict(_workers.counts)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--n", type=int, default=896)
    p.add_argument("--k", type=int, default=4864)
    p.add_argument("--settle", type=float, default=8.0)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # (a child: one measurement)
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.one, a.m, a.n, a.k, a.settle)))
        return
    for workers in a.workers:
        env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp()}
        cmd = [sys.executable, __file__, "--one", str(workers), "--m", str(a.m), "--n", str(a.n), "--k", str(a.k)]
        out = subprocess.run(cmd + ["--settle", str(a.settle)], env=env, capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
