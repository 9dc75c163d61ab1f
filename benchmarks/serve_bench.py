"""Continuous batching: PIECEWISE vs FULL_AND_PIECEWISE per attention backend, on the generation engine.

A synthetic ShareGPT-like workload with a fixed seed (log-normal lengths: ~200 requests, prompts 4-1024 tokens,
outputs 4-512, all submitted at once, so TTFT includes queueing), greedy, on the random-weight Qwen2.5-0.5B preset
in bf16. Each engine first runs a short warm-up workload (another seed), so lazily created kernels and wrappers
are not billed to whichever mode runs first. The engines of one backend are built side by side and the workload
runs --repeats times per mode, the modes alternating (PIECEWISE, FULL_AND_PIECEWISE, PIECEWISE, ...): one run is
only ~4 s on the H200, and three single runs once gave FULL_AND_PIECEWISE -12 % to +39 % over PIECEWISE,
so a single pair measures the host's drift as much as the modes. Reports per mode the median output throughput
(and min-max), TTFT and TPOT, the gain over PIECEWISE as the median of the per-round ratios (paired: a round runs
both modes back to back), and how many requests' greedy tokens differ from the first mode's first run, over every
run (printed, never raised). A time budget skips a backend that would not fit. Rows go to <out>/serve.jsonl as
measured; the end writes serve.json and the table.

A mode with the suffix "+C" (FULL+C, the default engine on CUDA) is its base mode serving
Inductor-compiled pieces (Engine(compile=True)): one compilation per distinct piece, shared by every bucket, so those
engines capture every bucket too (--compiled-buckets: only those; their row lists them) and the budget counts
--compile-est-s per engine; the row adds gain_over_uncompiled, paired over the base mode when it ran too. Inductor's kernels are not bit-identical to
eager's in bf16: their token mismatches are reported like any others.

usage (device): source .gpu/activate.sh; python3 -m benchmarks.serve_bench [--modes PIECEWISE FULL_AND_PIECEWISE
                FULL_AND_PIECEWISE+C] [--compiled-buckets 1 8 32 128 512]
       (CPU):   python3 -m benchmarks.serve_bench --smoke [--modes PIECEWISE FULL_AND_PIECEWISE+C]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time

import torch

from examples import engine, llama

from . import summarize
from .common import Budget, device_name, emit, sync


def workload(n: int, seed: int, vocab: int, max_prompt: int = 1024, max_output: int = 512):
    """Log-normal lengths like ShareGPT: many short prompts/answers, a long tail, clipped to the ranges."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.exp(torch.randn(n, generator=g) * 1.0 + 5.0).clamp(4, max_prompt).long().tolist()
    olen = torch.exp(torch.randn(n, generator=g) * 1.0 + 4.8).clamp(4, max_output).long().tolist()
    return [(torch.randint(1, vocab, (p,), generator=g).tolist(), o) for p, o in zip(plen, olen)]


def describe(reqs) -> dict:
    p, o = [len(p) for p, _ in reqs], [o for _, o in reqs]
    return {
        "requests": len(reqs),
        "prompt_tokens": sum(p),
        "max_output_tokens": sum(o),
        "prompt_len_p50_max": [int(statistics.median(p)), max(p)],
        "output_len_p50_max": [int(statistics.median(o)), max(o)],
    }


FUSE_ROPE = {"decode": "decode", "all": True, "none": False}  # --fuse-rope -> llama.forward's fuse_rope


def compiled(mode: str) -> bool:
    return mode.endswith("+C")


def build(cfg, params, backend, mode, warm, a):
    """One engine, built (captures both routines up front) and warmed up; (engine, setup seconds)."""
    t0 = time.perf_counter()
    eng = engine.build(
        cfg,
        params,
        backend=backend,
        mode=mode.removesuffix("+C"),
        compile=compiled(mode),
        buckets=a.compiled_buckets if compiled(mode) else None,
        max_seqs=a.max_seqs,
        max_seq_len=a.max_seq_len,
        max_batch_tokens=a.max_batch_tokens,
        make_step=functools.partial(llama.make_step, fuse_rope=FUSE_ROPE[a.fuse_rope]),
    )
    sync(a.device)
    setup = time.perf_counter() - t0
    serve(eng, warm, a)
    return eng, setup


