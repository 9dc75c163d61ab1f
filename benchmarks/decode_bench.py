"""Decode-step benchmark: one process, the same pure step, side by side, per cell (KV context C, batch B).

  eager       the step called directly (batch already on the device)
  graph       the eager step captured once with torch.cuda.graph (the ideal launch cost, no fgraph)
  compile     torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)
  <backend>/NONE, /PIECEWISE, /FULL   fgraph.jit of the same step, batch passed from the host each call
  floor       bytes the step must move (weights + KV read) / copy bandwidth measured in this run

Random weights (presets; bf16 on the GPU), every sequence at position C/2. Per cell, every contender's logits are
first checked against eager's (uncompiled fgraph: bit for bit; Inductor-compiled ones within TOL_COMPILED of the
largest logit; a contender that fails is reported, not timed), then all are timed in --rounds alternating rounds
of CUDA-event timings after warm-up: the tables show the median ± half the range. Eager and graph peers run on one
backend (--peer-backend, flash_attn: its eager step needs no host plan); torch.compile runs on every backend, at
its page size (column "compile" on the peer backend, "<backend>/compile" on the others; FlashInfer's plans by hand
before each call, as fgraph's hook plans before each replay), and each FULL is compared with the peers of its page
size. Also: host
time per FULL call (entry -> graph launch, with and without the plan hook); with --capture the capture cost
of 2 routines x the default buckets (FULL_AND_PIECEWISE) per backend; with --kernels, after each cell's timings, the
kernels of each timed fgraph mode and of torch.compile (benchmarks/kernels.py: per step, per layer, the costliest).

Time: every part has a budget (--budget-s); work that does not fit is skipped and says why. Order per model:
capture cost, then one pass per backend (peer backend last: its pass ends with the torch.compile sweep, one
compile per batch size shared by every context, since block tables are sized for the largest context).
Rows go to <out>/<name>.jsonl as soon as they are measured; the end writes <name>.json, a table and <name>.png.

usage (device): source .gpu/activate.sh; python3 -m benchmarks.decode_bench --models qwen2.5-0.5b --capture
       (CPU):   python3 -m benchmarks.decode_bench --smoke
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch._dynamo
import torch.utils._pytree as pytree

import fgraph
from examples import llama
from fgraph.ops import attention as A

from . import kernels, summarize
from .common import Budget, copy_bandwidth, decode_batch, device_name, emit, jit_step, sync, time_ms

SLEEP_CYCLES = 6_000_000  # ~3 ms of GPU spin at H200 clocks: longer than any host call we measure


# ------------------------------------------------------------------------------------------------ sizes
def weight_bytes(params) -> int:
    """What a decode step reads: every layer, the final norm and the head (embedding rows read are negligible)."""
    leaves = [params.norm, params.lm_head if params.lm_head is not None else params.embed]
    leaves += [
        t
        for layer in params.layers
        for t in (layer.attn_norm, layer.wqkv, layer.bqkv, layer.wo, layer.mlp_norm, layer.w13, layer.w2)
        if t is not None
    ]
    return sum(t.numel() * t.element_size() for t in leaves)


def kv_token_bytes(cfg, dtype) -> int:
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def cache_pages(cells, ps) -> int:
    return 1 + max(B * -(-ctx // ps) for ctx, B in cells)  # + the scratch page


# ------------------------------------------------------------------------------------------------ fgraph
def make_jitted(cfg, backend, mode, max_ctx, buckets, inductor=None):
    """fgraph.jit of llama's step for this backend (common.jit_step)."""
    return jit_step(llama.make_step(cfg, backend=backend, max_seq_len=max_ctx), mode, buckets, inductor)


def decode_entry(f, B):
    bucket = min(b for b in f.options.buckets if b >= B)
    return next(
        e for e in f.entries.values() if e.sig.bucket == bucket and dict(e.sig.statics).get("routine") == "decode"
    )


HOST_ROUNDS, HOST_CALLS = 4, 25  # host time: rounds over the cell's FULL modes in turn, calls per mode a round


