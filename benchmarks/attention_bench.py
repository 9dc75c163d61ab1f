"""Attention microbenchmark on the GPU: the attention op alone (KV write + break), per backend and routine,
replayed inside a CUDA graph, against the bytes it must read over the copy bandwidth measured in this run.

  shapes     Qwen2.5-0.5B (14 q heads, 2 kv heads, dim 64) and Llama-3-8B (32, 8, 128), bf16, one layer
  batches    B sequences with one new token each, every sequence at context C (B = the bucket: no padding)
  routines   decode, and the same batch through the mixed routine (what a mixed graph costs on decode work)
  graph      each (backend, routine) replayed as one torch.cuda.CUDAGraph (flashinfer's mixed routine through
             its CUDA-graph prefill wrapper: one sequence slot per token, as here)
  floor      K and V bytes of the batch / copy bandwidth (read+write bytes of a 2 GiB copy per second)
  plan_us    flashinfer: host time of the plan hook per step (host metadata + plan()), hook = what
             fgraph.jit runs before every replay, on the same metadata every step (so the plan is skipped);
             stock_us = flashinfer's plan() fed CPU page ids (it then copies them with a blocking copy: a
             stream sync, cheap here only because the GPU is idle)
  step_us    flashinfer decode: the hook over consecutive decode steps, lengths +1 a step from staggered
             offsets in their pages (as in serving: at larger batches some sequence enters a new page most
             steps, so most steps re-plan); skip_us: +1 a step inside one page (every plan skipped, only
             host metadata + upload; skip_full_us: the same without reusing the last step's indptr and page
             ids, i.e. full host metadata + full upload); new_us: the page counts change every step (every step re-plans through
             the module's plan call); step_skipped: the share of steps step_us skipped; mixed new_us: the
             hook when the page counts change every step (two layouts in turn: every plan the module's call)

usage (device): source .gpu/activate.sh; python3 -m benchmarks.attention_bench [--quick] [--backends triton flash_attn ...]
Prints a table; writes benchmarks/results/attention.json (or under --out / $OUT).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time

import torch

from fgraph.ops import attention as A

from .common import copy_bandwidth, gpu_ms

DEV, BF = "cuda", torch.bfloat16
SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3-8b": (32, 8, 128)}


def host_us(fn, iters: int = 200) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def decode_steps(batch: int, ctx: int, page: int, max_pages: int, pages, kind: str, steps: int = 64):
    """Host metadata (padded as fgraph pads it) of `steps` consecutive decode steps, lengths around ctx.
    grow: sequence b at ctx + (5 b mod page), +1 a step; same: page-aligned + 1, +1 a step inside one page
    (wraps within the page); new: page counts alternate every step."""
    base = max(0, ctx // page * page - 5 * page)  # room for 64 steps of growth within max_pages (page 16)

    def lens(i):
        if kind == "grow":
            return [base + (5 * b) % page + 1 + i for b in range(batch)]
        if kind == "same":
            return [base + 1 + i % (page - 1)] * batch
        return [base + 1 + (page if i % 2 else 0)] * batch

    return [A.pad_metadata(A.build_metadata([1] * batch, lens(i), pages, page, max_pages), batch) for i in range(steps)]


def plan_steps_us(metas, page: int, d: int, iters: int = 200) -> tuple[float, float]:
    """Host us per step of the plan hook cycling over `metas`, and the share of plans it skipped."""
    from fgraph.ops import _attn_flashinfer as FI

    it = itertools.cycle(metas)
    fn = lambda: A.plan_attention(next(it), backend="flashinfer", routine="decode", page_size=page, scale=d**-0.5)
    for _ in range(len(metas)):
        fn()
    before = FI.stats()
    us = host_us(fn, iters)
    after = FI.stats()
    made = {k: after[k] - before[k] for k in after}
    return us, made["skip"] / max(1, sum(made.values()))


def bench(backend: str, routine: str, shape, batch: int, ctx: int, iters: int, bw: float) -> dict:
    hq, hkv, d = shape
    page = A.page_size_for(backend)
    max_pages = math.ceil(ctx / page) + 1  # + 1: room for the growing lengths of the plan-step timings
    g = torch.Generator().manual_seed(0)
    num_pages = 1 + batch * max_pages
    k_cache = torch.randn(num_pages, page, hkv, d, dtype=BF, device=DEV)
    v_cache = torch.randn_like(k_cache)
    pages = (torch.randperm(num_pages - 1, generator=g) + 1).view(batch, max_pages).tolist()  # scattered pages
    meta = A.build_metadata([1] * batch, [ctx] * batch, pages, page, max_pages)
    dmeta = meta.to(DEV)
    q = torch.randn(batch, hq, d, dtype=BF, device=DEV)
    k, v = torch.randn(batch, hkv, d, dtype=BF, device=DEV), torch.randn(batch, hkv, d, dtype=BF, device=DEV)
    step = lambda: A.attention(q, k, v, k_cache, v_cache, dmeta, backend=backend, routine=routine, max_seq_len=ctx)
    plan = lambda: A.plan_attention(meta, backend=backend, routine=routine, page_size=page, scale=d**-0.5)
    plan()
    step()  # warm-up: flashinfer creates and plans its wrapper here
    torch.cuda.synchronize()
    graphed = True
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    fn = graph.replay
    once = gpu_ms(fn, 1, reps=1, warm=1)  # keep slow configurations (the torch reference at 8k) to about a second
    ms = gpu_ms(fn, max(2, min(iters, int(1000 / max(once, 1e-3)))), warm=1)
    kv_bytes = 2 * batch * ctx * hkv * d * BF.itemsize
    row = dict(
        backend=backend,
        routine=routine,
        batch=batch,
        ctx=ctx,
        graph=graphed,
        us=ms * 1e3,
        floor_us=kv_bytes / bw * 1e6,
        kv_mb=kv_bytes / 1e6,
    )
    row["x_floor"] = row["us"] / row["floor_us"]
    if backend == "flashinfer":
        from fgraph.ops import _attn_flashinfer as FI

        row["plan_us"] = host_us(plan)
        row["meta_us"] = host_us(lambda: FI.host_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, page))
        if routine == "decode":
            h = FI.host_plan(meta.query_start_loc, meta.seq_lens, meta.block_table, page)
            # this shape's wrapper: a wrapper of another head config at this batch (left by an earlier run in the
            # process) planned with these heads raised "Unsupported group_size: 7" on the H200
            w = next(
                w
                for key, w in FI._wrappers.items()
                if key[0] == "decode" and key[1] == batch and key[3][:3] == (hq, hkv, d)
            )
            try:  # a peer that fails is a result too
                row["stock_us"] = host_us(
                    lambda: w.fi.plan(
                        h.t("indptr"),
                        h.t("indices"),
                        h.t("last"),
                        hq,
                        hkv,
                        d,
                        page,
                        q_data_type=BF,
                        kv_data_type=BF,
                        sm_scale=d**-0.5,
                    )
                )
            except RuntimeError as e:
                row["stock_error"] = str(e)[-160:]
            w.planned = None  # plan() above replaced its plan behind our back
            for kind, key in (("grow", "step_us"), ("same", "skip_us"), ("new", "new_us")):
                us, skipped = plan_steps_us(decode_steps(batch, ctx, page, max_pages, pages, kind), page, d)
                row[key] = us
                if kind == "grow":
                    row["step_skipped"] = skipped
            real = FI.host_plan  # the same within-page steps without host_plan's reuse of the previous layout
            FI.host_plan = lambda *a, prev=None, **k: real(*a, **k)
            try:
                row["skip_full_us"] = plan_steps_us(decode_steps(batch, ctx, page, max_pages, pages, "same"), page, d)[
                    0
                ]
            finally:
                FI.host_plan = real
            plan()  # leave it planned our way
        else:  # a mixed step's plan when its offsets change every step (two page layouts in turn): the module call
            other = A.build_metadata([1] * batch, [ctx - page] * batch, pages, page, max_pages)
            turn = iter(range(1 << 30))
            metas = (meta, other)
            row["new_us"] = host_us(
                lambda: A.plan_attention(
                    metas[next(turn) % 2], backend=backend, routine=routine, page_size=page, scale=d**-0.5
                )
            )
            plan()
    del fn, graph, k_cache, v_cache
    if backend == "flashinfer":
        from fgraph.ops import _attn_flashinfer as FI

        FI.reset()  # free its wrappers and buffers; a plan would otherwise serve every old wrapper of its bucket
    torch.cuda.empty_cache()
    return row


def table(rows) -> str:
    head = (
        f"{'model':<13}{'backend':<11}{'routine':<8}{'B':>5}{'ctx':>6}{'graph':>6}{'us':>10}{'floor':>9}"
        f"{'x floor':>9}{'plan_us':>9}{'stock_us':>9}{'step_us':>9}{'skip_us':>9}{'skip_full':>10}{'new_us':>9}"
        f"{'skipped':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"{r['model']:<13}{r['backend']:<11}{r['routine']:<8}{r['batch']:>5}{r['ctx']:>6}  "
                f"skipped: {r['skipped']}"
            )
            continue
        f = lambda k: f"{r[k]:>9.1f}" if k in r else f"{'':>9}"
        lines.append(
            f"{r['model']:<13}{r['backend']:<11}{r['routine']:<8}{r['batch']:>5}{r['ctx']:>6}"
            f"{'yes' if r['graph'] else 'no':>6}{r['us']:>10.1f}{r['floor_us']:>9.1f}{r['x_floor']:>9.2f}"
            f"{f('plan_us')}{f('stock_us')}{f('step_us')}{f('skip_us')} {f('skip_full_us')}{f('new_us')}"
            f"{f('step_skipped')}"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["torch", "flash_attn", "flashinfer", "triton"])
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="batches 1,8; context 1024; few iterations")
    ap.add_argument(
        "--tensor-core-plan-paths",
        action="store_true",
        help="let tensor-core decode wrappers skip / call the module's plan (FI.TENSOR_CORE_PLAN_PATHS)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args(argv)
    if a.tensor_core_plan_paths:
        from fgraph.ops import _attn_flashinfer as FI

        FI.TENSOR_CORE_PLAN_PATHS = True
    if a.quick:
        a.contexts, a.iters = "1024", min(a.iters, 10)
        a.batches = "1,8" if a.batches == ap.get_default("batches") else a.batches
    backends = []
    for b in (name for arg in a.backends for name in arg.split(",")):  # "a b" or "a,b"
        try:
            backends.append(A.resolve_backend(b, DEV))
        except Exception as e:
            print(f"skipping backend {b}: {e}")
    bw = copy_bandwidth()
    info = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_TBps=bw / 1e12,
        tensor_core_plan_paths=a.tensor_core_plan_paths,
    )
    for pkg in ("flash_attn", "flashinfer", "triton"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception:
            pass
    print(json.dumps(info), flush=True)
    rows = []
    for model in a.models.split(","):
        for ctx in map(int, a.contexts.split(",")):
            for batch in map(int, a.batches.split(",")):
                for backend in backends:
                    for routine in ("decode", "mixed"):
                        base = dict(model=model, backend=backend, routine=routine, batch=batch, ctx=ctx)
                        if backend == "torch" and batch * ctx > 64 * 8192:
                            rows.append(dict(base, skipped="the reference gathers every page per token: too slow here"))
                            continue
                        try:
                            rows.append(dict(base, **bench(backend, routine, SHAPES[model], batch, ctx, a.iters, bw)))
                        except torch.cuda.OutOfMemoryError as e:
                            rows.append(dict(base, skipped=f"out of memory ({str(e).splitlines()[0][:60]})"))
                            torch.cuda.empty_cache()
                        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "attention.json")
    with open(path, "w") as fh:
        json.dump({"info": info, "rows": rows}, fh, indent=1)
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
