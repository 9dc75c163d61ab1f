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
`--parts` times, on the last decode call's arguments and in one process, FastPath.find, LiftedView.proven, the
whole call (the program stubbed), the model's own call of it (`module`) and that call as generate compiles it when it
compiles (`compiled`: transformers' `get_compiled_call`; fgraph's call is opaque inside it, a graph break: the
difference is what Dynamo's frames and guards around it cost), in 8 x `--loops` alternating rounds of thread CPU time
(the time another process takes on this machine's two cores is not counted): min and median per part. `--profile`
prints cProfile's top functions over one generate.
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


def parts_us(model, gen, rounds: int = 40, calls: int = 50) -> dict:
    """{part: (min, median)} us per call, of `rounds` alternating rounds of `calls` calls each, thread CPU time, on
    the last decode call's arguments: FastPath.find, LiftedView.proven, the whole jitted call with the program
    stubbed (the cache stays as it is: a stubbed program writes nothing)."""
    jitted, seen = model.forward, []
    fp = jitted.fastpath
    find = fp.find
    fp.find = lambda a, k, v=None: seen.append((a, k)) or find(a, k, v)
    try:
        gen(8)
    finally:
        fp.find = find
    a, k = seen[-1]
    with torch.no_grad():
        hit = find(a, k, jitted._view)
        assert hit is not None, "the replay path does not serve a decode call"
        e = hit.entry
        graphs = [e.full] if e.full is not None else e.graphs
        fns = [g.fn for g in graphs]
        for g in graphs:
            g.fn = lambda *x, out=g.out: out
        compiled = model.get_compiled_call(None)  # generate's own compile of the model's call (its default config)
        compiled(*a, **k)  # (compiled here, not timed)
        parts = {
            "find": lambda: find(a, k, jitted._view),
            "proven": jitted._view.proven,
            "call": lambda: jitted(*a, **k),
            "module": lambda: model(*a, **k),  # the module's __call__ around the jitted forward
            "compiled": lambda: compiled(*a, **k),  # that, inside generate's torch.compile (fgraph's call opaque)
        }
        got = {p: [] for p in parts}
        try:
            for r in range(rounds):
                for p in parts if r % 2 else list(parts)[::-1]:
                    fn, t0 = parts[p], time.thread_time()
                    for _ in range(calls):
                        fn()
                    got[p].append((time.thread_time() - t0) / calls * 1e6)
        finally:
            for g, fn in zip(graphs, fns):
                g.fn = fn
    return {p: (round(min(xs), 1), round(statistics.median(xs), 1)) for p, xs in got.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.hf_host", description=__doc__.split("\n")[0])
    p.add_argument("--cache", choices=["generate", "caller"], default="generate")
    p.add_argument("--loops", type=int, default=5)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--stub", action="store_true", help="the program does not run (see call_overhead_us)")
    p.add_argument("--parts", action="store_true", help="find, proven and the stubbed call in one process (parts_us)")
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
    if args.parts:
        got = parts_us(model, gen, rounds=8 * args.loops)
        print(
            "  ".join(f"{p} {lo} us (median {med})" for p, (lo, med) in got.items()), "(min of rounds, thread CPU time)"
        )
        return got
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
