"""Diagnostics on the device (not a benchmark): where host time and capture time go, and which mode's MoE
logits differ. usage (device, repo root, .gpu carried): python3 scripts/diagnose_gpu.py [host|stages|h2d|capture|kernels|pool|inductor|gemv|moe|fa2out ...]
Prints cProfile tables and per-step logit differences; writes them to $OUT/diagnose.txt when OUT is set.
DIAG_MODEL=llama3-8b runs the parts on another preset (default qwen2.5-0.5b)."""

from __future__ import annotations

import cProfile
import functools
import io
import os
import pstats
import statistics
import sys
import time

import torch

from examples import llama
from fgraph.ops import attention as A

sys.path.insert(0, os.getcwd())
from benchmarks.common import decode_batch  # noqa: E402
from benchmarks.decode_bench import compile_peer, make_jitted, on_device  # noqa: E402

DEV = "cuda"
LOG = io.StringIO()


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")


def profile(fn, n, top=18, sort="tottime"):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(top)
    say(s.getvalue())


def host(cfg, params):
    """Host µs per FULL decode call, by part: the whole call, and torch's own primitives it uses."""
    x = torch.zeros(1 << 16, dtype=torch.uint8, pin_memory=True)
    y = torch.zeros(1 << 16, dtype=torch.uint8, device=DEV)
    ev = torch.cuda.Event()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        y.add_(1)
    for name, fn in [
        ("H2D copy 64KiB non_blocking", lambda: y.copy_(x, non_blocking=True)),
        ("event record", ev.record),
        ("event synchronize (done)", ev.synchronize),
        ("1-kernel graph replay", g.replay),
        ("empty python call", lambda: None),
    ]:
        torch.cuda.synchronize()
        ts = []
        for _ in range(2000):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        say(f"  {name:32s} {statistics.median(ts) * 1e6:7.2f} us")
    for backend, B, f, cache, batch in full_decode_cells(cfg):
        call = functools.partial(f, params, cache, batch, routine="decode")
        call()
        torch.cuda.synchronize()
        ts = []
        for _ in range(300):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        say(f"{backend} B={B} FULL decode host us: median {statistics.median(ts) * 1e6:.1f}")
        profile(call, 300)
        del call, f, cache  # (the cell's graphs go before the next cell's)


def full_decode_cells(cfg):
    """(backend, B, a FULL jit of the decode step for bucket B, its cache, a host batch) per attention backend and
    B in (1, 64), ctx 1k; once the caller drops its references, the cell's graphs and cache go before the next."""
    for backend in ("flash_attn", "flashinfer"):
        ps = A.page_size_for(backend)
        for B in (1, 64):
            batch, pages = decode_batch(cfg.vocab_size, B, 1024, ps, 4096)
            cache = llama.init_cache(cfg, pages + 1, ps, torch.bfloat16, DEV)
            f = make_jitted(cfg, backend, "FULL", 4096, [B])
            yield backend, B, f, cache, batch
            del f, cache
            torch.cuda.synchronize()