def serve(eng, reqs, a):
    """The workload, all submitted at once, on a warm engine: its Report."""
    for prompt, out in reqs:
        eng.add(prompt, max_new_tokens=out)
    sync(a.device)
    return eng.run(progress=False)


def summary(eng, setup: float, reports) -> dict:
    """One mode's row from its runs: medians over runs (each run's TTFT / TPOT is its own median)."""
    med = lambda xs: statistics.median([x for x in xs if x is not None] or [float("nan")]) * 1e3
    st = eng.step_fn.stats() if hasattr(eng.step_fn, "stats") else {"total": {}, "fallbacks": {}}
    tput = [r.throughput for r in reports]
    return {
        "setup_s": setup,
        "runs": len(reports),
        "throughput_runs": tput,
        "elapsed_s": statistics.median(r.elapsed for r in reports),
        "steps": reports[0].steps,
        "output_tokens": reports[0].output_tokens,
        "throughput_tok_s": statistics.median(tput),
        "ttft_p50_ms": statistics.median(med(r.ttft) for r in reports),
        "tpot_p50_ms": statistics.median(med(r.tpot) for r in reports),
        "waiting_share": statistics.median(r.waited / r.elapsed for r in reports),  # host waiting for the device
        "graphs": st["total"].get("captures"),
        "replays": st["total"].get("replays"),
        "eager_calls": st["total"].get("eager"),
        "fallbacks": st["fallbacks"],
    }


def paired_gain(runs, base_runs) -> float:
    """The median over rounds of one mode's throughput over another's (each round ran both back to back)."""
    return statistics.median(x.throughput / b.throughput - 1 for x, b in zip(runs, base_runs))


def unmeasured(a, backend, mode, n, outcome: str, why: str) -> dict:
    """The row of a mode that did not run: outcome "skipped" or "error", and why."""
    return {"kind": "serve", "model": a.preset, "backend": backend, "mode": mode, "requests": n, outcome: why}


def failure(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"  # one line: it goes in a table cell


def backend_rows(cfg, params, backend, reqs, warm, a) -> list[dict]:
    """Every mode of one backend: engines side by side, --repeats rounds of the modes in turn. A mode whose engine
    fails to build (a +C engine's compile, say) gets an error row; the others still run."""
    engines, failed = {}, {}
    for m in a.modes:
        try:
            engines[m] = build(cfg, params, backend, m, warm, a)
        except Exception as e:
            failed[m] = unmeasured(a, backend, m, len(reqs), "error", failure(e))
    modes = list(engines)
    if not modes:
        return list(failed.values())
    reports = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:
            reports[m].append(serve(engines[m][0], reqs, a))
    base = reports[modes[0]][0].tokens
    rows = []
    for m in a.modes:
        if m in failed:
            rows.append(failed[m])
            continue
        row = {
            "kind": "serve",
            "model": a.preset,
            "backend": backend,
            "mode": m,
            "requests": len(reqs),
            **summary(*engines[m], reports[m]),
        }
        diff = [mismatches(base, r.tokens) for r in reports[m]]
        row["mismatched_requests"] = max(n for n, _ in diff)
        row["first_mismatch"] = next((i for _, i in diff if i is not None), None)
        row["compared_with"] = f"{modes[0]} (first run)"
        if "PIECEWISE" in reports and m != "PIECEWISE":
            row["gain_paired"] = paired_gain(reports[m], reports["PIECEWISE"])
        if compiled(m):
            row["buckets"] = list(engines[m][0].buckets)
            if m.removesuffix("+C") in reports:
                row["gain_over_uncompiled"] = paired_gain(reports[m], reports[m.removesuffix("+C")])
        rows.append(row)
    del engines, reports
    gc.collect()
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def mismatches(a_tokens, b_tokens) -> tuple[int, int | None]:
    """(requests whose tokens differ, index of the first differing request or None)."""
    diff = [i for i, (x, y) in enumerate(zip(a_tokens, b_tokens)) if x != y]
    diff += list(range(min(len(a_tokens), len(b_tokens)), max(len(a_tokens), len(b_tokens))))
    return len(diff), (diff[0] if diff else None)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--warmup-requests", type=int, default=16)
    ap.add_argument("--backends", nargs="+", default=["flash_attn", "flashinfer"])
    ap.add_argument("--modes", nargs="+", default=["PIECEWISE", "FULL_AND_PIECEWISE"])
    ap.add_argument("--max-seqs", type=int, default=128)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeats", type=int, default=None, help="measured runs per mode, the modes alternating (5; --smoke: 2)"
    )
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall budget; runs that do not fit are skipped")
    ap.add_argument("--run-est-s", type=float, default=90.0, help="first guess of one backend (builds + runs)")
    ap.add_argument(
        "--compiled-buckets",
        type=int,
        nargs="+",
        default=None,
        help="only these buckets for +C engines (default: every bucket; --max-batch-tokens is always one)",
    )
    ap.add_argument(
        "--compile-est-s", type=float, default=30.0, help="first guess of compiling the pieces of a +C engine"
    )
    ap.add_argument(
        "--fuse-rope",
        choices=sorted(FUSE_ROPE),
        default="all",
        help="the steps whose RoPE runs inside the attention break (llama.forward's fuse_rope; default: all)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny preset, torch backend, 6 short requests")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args(argv)
    if a.smoke:
        a.preset, a.backends, a.device, a.requests, a.warmup_requests = "tiny", ["torch"], "cpu", 6, 2
        a.max_prompt, a.max_output, a.max_seqs, a.max_batch_tokens, a.max_seq_len = 48, 8, 4, 64, 128
    a.repeats = a.repeats or (2 if a.smoke else 5)
    if a.compiled_buckets:  # (the engine adds max_batch_tokens)
        a.compiled_buckets = sorted({b for b in a.compiled_buckets if b < a.max_batch_tokens} | {a.max_batch_tokens})
    return a


