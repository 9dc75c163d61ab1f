"""The serving engine's own host time per step, the model stubbed: what examples/engine.py spends around each model
call (schedule, batch and metadata on the host, fgraph's dispatch of a tiny step, sampling, retiring), on
serve_bench's workload. Any CPU repeats it. The engine builds step n+1's batch while the device runs step n, so only
the serial part, from reading step n's logits to calling the model for step n+1, adds to a step one for one (on the
H200 a 0.5B step is ~1.5-2 ms of GPU time).

usage: python3 -m benchmarks.engine_host [--modes PIECEWISE FULL_AND_PIECEWISE] [--repeats 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from examples import engine, llama

from .serve_bench import workload

V = 512  # the stub's vocabulary: prompts are folded into it


def stub(params, cache, batch, routine):
    """A pure step of (almost) no work: logits [N, V] from the tokens and positions, the cache untouched."""
    return torch.nn.functional.one_hot((batch.tokens * 7 + batch.positions) % V, V).float() + params["w"], cache


def host_us_per_step(mode: str, repeats: int) -> tuple[list[float], list[float]]:
    """us per step outside the model call, and of it the serial part (from the logits read to the next step's model
    call: the part no device work overlaps), one value per repeat of the workload (the first, a warm-up, dropped)."""
    cache = llama.init_cache(llama.preset("tiny"), 1 + 128 * (2048 // 16), 16, torch.float32, "cpu")
    eng = engine.Engine(
        stub,
        {"w": torch.zeros(V)},
        cache,
        max_seq_len=2048,
        mode=mode,
        max_batch_tokens=512,
        max_seqs=128,
        vocab_size=V,
    )
    inner, sample, spent, serial, read = eng.run_batch, eng._sample, [0.0], [], [None]

    def timed(*a, **k):
        t0 = time.perf_counter()
        if read[0] is not None:
            serial.append(t0 - read[0])
        out = inner(*a, **k)
        spent[0] += time.perf_counter() - t0
        return out

    def sampled(*a, **k):  # the step's one wait for the device ends here
        out = sample(*a, **k)
        read[0] = time.perf_counter()
        return out

    eng.run_batch, eng._sample = timed, sampled
    reqs = [([t % V for t in p], o) for p, o in workload(200, 0, 151936)]
    out, tail = [], []
    for _ in range(repeats + 1):
        for p, o in reqs:
            eng.add(p, max_new_tokens=o)
        spent[0], t0, read[0] = 0.0, time.perf_counter(), None
        serial.clear()
        rep = eng.run(progress=False)
        out.append((time.perf_counter() - t0 - spent[0]) / rep.steps * 1e6)
        tail.append(statistics.median(serial) * 1e6)
    return out[1:], tail[1:]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["PIECEWISE", "FULL_AND_PIECEWISE"])
    ap.add_argument("--repeats", type=int, default=6)
    a = ap.parse_args(argv)
    print("engine host time per step outside the model call, us (serve_bench's workload, model stubbed)")
    for m in a.modes:
        xs, ss = host_us_per_step(m, a.repeats)
        print(
            f"{m:20s} median {statistics.median(xs):6.0f}  min {min(xs):6.0f}  max {max(xs):6.0f}  "
            f"serial (logits read -> next call) {statistics.median(ss):5.1f}"
        )


if __name__ == "__main__":
    main()