def stages(cfg, params):
    """Host µs of one FULL decode call by stage (median, GPU busy with a 3 ms spin before each call, as
    benchmarks.decode_bench's host time): perf_counter stamps around the entry's stages, patched on this entry
    only. dispatch = entry -> input write (bind, flatten, key lookup); write = pad into the pinned mirror (and, copied
    by the call: one H2D copy and an event); plan = execution token + plan hooks up to the replay; replay =
    CUDAGraph.replay; outputs = the rest (slice, unflatten, return). Per cell, two jits of the same step:
    fgraph.config.inputs_in_graph off (the call copies its inputs) and on (the graph does), called in alternating
    rounds of STAGES_CALLS (default 50) for STAGES_ROUNDS rounds (default 6): two runs of off-then-on
    disagreed, the host drifting within the process, and alternation bills that drift to both alike.
    STAGES_WAIT=spin waits for each call by polling an event instead of torch.cuda.synchronize(): whether a call
    after a blocking wait (a VM's vCPU that slept) is what makes dispatch 30-60 us there against ~5 us back to back."""
    import fgraph

    rounds, calls = int(os.environ.get("STAGES_ROUNDS", 6)), int(os.environ.get("STAGES_CALLS", 50))
    default = fgraph.config.inputs_in_graph
    try:
        for backend, B, f_off, cache, batch in full_decode_cells(cfg):
            timers = {}
            for label, f, in_graph in (
                ("copy per call", f_off, False),
                ("inputs in graph", make_jitted(cfg, backend, "FULL", 4096, [B]), True),
            ):
                fgraph.config.inputs_in_graph = in_graph  # read when the graph is captured: at its first call
                timers[label] = stage_timer(f, params, cache, batch)
            del f
            rows = {k: [] for k in timers}
            for _ in range(rounds):
                for label, timed in timers.items():
                    rows[label] += [timed() for _ in range(calls)]
            for label, r in rows.items():
                med = [statistics.median(c) * 1e6 for c in zip(*r)]
                say(
                    f"{label:15s} {backend:10s} B={B:3d} us: dispatch {med[0]:6.1f}  write {med[1]:6.1f}  plan {med[2]:6.1f}  "
                    f"replay {med[3]:6.1f}  outputs {med[4]:6.1f}  total {med[5]:6.1f}  ({len(r)} calls in {rounds} rounds)"
                )
            del f_off, cache, timers
    finally:
        fgraph.config.inputs_in_graph = default


def stage_timer(f, params, cache, batch):
    """A function timing one call of f's (single) entry by stage, after a 3 ms GPU spin: the 6 stage durations."""
    f(params, cache, batch, routine="decode")
    (entry,) = f.entries.values()
    st = {}
    write, replay = entry.buffers.write, entry.full.replay

    def timed_write(*a, **k):
        st["w0"] = time.perf_counter()
        out = write(*a, **k)
        st["w1"] = time.perf_counter()
        return out

    def timed_replay():
        st["r0"] = time.perf_counter()
        out = replay()
        st["r1"] = time.perf_counter()
        return out

    entry.buffers.write, entry.full.replay = timed_write, timed_replay

    spin, done = os.environ.get("STAGES_WAIT") == "spin", torch.cuda.Event()

    def timed():
        torch.cuda._sleep(3_000_000)
        t0 = time.perf_counter()
        f(params, cache, batch, routine="decode")
        t1 = time.perf_counter()
        if spin:
            done.record()
            while not done.query():
                pass
        else:
            torch.cuda.synchronize()
        return (st["w0"] - t0, st["w1"] - st["w0"], st["r0"] - st["w1"], st["r1"] - st["r0"], t1 - st["r1"], t1 - t0)

    return timed


def h2d(_cfg, _params):
    """The CUDA calls of InputBuffers.write one by one, each timed alone on a busy stream (a 3 ms spin before each,
    as in stages) and back to back (hot): event.synchronize on a completed event, a 4 KiB pinned -> device
    copy_(non_blocking), event.record, CUDAGraph replay of an empty-ish graph; median us of 300."""
    pinned = torch.zeros(4096, dtype=torch.uint8, pin_memory=True)
    dev = torch.zeros(4096, dtype=torch.uint8, device=DEV)
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    g, x = torch.cuda.CUDAGraph(), torch.zeros(8, device=DEV)
    with torch.cuda.graph(g):
        x.add_(1)
    ops = {
        "event.synchronize (done)": ev.synchronize,
        "copy_ 4 KiB pinned->dev": lambda: dev.copy_(pinned, non_blocking=True),
        "event.record": ev.record,
        "graph.replay (1 kernel)": g.replay,
        "torch.cuda._sleep(0)": lambda: torch.cuda._sleep(0),
    }
    for name, op in ops.items():
        for busy in (True, False):
            ts = []
            for _ in range(300):
                if busy:
                    torch.cuda._sleep(6_000_000)
                t0 = time.perf_counter()
                op()
                ts.append(time.perf_counter() - t0)
                if busy:
                    torch.cuda.synchronize()
            say(
                f"{name:28s} {'after a 3 ms spin' if busy else 'back to back':18s}: {statistics.median(ts) * 1e6:7.1f} us"
            )
        torch.cuda.synchronize()