def estimate(a) -> float:
    """First guess of one backend's seconds: builds and runs, plus compiling each +C engine's distinct pieces."""
    return a.run_est_s + sum(compiled(m) for m in a.modes) * a.compile_est_s


def main(argv=None):
    a = parse_args(argv)
    budget = Budget(a.budget_s)
    path = os.path.join(a.out, "serve.jsonl")
    os.makedirs(a.out, exist_ok=True)
    open(path, "w").close()  # a new run starts a new file (its rows are appended as they come)
    cfg = llama.preset(a.preset)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    params = llama.init_params(cfg, dtype, a.device)
    reqs = workload(a.requests, a.seed, cfg.vocab_size, a.max_prompt, a.max_output)
    warm = workload(a.warmup_requests, a.seed + 1, cfg.vocab_size, a.max_prompt, a.max_output)
    info = {
        "kind": "info",
        "part": "serve",
        "device": device_name(a.device),
        "torch": torch.__version__,
        "preset": a.preset,
        **describe(reqs),
        "warmup_requests": len(warm),
        "max_seqs": a.max_seqs,
        "max_batch_tokens": a.max_batch_tokens,
        "seed": a.seed,
        "repeats": a.repeats,
        "command": "python3 -m benchmarks.serve_bench " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    emit(path, info)
    rows, est = [info], estimate(a)
    for backend in a.backends:
        outcome, why = "skipped", budget.why_not(est)
        t0 = time.perf_counter()
        try:
            got = [] if why else backend_rows(cfg, params, backend, reqs, warm, a)
        except Exception as e:  # one failing backend is a result; the others still run
            outcome, why = "error", failure(e)
        if why:
            got = [unmeasured(a, backend, m, len(reqs), outcome, why) for m in a.modes]
        else:
            est = max(est, 1.2 * (time.perf_counter() - t0))
        for row in got:
            emit(path, row)
        rows += got
    with open(os.path.join(a.out, "serve.json"), "w") as fh:
        json.dump({"info": info, "rows": rows[1:]}, fh, indent=1, default=str)
    print(
        f"\n{info['device']}; {info['requests']} requests ({info['prompt_tokens']} prompt tokens, prompt p50/max "
        f"{info['prompt_len_p50_max']}, output p50/max {info['output_len_p50_max']}), {budget.elapsed():.0f} s; "
        f"{info['command']}"
    )
    print(summarize.report(rows))


if __name__ == "__main__":
    main()