def host_times(fs: dict, params, cache, batch, dev) -> dict:
    """Host µs of a FULL decode call per mode ({mode: jitted}): HOST_ROUNDS rounds of HOST_CALLS calls of each
    mode in turn, so drift of the host within the process (2x between two runs of the same cell, measured) is
    billed to every mode alike. {mode: host_time's dict, or a note}."""
    samples = {m: ([], [], []) for m in fs}
    idle = {m: [] for m in fs}  # the same calls with the GPU idle: the host's own cost, no wait for the device
    notes = {}
    for _ in range(HOST_ROUNDS):
        for m, f in fs.items():
            got = host_samples(f, params, cache, batch, dev, HOST_CALLS)
            if isinstance(got, str):
                notes[m] = {"host_note": got}
                continue
            for acc, xs in zip(samples[m], got):
                acc += xs
            idle[m] += host_samples(f, params, cache, batch, dev, HOST_CALLS, busy=False)[0]
    med = lambda xs: statistics.median(xs) * 1e6
    return {
        m: notes.get(m)
        or {
            "host_us": med(t),
            "idle_host_us": med(idle[m]),
            "launch_us": med(la),
            "plan_us": med(p),
            "noplan_us": statistics.median(a - b for a, b in zip(la, p)) * 1e6,
        }
        for m, (t, la, p) in samples.items()
    }


def host_samples(f, params, cache, batch, dev, n: int, busy: bool = True):
    """Seconds of n FULL decode calls: (entry -> return, entry -> graph launch, the plan hook inside it), or why
    there are none.

    Method: before each call the GPU is given ~3 ms of spinning (torch.cuda._sleep), so the call runs with the
    GPU queue non-empty, as in a serving loop (busy=False: the GPU idle, the queue drained before the call); perf_counter brackets the call, and the graph's replay and the
    entry's plan hook are wrapped (on this entry only) to stamp the launch and time the plan. A call that waited
    for the GPU (a hidden sync) would show as ~ms; the queue is drained after each sample, outside the timing."""
    entry = decode_entry(f, batch.tokens.shape[0])
    if entry.full is None:
        return f"no FULL graph (mode {entry.mode.name}: {entry.reason})"
    stamp = {"launch": 0.0, "plan": 0.0}
    replay, plan = entry.full.replay, entry._plan

    def timed_replay():
        stamp["launch"] = time.perf_counter()
        return replay()

    def timed_plan(*a, **k):
        t = time.perf_counter()
        plan(*a, **k)
        stamp["plan"] += time.perf_counter() - t

    entry.full.replay, entry._plan = timed_replay, timed_plan
    cuda = str(dev).startswith("cuda")
    total, launch, planned = [], [], []
    try:
        for _ in range(n):
            if cuda and busy:
                torch.cuda._sleep(SLEEP_CYCLES)
            stamp["plan"] = 0.0
            t0 = time.perf_counter()
            f(params, cache, batch, routine="decode")
            t1 = time.perf_counter()
            total.append(t1 - t0)
            launch.append(stamp["launch"] - t0)
            planned.append(stamp["plan"])
            sync(dev)
    finally:
        del entry.full.replay, entry._plan  # back to the class methods
    return total, launch, planned


ROUNDS = 3  # timing rounds per cell: every contender once per round, in turn (--rounds)
TOL_COMPILED = 0.1  # max |logits - eager| / max |eager| of Inductor-compiled steps (bf16 through every layer)


def check_against_eager(name: str, got: torch.Tensor, ref: torch.Tensor, compiled: bool) -> tuple[float, str | None]:
    """(relative max error, why it is refused or None). Uncompiled fgraph runs eager's kernels: bit for bit."""
    err = ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    limit = TOL_COMPILED if compiled else 0.0
    if not err <= limit:  # (NaN fails too)
        return err, f"{name}: logits differ from eager's by {err:.2e} of the largest (limit {limit:g}): not timed"
    return err, None