def capture(cfg, params):
    for backend in ("flash_attn", "flashinfer"):
        ps = A.page_size_for(backend)
        batch, _ = decode_batch(cfg.vocab_size, 1, 1024, ps)
        cache = llama.init_cache(cfg, 2 + 512 * (-(-1024 // ps)), ps, torch.bfloat16, DEV)
        f = make_jitted(cfg, backend, "FULL_AND_PIECEWISE", 4096, None)
        t0 = time.perf_counter()
        pr = cProfile.Profile()
        pr.enable()
        f.capture(params, cache, batch, routine=["decode", "mixed"], progress=False)
        pr.disable()
        secs = time.perf_counter() - t0
        mem = sum(e.pool_bytes for e in f.entries.values()) / 2**30
        say(
            f"{backend}: capture {secs:.1f} s, {f.stats()['total']['captures']} graphs, {len(f.entries)} signatures, "
            f"pool {mem:.2f} GiB, reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB"
        )
        traces = {id(e.traced): e.traced.seconds for e in f.entries.values()}
        say(
            f"   traces {len(traces)}: {sum(traces.values()):.1f} s; per-signature capture (warm-up + graphs): "
            f"{sum(e.capture_seconds for e in f.entries.values()):.1f} s; the rest: "
            f"{secs - sum(traces.values()) - sum(e.capture_seconds for e in f.entries.values()):.1f} s"
        )
        for e in sorted(f.entries.values(), key=lambda e: (e.sig.statics, e.sig.bucket))[::10]:
            say(
                f"   {e.sig.describe():40s} {e.mode.name:9s} {e.capture_seconds * 1e3:7.1f} ms {e.pool_bytes / 2**20:8.1f} MiB"
            )
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30)
        say(s.getvalue())
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20)
        say(s.getvalue())
        del f, cache
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def kernels(cfg, params):
    """The kernels of one decode step (DIAG_MODEL, ctx 1k, B = 1 and 64) under fgraph FULL+C per backend and under
    torch.compile(reduce-overhead) of the same step (FA2 attention): per kernel name, launches and GPU us per
    step (benchmarks.kernels.kernel_table: torch.profiler over 20 replays), to see where a step's time goes and
    what each side fuses.
    KERNELS_B="1 64" and KERNELS_SIDES="flashinfer flash_attn compile" pick the cells; KERNELS_CDT=1 compiles
    fgraph's pieces with coordinate-descent tuning (see gemv)."""
    from benchmarks.kernels import kernel_table, table_lines

    def table(label, fn):
        for line in table_lines(label, kernel_table(fn), cfg.n_layers):
            say(line)

    sides = os.environ.get("KERNELS_SIDES", "flashinfer flash_attn compile").split()  # compile: its FA2 peer
    for B in map(int, os.environ.get("KERNELS_B", "1 64").split()):
        for side in sides:
            backend = "flash_attn" if side == "compile" else side
            ps = A.page_size_for(backend)
            batch, pages = decode_batch(cfg.vocab_size, B, 1024, ps, 4096)
            cache = llama.init_cache(cfg, pages + 1, ps, torch.bfloat16, DEV)
            if side != "compile":
                cdt = os.environ.get("KERNELS_CDT") == "1"
                f = make_jitted(cfg, backend, "FULL+C", 4096, [B], {"coordinate_descent_tuning": True} if cdt else None)
                table(
                    f"fgraph FULL+C{' (coordinate descent)' if cdt else ''} {backend} B={B}",
                    functools.partial(f, params, cache, batch, routine="decode"),
                )
                del f
            else:
                from torch import _dynamo

                call, b = compile_peer(cfg, params, cache, backend, 4096), on_device(batch, DEV)
                table(f"torch.compile {backend} B={B}", lambda: call(b))
                del call
                _dynamo.reset()
            del cache
            torch.cuda.synchronize()


def pool(cfg, params):
    """Capture cost (benchmarks.decode_bench.capture_cost, FA2) with attention() as it is, then with k/v made
    contiguous in the traced program (an attention() with an N == 1 guard made 4 traces): pool and time."""
    import argparse

    from benchmarks.decode_bench import capture_cost

    a = argparse.Namespace(device=DEV, dtype=torch.bfloat16, capture_max_bucket=512)
    orig = A.attention

    def contiguous_kv(q, k, v, *args, **kw):
        return orig(q.contiguous(), k.contiguous(), v.contiguous(), *args, **kw)

    for label, fn in (("as is", orig), ("k/v contiguous in the trace", contiguous_kv), ("as is, again", orig)):
        A.attention = fn
        c = capture_cost(cfg, params, "flash_attn", a)
        top = sorted(c["per_signature"], key=lambda p: -p["pool_MiB"])[:4]
        say(
            f"{label:30s} {c['capture_s']:5.1f} s (traces {c['trace_s']:.1f}, graphs {c['graphs_s']:.1f}), "
            f"{c['traces']} traces, pool {c['pool_GiB']:.3f} GiB, reserved {c['reserved_GiB']:.3f} GiB; largest "
            + ", ".join(f"{p['routine']}/{p['bucket']} {p['pool_MiB']:.0f} MiB" for p in top)
        )
    A.attention = orig


def inductor(cfg, params):
    """How far Inductor-compiled steps are from the eager step (bf16, FA2, 7 sequences at position 300, both
    routines): fgraph FULL+C with and without its residual-add pass, and torch.compile of the same step, each as
    max |d| / max |logit| and argmax agreement (the scale tests/examples/test_models_gpu.py's FULL+C tolerance is set by)."""
    from fgraph import _inductor

    ps = A.page_size_for("flash_attn")
    batch, pages = decode_batch(cfg.vocab_size, 7, 300, ps, 1024)
    g = torch.Generator(device=DEV).manual_seed(0)
    step = llama.make_step(cfg, backend="flash_attn", max_seq_len=1024)
    comp = torch.compile(step, fullgraph=True, dynamic=False)
    real_pass = _inductor._residual_adds_out_of_gemms
    for label in ("FULL+C", "FULL+C without the pass", "torch.compile", "FULL"):
        cache = llama.init_cache(cfg, pages + 1, ps, torch.bfloat16, DEV)
        for t in [*cache.k, *cache.v]:
            t.normal_(generator=g)
        _inductor._residual_adds_out_of_gemms = real_pass if label == "FULL+C" else (lambda: None)
        f = make_jitted(cfg, "flash_attn", label.split()[0] if label != "torch.compile" else "FULL", 1024, [8])
        for routine in ("decode", "mixed"):
            want = step(params, cache, on_device(batch, DEV), routine)[0].float()
            got = (
                comp(params, cache, on_device(batch, DEV), routine)
                if label == "torch.compile"
                else f(params, cache, batch, routine=routine)
            )[0].float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            say(f"{label:26s} {routine:6s}: max |d| / max |logit| = {err:.2e}, argmax agreement {agree:.2f}")
    _inductor._residual_adds_out_of_gemms = real_pass


def gemv(_cfg, _params):
    """Inductor's coordinate-descent tuning (gpt-fast's setting): with it, Inductor rewrites a one-row matmul
    (decode at B = 1) as a Triton reduction, tuned, with the RMSNorm scaling fused in, instead of cuBLAS's GEMV.
    Per model and B (ctx 1k), in one process: fgraph FULL+C per backend with Inductor's defaults and with
    {"coordinate_descent_tuning": True}, and torch.compile (FA2 step) both ways. GEMV_MODELS, GEMV_B,
    GEMV_BACKENDS pick the cells."""
    from torch import _dynamo

    from benchmarks.common import time_ms
    from benchmarks.decode_bench import weight_bytes

    tuned = {"coordinate_descent_tuning": True}
    for name in os.environ.get("GEMV_MODELS", "qwen2.5-0.5b llama3-8b").split():
        cfg = llama.preset(name)
        params = llama.init_params(cfg, torch.bfloat16, DEV)
        say(f"--- {name}: {weight_bytes(params) / 1e9:.2f} GB of weights")
        for B in map(int, os.environ.get("GEMV_B", "1 64").split()):
            for side in os.environ.get("GEMV_BACKENDS", "flashinfer flash_attn compile").split():
                backend = "flash_attn" if side == "compile" else side
                ps = A.page_size_for(backend)
                batch, pages = decode_batch(cfg.vocab_size, B, 1024, ps, 4096)
                cache = llama.init_cache(cfg, pages + 1, ps, torch.bfloat16, DEV)
                for label, opts in (("defaults", None), ("coordinate descent", tuned)):
                    t0 = time.perf_counter()
                    if side == "compile":
                        call, b = compile_peer(cfg, params, cache, backend, 4096, opts), on_device(batch, DEV)
                        step = functools.partial(call, b)
                    else:
                        f = make_jitted(cfg, backend, "FULL+C", 4096, [B], opts)
                        step = functools.partial(f, params, cache, batch, routine="decode")
                    step()
                    torch.cuda.synchronize()
                    setup = time.perf_counter() - t0
                    ms = time_ms(step, DEV, rep_s=0.2, reps=7)
                    say(f"{name} B={B:3d} {side:10s} {label:18s}: {ms:.3f} ms/step (set-up {setup:.1f} s)")
                    del step
                    if side == "compile":
                        del call
                        _dynamo.reset()
                    else:
                        del f
                    torch.cuda.synchronize()
                del cache
        del params
        torch.cuda.empty_cache()


def moe(_cfg, _params):
    """Per-step logits of the tiny MoE model under eager (hand-padded), NONE, PIECEWISE, for local and all2all."""
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist

    from examples import qwen2_moe

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(
            "nccl",
            init_method=f"file://{d}/store",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
            device_id=torch.device(DEV, 0),
        )
        runs = {}
        combos = [(b, m, "auto") for b in ("local", "all2all") for m in ("eager", "NONE", "FULL")]
        combos += [(b, "eager", a) for b in ("local", "all2all") for a in ("torch", "flash_attn")]
        for backend, mode, attn in combos:
            cfg = qwen2_moe.preset("tiny-moe", moe_backend=backend, mlp_only_layers=(1,), n_layers=3)
            params = qwen2_moe.init_params(cfg, torch.bfloat16, DEV, seed=0)
            eng = qwen2_moe.build(
                cfg,
                params,
                backend=attn,
                mode=mode,
                max_seqs=8,
                max_seq_len=96,
                max_batch_tokens=64,
                capture=mode not in ("eager", "NONE"),
            )
            logs = []
            run_batch = eng.run_batch

            def rec(batch, routine, run_batch=run_batch, logs=logs):
                out = run_batch(batch, routine)
                logs.append((routine, out.float().clone()))
                return out

            eng.run_batch = rec
            g = torch.Generator().manual_seed(0)
            for n in (5, 17, 1, 33, 9, 2, 40, 12):
                eng.add(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), max_new_tokens=12)
            runs[backend, mode, attn] = (eng.run(progress=False).tokens, logs)
            del eng
            torch.cuda.synchronize()
        # the op alone, eager, on decode-like and prefill-like inputs: all2all at world 1 against local
        from fgraph.ops import moe as M

        w = M.MoEWeights.random(
            16,
            256,
            128,
            256,
            top_k=4,
            dtype=torch.bfloat16,
            device=DEV,
            renormalize=True,
            generator=torch.Generator().manual_seed(0),
        )
        for n in (1, 8, 64):
            x = torch.randn(n, 256, dtype=torch.bfloat16, device=DEV)
            a, b = M.moe(x, w, "local"), M.moe(x, w, "all2all")
            say(f"moe op n={n}: max|all2all - local| = {(a.float() - b.float()).abs().max().item():.2e}")
        for attn in ("auto", "torch", "flash_attn"):
            key = ("local", "eager", attn)
            if key not in runs:
                continue
            ref_tokens, ref = runs[key]
            for other in ("local", "all2all"):
                tokens, logs = runs[other, "eager", attn]
                say(
                    f"attention={attn}: eager {other} vs eager local: tokens equal {tokens == ref_tokens}; "
                    f"max|dlogits| per step {' '.join(_diff(a, b) for (_, a), (_, b) in zip(logs, ref))}"
                )
        ref_tokens, ref = runs["local", "eager", "auto"]
        for key, (tokens, logs) in runs.items():
            say(f"moe {key}: tokens equal local/eager/auto: {tokens == ref_tokens}; steps {[r for r, _ in logs]}")
        dist.destroy_process_group()


