"""Host time of a jitted Hugging Face forward on the replay path, on the CPU: `python3 -m benchmarks.hf_host`.

A 24-layer Qwen2 with tiny dims (hidden 64, 4 heads, 2 KV heads, vocab 256, SDPA), its forward jitted by the recipe
(`examples.hf_generate.jit_forward`, buckets 1 and 8), run by `generate(..., cache_implementation="static")`. Prints
per decode call, the median of `--loops` loops:

- `host_us`: FastPath.find with the jit object's LiftedView, called again and again on the last decode call's
  arguments (`benchmarks.hf_bench.host_us`: the same input tensors each time, which generate never passes twice);
- `find`: FastPath.find inside generate's own decode calls (new input tensors each step, the cache passed again);
- `call`: the whole jitted call (`Jitted.__call__`) less the traced program's own run (on the CPU a "replay" runs
  the program): what fgraph's Python adds to a decode call, the outputs rebuilt included;
- `program`: that run itself, for scale.

`--stub` times the call with the program stubbed (it returns its captured outputs). `--cache caller` passes one
early-initialised StaticCache to every generate (a server loop) instead of the one generate makes per call.
`--profile` prints cProfile's top functions over one generate.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from examples import hf_generate

from . import hf_bench
from .hf_bench import host_us


def make_model(layers: int = 24):
    return hf_bench.make_model(True, "cpu", torch.float32, layers)


def call_overhead_us(model, gen, tokens: int, stub: bool = False) -> tuple[float, float, float]:
    """(the jitted call less its program's runs, the program's runs, FastPath.find), us per decode call, over one
    generate. stub: the program returns what it returned at capture, without running (no model work between calls
    evicting the host's caches, as on a GPU host)."""
    jitted = model.forward
    entries = list(jitted.entries.values())
    spent, calls = [0.0], []
    runners = []
    for e in entries:
        graphs = [e.full] if e.full is not None else e.graphs
        for g in graphs:
            fn = g.fn

            def timed(*a, fn=fn, out=g.out):
                t0 = time.perf_counter()
                try:
                    return out if stub else fn(*a)
                finally:
                    spent[0] += time.perf_counter() - t0

            runners.append((g, fn))
            g.fn = timed
    call = type(jitted).__call__

    def wrapped(self, *a, **k):
        s0, t0 = spent[0], time.perf_counter()
        out = call(self, *a, **k)
        calls.append((time.perf_counter() - t0, spent[0] - s0))
        return out

    type(jitted).__call__ = wrapped
    try:
        with hf_bench.timed_find(model) as finds:
            gen(tokens)
    finally:
        type(jitted).__call__ = call
        for g, fn in runners:
            g.fn = fn
    decode = calls[3:]  # past the prefill and the calls that teach the replay path
    return (
        statistics.median((t - p) * 1e6 for t, p in decode),
        statistics.median(p * 1e6 for _, p in decode),
        statistics.median(finds[3:]),
    )


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.hf_host", description=__doc__.split("\n")[0])
    p.add_argument("--cache", choices=["generate", "caller"], default="generate")
    p.add_argument("--loops", type=int, default=5)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--stub", action="store_true", help="the program does not run (see call_overhead_us)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    import transformers as tf

    torch.set_num_threads(1)  # fgraph's host path is one thread; the program's intra-op threads only add noise

    model = make_model()
    hf_generate.jit_forward(model, "FULL_AND_PIECEWISE", buckets=[1, 8])
    ids = torch.randint(0, 256, (1, 32))
    extra = {"cache_implementation": "static"}
    if args.cache == "caller":
        cache = tf.StaticCache(config=model.config, max_cache_len=32 + args.tokens + 8)
        cache.early_initialization(1, 2, 16, torch.float32, "cpu")  # (batch, KV heads, head dim)
        extra = {hf_generate.cache_parameter(model): cache}

    def gen(n):
        if args.cache == "caller":
            cache.reset()
        with torch.no_grad():
            return model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, disable_compile=True, **extra,
            )  # fmt: skip

    gen(args.tokens), gen(args.tokens)  # trace, capture, teach the replay path
    replay, find, call, program = [], [], [], []
    for _ in range(args.loops):
        replay.append(host_us(model, lambda: gen(8))["replay_path"])
        c, r, f = call_overhead_us(model, gen, args.tokens, args.stub)
        call.append(c), program.append(r), find.append(f)
    med = lambda xs: round(statistics.median(xs), 1)  # noqa: E731
    print(
        f"host_us {med(replay)} us  find {med(find)} us  call {med(call)} us  program {med(program)} us"
        f"  (cache: {args.cache}{', program stubbed' if args.stub else ''})"
    )
    print(f"  loops: host_us {replay}  find {[round(x, 1) for x in find]}  call {[round(x, 1) for x in call]}")
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        gen(args.tokens)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    return {"host_us": med(replay), "find": med(find), "call": med(call), "program": med(program)}


if __name__ == "__main__":
    main()