def timed_rounds(calls: dict, dev, rounds: int) -> dict:
    """{name: (median ms, spread ms)} from `rounds` rounds, each timing every call in turn (time_ms), so drift
    of the GPU's clocks or the host within the process is billed to every contender alike."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(time_ms(call, dev))
    return {name: (statistics.median(ts), max(ts) - min(ts)) for name, ts in times.items()}


def on_device(batch, dev):
    return llama.Batch(batch.tokens.to(dev), batch.positions.to(dev), batch.meta.to(dev))


def cell(jitted, step, compiled, params, cache, batch, dev, backend, peers, a, n_layers) -> dict:
    """One (ctx, B) cell: set up every contender (fgraph modes of this backend; with `peers`, eager, one CUDA
    graph of the eager step; `compiled`: (column, call) of torch.compile's step for B), check each one's logits
    against eager's, then
    time them in alternating rounds. Row keys: <name>_ms (median), <name>_spread (max - min over rounds, ms);
    with --kernels, the kernels of the timed fgraph modes and torch.compile (kernels.contender_kernels)."""
    row, calls, b = {}, {}, on_device(batch, dev)
    ref = step(params, cache, b, "decode")[0].float()  # the oracle (repeating a step rewrites the same KV slots)
    for mode, f in jitted.items():
        key = f"{backend}/{mode}"
        try:
            t0 = time.perf_counter()
            out = f(params, cache, batch, routine="decode")[0]  # traces (first bucket of a family) and captures
            sync(dev)
            row[f"{key}_setup_s"] = time.perf_counter() - t0
            row[f"{key}_err"], why = check_against_eager(key, out, ref, f.options.compile_for(str(dev)) is not None)
            if why:
                row[f"{key}_error"] = why
                continue
            calls[key] = lambda f=f: f(params, cache, batch, routine="decode")
        except Exception as e:  # a failing mode is a result too; the others still run
            row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if "eager" in peers:
        calls["eager"] = lambda: step(params, cache, b, "decode")
    if "graph" in peers and str(dev).startswith("cuda"):
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(params, cache, b, "decode")
        torch.cuda.current_stream().wait_stream(s)
        t0 = time.perf_counter()
        with torch.cuda.graph(g):
            out = step(params, cache, b, "decode")[0]
        row["graph_capture_s"] = time.perf_counter() - t0
        g.replay()
        row["graph_err"], why = check_against_eager("graph", out, ref, False)
        if why:
            row["graph_error"] = why
        else:
            calls["graph"] = g.replay
    elif "graph" in peers:
        row["graph_skipped"] = "needs CUDA"
    if compiled is not None:
        name, comp = compiled
        out = comp(b, batch.meta)
        row[f"{name}_err"], why = check_against_eager(name, out, ref, True)
        if why:
            row[f"{name}_error"] = why
        else:
            calls[name] = lambda: comp(b, batch.meta)
    for name, (ms, spread) in timed_rounds(calls, dev, a.rounds).items():
        row[f"{name}_ms"], row[f"{name}_spread"] = ms, spread
    row["rounds"] = a.rounds
    if a.host:  # after every mode's setup: their host times in alternating rounds
        full = {m: f for m, f in jitted.items() if m.startswith("FULL") and f"{backend}/{m}_ms" in row}
        for mode, got in host_times(full, params, cache, batch, dev).items():
            row.update({f"{backend}/{mode}/{k}": v for k, v in got.items()})
    if a.kernels:  # last: the profiler can leave CUPTI attached, slowing the launches measured after it
        profiled = {k: c for k, c in calls.items() if "/" in k or k == "compile"}  # fgraph's and torch.compile
        row.update(kernels.contender_kernels(profiled, n_layers, dev))
    return row


# ------------------------------------------------------------------------------------------------ peers
def compile_peer(cfg, params, cache, backend, max_ctx, inductor=None):
    """`call(batch on the device, its host metadata) -> logits`: one decode step of torch.compile(step,
    mode="reduce-overhead", fullgraph=True, dynamic=False); with `inductor` (options), the same with these options
    added (reduce-overhead is {"triton.cudagraphs": True}). Params and cache are marked static addresses, so
    cudagraph trees accept the in-place cache write. FlashInfer plans outside any graph: the call plans by hand
    from the host metadata first (A.plan_attention, as fgraph's hook does before each replay; its host time is
    part of the peer's step, as the hook's is of fgraph's). Caller: torch._dynamo.reset() when done."""
    import torch._dynamo

    for t in pytree.tree_leaves(params) + pytree.tree_leaves(cache):
        if isinstance(t, torch.Tensor):
            torch._dynamo.mark_static_address(t)
    how = {"options": {"triton.cudagraphs": True, **inductor}} if inductor else {"mode": "reduce-overhead"}
    step = llama.make_step(cfg, backend=backend, max_seq_len=max_ctx)
    comp = torch.compile(step, fullgraph=True, dynamic=False, **how)
    plans, ready = backend == "flashinfer", set()
    page, scale = A.page_size_for(backend), cfg.head_dim**-0.5

    def call(b, meta=None):
        if plans:
            if b.tokens.shape[0] not in ready:
                # FlashInfer's wrapper for this batch size and its first plans (plan(), then the recorded fast
                # path) allocate what the wrapper keeps: made by eager steps, outside cudagraph trees' pool,
                # which refuses live allocations it does not own ("tensors in the cudagraph pool not tracked")
                for _ in range(3):
                    step(params, cache, b, "decode")
                ready.add(b.tokens.shape[0])
            A.plan_attention(meta, backend=backend, routine="decode", page_size=page, scale=scale)
        torch.compiler.cudagraph_mark_step_begin()
        return comp(params, cache, b, "decode")[0]

    return call


class CompilePeer:
    """torch.compile's step for each batch size, compiled on first use (dynamic=False: one compile per B, shared
    by every context, since block tables are sized for the largest), within the budget. `for_batch(B, b, meta,
    row)` returns (column, call), or None with the reason in `row`. The column is "compile" on the peer backend,
    "<backend>/compile" on another (the same step at that backend's page size)."""

    def __init__(self, cfg, params, cache, backend, max_ctx, budget, est_s, name="compile"):
        self.call, self.budget, self.est_s = compile_peer(cfg, params, cache, backend, max_ctx), budget, est_s
        self.ready, self.error, self.name = set(), None, name

    def for_batch(self, B: int, b, meta, row: dict):
        from torch._dynamo.utils import counters

        n = self.name
        if B in self.ready:
            return n, self.call
        why = self.error or self.budget.why_not(self.est_s)
        if why:
            row[f"{n}_skipped"] = why
            return None
        try:
            skips0 = counters["inductor"]["cudagraph_skips"]
            t0 = time.perf_counter()
            for _ in range(3):  # compile, then cudagraph trees' warm-up run and recording
                self.call(b, meta)
            sync(b.tokens.device)
            row[f"{n}_s"] = secs = time.perf_counter() - t0
            row[f"{n}_cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips0
            self.est_s = max(self.est_s, 1.2 * secs)
            self.ready.add(B)
            return n, self.call
        except Exception as e:
            self.error = row[f"{n}_error"] = f"compile failed at B={B}: {type(e).__name__}: {str(e)[:300]}"
            return None


# ------------------------------------------------------------------------------------------------ passes
def backend_pass(cfg, params, backend, modes, cells, a, rec, budget, peers, base):
    """Every cell for one attention backend, with one KV cache (sized for the largest cell) shared by all cells.
    `backend` "auto" is what a user gets without naming one (A.resolve_backend for this model, a pair such as
    "triton/flash_attn"): its columns are labelled "auto", and its first row says what it resolved to."""
    spec = A.resolve_backend(backend, a.device, cfg.head_dim, a.dtype) if backend == "auto" else backend
    if spec != backend:
        rec({"kind": "resolved", **base, "backend": backend, "resolves_to": spec}, show=f"{backend}: {spec}")
    dev, ps, max_ctx = a.device, A.page_size_for(spec), max(ctx for ctx, _ in cells)
    cache = llama.init_cache(cfg, cache_pages(cells, ps), ps, a.dtype, dev)
    jitted = {m: make_jitted(cfg, spec, m, max_ctx, a.buckets) for m in modes}
    step = llama.make_step(cfg, backend=spec, max_seq_len=max_ctx)
    name = "compile" if backend == a.peer_backend else f"{backend}/compile"
    comp = CompilePeer(cfg, params, cache, spec, max_ctx, budget, a.compile_est_s, name) if "compile" in peers else None
    with torch.no_grad():
        for ctx, B in cells:
            why = budget.why_not(a.cell_est_s)
            if why:
                rec({**base, "ctx": ctx, "batch": B, f"{backend}_skipped": why, **{f"{p}_skipped": why for p in peers}})
                continue
            batch, _ = decode_batch(cfg.vocab_size, B, ctx, ps, max_ctx)
            row = {}
            compiled = comp.for_batch(B, on_device(batch, dev), batch.meta, row) if comp is not None else None
            row.update(cell(jitted, step, compiled, params, cache, batch, dev, backend, peers, a, cfg.n_layers))
            rec({**base, "ctx": ctx, "batch": B, **row})
        del jitted, comp
        gc.collect()
        if "compile" in peers:
            torch._dynamo.reset()
    del cache
    gc.collect()
    if str(dev).startswith("cuda"):
        torch.cuda.empty_cache()


def first_trace_s(dev) -> float:
    """The one-off cost of a process's first fgraph trace (make_fx's symbolic machinery imports torch._dynamo,
    sympy...: 1-3 s on the H200's host), paid on a toy function before the captures so that each backend's capture
    time is its own, whichever runs first; reported beside them."""
    t0 = time.perf_counter()
    f = fgraph.jit(lambda x: x * 2 + 1, batch={"x": fgraph.Batched()}, buckets=[4], mode="NONE")
    f(torch.ones(3, 2, device=dev))
    return time.perf_counter() - t0


def backend_import_s(backend: str) -> float | None:
    """The one-off import of the backend's library, paid before its capture like the first trace and reported beside
    it: flashinfer's took 1.45 s of a 14.6 s capture on the H200's host (scripts/diagnose_gpu.py capture), and was
    inside the capture times of a process's first run before it was reported apart."""
    if backend not in ("flash_attn", "flashinfer", "triton"):
        return None  # (the torch backend imports nothing)
    t0 = time.perf_counter()
    importlib.import_module(backend)
    return time.perf_counter() - t0


def capture_cost(cfg, params, backend, a) -> dict:
    """Capture of 2 routines x the default buckets, FULL_AND_PIECEWISE: seconds, graphs, pool GiB, per signature."""
    import_s = backend_import_s(backend)
    dev, ps = a.device, A.page_size_for(backend)
    batch, pages = decode_batch(cfg.vocab_size, 1, 1024, ps)
    cache = llama.init_cache(cfg, pages, ps, a.dtype, dev)
    spec = llama.Batch(fgraph.Batched(pad=0), fgraph.Batched(pad=0), A.metadata_batching())
    f = fgraph.jit(
        llama.make_step(cfg, backend=backend, max_seq_len=1024),
        static=["routine"],
        donate=["cache"],
        scratch=["cache"],  # padded rows write only the scratch page (fgraph/ops/attention.py)
        batch={"batch": spec},
        mode="FULL_AND_PIECEWISE",
        buckets=fgraph.default_buckets(a.capture_max_bucket),
        copy_outputs=False,  # zero-copy: outputs are read before the next call
    )
    cuda = str(dev).startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
    r0 = torch.cuda.memory_reserved() if cuda else 0
    t0 = time.perf_counter()
    f.capture(params, cache, batch, routine=["decode", "mixed"], progress=False)
    sync(dev)
    secs = time.perf_counter() - t0
    per = [
        {
            "routine": dict(e.sig.statics).get("routine"),
            "bucket": e.sig.bucket,
            "mode": e.mode.name,
            "traced": e.stats.traces,
            "graphs": len(e.graphs),
            "capture_s": e.capture_seconds,
            "pool_MiB": e.pool_bytes / 2**20,
        }
        for e in f.entries.values()
    ]
    traces = {id(e.traced): e.traced.seconds for e in f.entries.values()}  # make_fx + split, once per trace
    out = {
        "backend": backend,
        "buckets": len(f.options.buckets),
        "capture_s": secs,
        "import_s": import_s,
        "signatures": len(per),
        "trace_s": sum(traces.values()),
        "graphs_s": sum(p["capture_s"] for p in per),
        "graphs": sum(p["graphs"] for p in per),
        "traces": sum(p["traced"] for p in per),
        "pool_GiB": sum(p["pool_MiB"] for p in per) / 1024,
        "reserved_GiB": ((torch.cuda.memory_reserved() if cuda else 0) - r0) / 2**30,
        "per_signature": per,
    }
    del f, cache
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def capture_line(c: dict) -> str:
    per = c["per_signature"]
    slow = sorted(per, key=lambda p: -p["capture_s"])[:3]
    big = sorted(per, key=lambda p: -p["pool_MiB"])[:3]
    fmt = lambda p, v: f"{p['routine']}/{p['bucket']}({p['mode']}) {v}"
    split = (
        (
            f" (traces {c['trace_s']:.1f} s, warm-up + graphs {c['graphs_s']:.1f} s, the rest "
            f"{c['capture_s'] - c['trace_s'] - c['graphs_s']:.1f} s)"
        )
        if "trace_s" in c
        else ""
    )
    split += f" (+ {c['import_s']:.1f} s importing {c['backend']} before it)" if c.get("import_s") else ""
    return (
        f"capture {c['model']} {c['backend']}: {c['capture_s']:.1f} s{split}, {c['signatures']} signatures, "
        f"{c['graphs']} graphs, {c['traces']} traces, pool {c['pool_GiB']:.2f} GiB (reserved +"
        f"{c['reserved_GiB']:.2f}); slowest "
        + ", ".join(fmt(p, f"{p['capture_s']:.2f}s") for p in slow)
        + "; largest "
        + ", ".join(fmt(p, f"{p['pool_MiB']:.0f}MiB") for p in big)
    )


def run_model(name, a, rec, budget, bw):
    dev = a.device
    cfg = llama.preset(name)
    params = llama.init_params(cfg, a.dtype, dev)
    base = {"model": name}
    cells = (
        [tuple(map(int, c.split(":"))) for c in a.cells] if a.cells else [(ctx, B) for ctx in a.ctx for B in a.batches]
    )
    fits = []
    for ctx, B in cells:
        kv = kv_token_bytes(cfg, a.dtype) * cache_pages([(ctx, B)], 16) * 16
        if kv > a.max_kv_gb * 1e9:
            rec(
                {**base, "ctx": ctx, "batch": B, "skipped": f"KV cache {kv / 1e9:.0f} GB > --max-kv-gb {a.max_kv_gb:g}"}
            )
        else:
            fits.append((ctx, B))
    if not fits:
        return
    if a.capture:
        one_off = first_trace_s(dev)
        rec(
            {"kind": "process", **base, "first_trace_s": one_off},
            show=f"the process's first trace (one-off imports, before the captures): {one_off:.1f} s",
        )
        for backend in a.backends:
            why = budget.why_not(a.capture_est_s)
            c = {"kind": "capture", **base, "backend": backend}
            if why:
                rec({**c, "skipped": why})
                continue
            c.update(capture_cost(cfg, params, backend, a))
            rec(c, show=capture_line(c))
    wb = weight_bytes(params)
    for ctx, B in fits:
        kv_read = kv_token_bytes(cfg, a.dtype) * B * (ctx // 2 + 1)
        rec(
            {
                **base,
                "ctx": ctx,
                "batch": B,
                "weights_GB": wb / 1e9,
                "kv_read_GB": kv_read / 1e9,
                "floor_ms": (wb + kv_read) / bw * 1e3,
            }
        )
    peers = [p for p in a.peers if p != "none"]
    order = [b for b in a.backends if b != a.peer_backend] + [a.peer_backend] if peers else list(a.backends)
    for backend in order:
        modes = a.modes if backend in a.backends else []
        # torch.compile runs on every backend (its step at that backend's page size); eager and graph on the peer's
        mine = peers if backend == a.peer_backend else [p for p in peers if p == "compile"]
        backend_pass(cfg, params, backend, modes, fits, a, rec, budget, mine, base)
    del params
    gc.collect()
    if str(dev).startswith("cuda"):
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama3-8b"])
    ap.add_argument("--ctx", nargs="+", type=int, default=[1024, 8192])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--cells", nargs="*", default=None, help="ctx:batch pairs (default: --ctx x --batches)")
    ap.add_argument("--backends", nargs="+", default=["flash_attn", "flashinfer"], help='"auto": the default pick')
    ap.add_argument(
        "--modes",
        nargs="*",
        default=["NONE", "PIECEWISE", "FULL"],
        help='"FULL+C": Inductor pieces; "DEFAULT": fgraph.jit\'s defaults',
    )
    ap.add_argument("--buckets", nargs="+", type=int, default=[1, 8, 64, 256], help="of the benchmarked jit")
    ap.add_argument("--peers", nargs="+", default=["eager", "graph", "compile"], help='subset, or "none"')
    ap.add_argument("--peer-backend", default=None, help="attention backend of the peers (default: flash_attn)")
    ap.add_argument("--no-host", dest="host", action="store_false", help="skip host time per FULL call")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="alternating timing rounds per cell")
    ap.add_argument("--kernels", action="store_true", help="kernels per step and layer (profiled after timing)")
    ap.add_argument(
        "--inputs-by-call",
        dest="inputs_in_graph",
        action="store_false",
        help="fgraph.config.inputs_in_graph = False: each call copies its inputs (the default before s6)",
    )
    ap.add_argument("--capture", action="store_true", help="capture cost of 2 routines x default buckets")
    ap.add_argument("--capture-max-bucket", type=int, default=512, help="default buckets up to this")
    ap.add_argument("--max-kv-gb", type=float, default=90.0, help="skip cells whose KV cache is larger")
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall budget; what does not fit is skipped")
    ap.add_argument("--cell-est-s", type=float, default=12.0, help="budget reserved per cell and backend")
    ap.add_argument("--capture-est-s", type=float, default=60.0, help="budget reserved per capture measurement")
    ap.add_argument("--compile-est-s", type=float, default=60.0, help="first guess of one torch.compile")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU check of every code path: tiny preset, torch backend")
    ap.add_argument("--name", default="decode", help="file stem of the results")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args(argv)
    if a.smoke:
        a.models, a.backends, a.device, a.cells = ["tiny"], ["torch"], "cpu", a.cells or ["64:1", "64:8", "256:8"]
        a.capture_max_bucket = min(a.capture_max_bucket, 16)
    a.peer_backend = a.peer_backend or ("flash_attn" if a.device.startswith("cuda") else "torch")
    if a.peer_backend not in a.backends and a.device == "cpu":
        a.peer_backend = a.backends[0]
    a.dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    return a


class Recorder:
    """Rows in memory and appended to the .jsonl as measured (printed whole, or as a shorter line)."""

    def __init__(self, path):
        self.path, self.rows = path, []
        open(path, "w").close()  # a new run starts a new file (its rows are appended as they come)

    def __call__(self, row, show=None):
        self.rows.append(row)
        if show is None:
            emit(self.path, row)
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")
        print(show, flush=True)


def main(argv=None):
    a = parse_args(argv)
    fgraph.config.inputs_in_graph = a.inputs_in_graph
    budget = Budget(a.budget_s)
    os.makedirs(a.out, exist_ok=True)
    rec = Recorder(os.path.join(a.out, f"{a.name}.jsonl"))
    torch.manual_seed(0)
    bw = copy_bandwidth(a.device, (2 << 30) if a.device.startswith("cuda") else (64 << 20))
    info = {
        "kind": "info",
        "part": a.name,
        "device": device_name(a.device),
        "torch": torch.__version__,
        "copy_TBps": bw / 1e12,
        "budget_s": a.budget_s,
        "inputs_in_graph": a.inputs_in_graph,
        "kernels": a.kernels,  # profiled after each cell's timings, which can slow the host side of later cells
        "command": "python3 -m benchmarks.decode_bench " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    rec(info)
    for name in a.models:
        run_model(name, a, rec, budget, bw)
    cells = summarize.merge_cells(rec.rows)
    caps = [r for r in rec.rows if r.get("kind") == "capture"]
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as fh:
        json.dump({"info": info, "cells": cells, "capture": caps, "rows": rec.rows}, fh, indent=1, default=str)
    print(
        f"\n{info['device']}, torch {info['torch']}, copy {info['copy_TBps']:.2f} TB/s, {budget.elapsed():.0f} s; "
        f"{info['command']}"
    )
    print(summarize.report(rec.rows))
    summarize.plot_decode(cells, os.path.join(a.out, f"{a.name}.png"))


if __name__ == "__main__":
    main()