def fa2out(cfg, params):
    """FA2 attention writing into the break's `out` (now) against the earlier path (flash_attn's public functions,
    then out.copy_), one process: two FULL+C jits per B (ctx 1k), GPU ms per step timed in alternating rounds, and
    the largest logit difference between them (the same kernels: expected 0)."""
    from benchmarks.common import gpu_ms
    from fgraph.ops import _attn_flash as F

    now = F.forward

    def copied(
        out,
        q,
        k,
        v,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        slot_mapping,
        *,
        routine,
        scale,
        max_seq_len,
    ):
        from flash_attn import flash_attn_with_kvcache

        page, Hkv = k_cache.shape[1], k_cache.shape[2]
        L = block_table.shape[1] * page
        if routine != "decode":
            return now(
                out,
                q,
                k,
                v,
                k_cache,
                v_cache,
                query_start_loc,
                seq_lens,
                block_table,
                slot_mapping,
                routine=routine,
                scale=scale,
                max_seq_len=max_seq_len,
            )
        splits = F.decode_num_splits(q.shape[0], Hkv, q.shape[1] // Hkv, q.shape[2], L, F._num_sms(0))
        before = F.once_per_execution(("fa2 cache_seqlens", id(seq_lens)), lambda: seq_lens - 1)
        o = flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            k=k.unsqueeze(1),
            v=v.unsqueeze(1),
            cache_seqlens=before,
            block_table=block_table,
            softmax_scale=scale,
            causal=True,
            num_splits=splits,
        )
        out.copy_(o.squeeze(1))

    for B in (1, 64):
        batch, pages = decode_batch(cfg.vocab_size, B, 1024, 256, 4096)
        cache = llama.init_cache(cfg, pages + 1, 256, torch.bfloat16, DEV)
        fs = {}
        for label, fwd in (("public fn + copy", copied), ("into out", now)):
            F.forward = fwd  # read at each call of the break: the capture records this path's kernels
            try:
                f = make_jitted(cfg, "flash_attn", "FULL+C", 4096, [B])
                f(params, cache, batch, routine="decode")
            finally:
                F.forward = now
            fs[label] = f
        outs = {k: f(params, cache, batch, routine="decode")[0].float() for k, f in fs.items()}
        ms = {k: [] for k in fs}
        for _ in range(5):
            for k, f in fs.items():
                ms[k].append(gpu_ms(functools.partial(f, params, cache, batch, routine="decode")))
        a, b = (statistics.median(v) for v in ms.values())
        say(
            f"FA2 FULL+C B={B}: public fn + copy {a:.3f} ms, into out {b:.3f} ms ({(b / a - 1) * 100:+.1f} %), "
            f"max |logit diff| {(outs['into out'] - outs['public fn + copy']).abs().max().item():.1e}"
        )
        del fs, cache
        torch.cuda.synchronize()


def _diff(a, b):
    n = min(a.shape[0], b.shape[0])  # eager runs return the padded rows too
    return f"{(a[:n] - b[:n]).abs().max().item():.1e}"


def main():
    parts = sys.argv[1:] or ["host", "capture", "moe"]
    cfg = llama.preset(os.environ.get("DIAG_MODEL", "qwen2.5-0.5b"))  # the model of every part but gemv / moe
    params = llama.init_params(cfg, torch.bfloat16, DEV)
    say(
        torch.cuda.get_device_name(), torch.__version__, "commit", os.popen("git rev-parse --short HEAD").read().strip()
    )
    for p in parts:
        say(f"==== {p}")
        t0 = time.perf_counter()
        try:
            globals()[p](cfg, params)
        except Exception:  # keep going: the other parts still tell something
            import traceback

            say(traceback.format_exc())
        say(f"==== {p} took {time.perf_counter() - t0:.1f} s")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "diagnose.txt"), "w") as fh:
                fh.write(LOG.getvalue())


if __name__ == "__main__":
    main()
