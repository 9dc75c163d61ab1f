"""Where a first generate's seconds go: benchmarks.hf_bench (or --module's main, as the CLI examples.generate) run in
this process (its arguments after `--`), with wall-time counters on the calls that make up a cold start, split by
thread (the main thread's are what the first generate waits for; the tuner compiles in a pool of its own). One JSON
line at exit, to stdout and appended to $OUT/startup_profile.jsonl: `main_s` when the module's main returned,
`wall_s` at the line (the exit handlers registered after this script's, fgraph's compile workers' among them, between
the two), and the CLI's `phases_s`.

  python3 scripts/startup_profile.py --tag fgraph -- --batches 1 --new 16 --first-only --skip hf_compile_static ...
  python3 scripts/startup_profile.py --tag cli --config compile_workers=0 --module examples.generate -- --compile ...

Give each run fresh TORCHINDUCTOR_CACHE_DIR and TRITON_HOME, and no TRITON_CACHE_DIR, for a user's cold start. A call
inside another counted call counts in both (the tuner's rows hold its timings and compiles).

  --load-at-first-launch: the tuner's candidates compiled in its threads but loaded (module and launcher) where each
                          first launches, in the timing loop: the tuner's other way, for an A/B in one command
"""

from __future__ import annotations

import argparse
import ast
import atexit
import functools
import importlib
import json
import os
import sys
import threading
import time

# (module, attribute path) -> what the row calls it
TIMED = {
    ("triton.runtime.jit", "JITFunction._do_compile"): "triton_compile",
    ("triton.compiler.compiler", "CompiledKernel._init_handles"): "triton_load",
    ("triton.runtime.build", "compile_module_from_src"): "launcher_build",
    ("triton.backends.nvidia.driver", "compile_module_from_src"): "launcher_build",
    ("triton.testing", "do_bench_cudagraph"): "graph_timing",
    ("torch._inductor.compile_fx", "compile_fx"): "inductor",
    ("torch._dynamo.convert_frame", "ConvertFrameAssert.__call__"): "dynamo_frame",
    ("fgraph.kernels._gemv", "_tune"): "tuner_key",
    ("fgraph.kernels._gemv", "_tune_group"): "tuner_key",
    ("fgraph.kernels._gemv", "_fastest"): "tuner_search",
    ("fgraph.kernels._workers", "precompile"): "worker_compile",
    ("torch.cuda.graphs", "CUDAGraph.capture_end"): "graph_capture_end",
}
stats: dict[str, dict] = {}


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        where = "main" if threading.current_thread() is threading.main_thread() else "other"
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            row = stats.setdefault(f"{name}/{where}", {"calls": 0, "s": 0.0})
            row["calls"] += 1
            row["s"] += time.perf_counter() - t0
            if name == "triton_compile" and where == "main":  # (which kernels a first call still waits for)
                row.setdefault("kernels", []).append(getattr(args[0], "__name__", "?"))

    return wrapper


def instrument() -> list[str]:
    """Wrap every TIMED callable that this environment has; the names of those it lacks."""
    missing = []
    for (module, path), name in TIMED.items():
        try:
            owner = importlib.import_module(module)
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            setattr(owner, attr, _timed(name, getattr(owner, attr)))
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    return missing


def load_at_first_launch() -> None:
    from fgraph.kernels import _workers

    _workers.compile_and_load = lambda fn, grid, *args, **kwargs: fn.warmup(*args, grid=grid, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tag", required=True)
    p.add_argument("--load-at-first-launch", action="store_true")
    p.add_argument("--module", default="benchmarks.hf_bench", help="whose main(argv) runs: hf_bench, or the CLI's")
    p.add_argument("--config", action="append", default=[], metavar="NAME=VALUE", help="an fgraph.config switch")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    a = p.parse_args()
    t0 = time.perf_counter()
    missing = instrument()
    import fgraph

    for item in a.config:
        name, value = item.split("=", 1)
        setattr(fgraph.config, name, ast.literal_eval(value))
    done = {}
    if a.load_at_first_launch:
        load_at_first_launch()

    def report():
        from fgraph.kernels import linear_counts, linear_seconds

        row = {
            "tag": a.tag,
            "config": a.config,
            "load_at_first_launch": a.load_at_first_launch,
            **done,
            "wall_s": round(time.perf_counter() - t0, 2),
        }
        row |= {k: {**v, "s": round(v["s"], 2)} for k, v in sorted(stats.items())}
        from fgraph.kernels import compile_worker_counts

        row |= {"linear_s": {k: round(v, 2) for k, v in linear_seconds.items()}, "linear": dict(linear_counts)}
        row["compile_workers"] = dict(compile_worker_counts)
        row["not_timed"] = missing
        print(json.dumps(row), flush=True)
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "startup_profile.jsonl"), "a") as fh:  # (one file: the device returns few)
                fh.write(json.dumps(row) + "\n")

    atexit.register(report)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (the repo's packages)
    result = importlib.import_module(a.module).main([x for x in a.rest if x != "--"])
    done["main_s"] = round(time.perf_counter() - t0, 2)
    if isinstance(result, dict) and "phases_s" in result:  # (the CLI's: where its start went)
        done["phases_s"] = {k: v and round(v, 2) for k, v in result["phases_s"].items()}


if __name__ == "__main__":
    main()
