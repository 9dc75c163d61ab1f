"""fgraph::linear's kernel against cuBLAS: each decode GEMM alone, then the whole FULL+C decode step with
fgraph.config.small_m_gemv off and on, in one process, alternating rounds, logits checked against eager.

  python3 scripts/ab_gemv.py [--presets qwen2.5-0.5b llama3-8b] [--batches 1 8 64] [--ctx 1024] [--rounds 5]

Part 1 (`gemm` rows): per preset, layer GEMM and row count, cuBLAS's time and every candidate config's (for
`gate_up+silu_mul`, fgraph::linear_glu's: "cublas" is then cuBLAS and the activation's launch), each
replayed in a CUDA graph (triton.testing.do_bench_cudagraph: kernel time with its launch gaps), the fastest, and
what the op's tuner picks; % of copy bandwidth = the weight's bytes over the time, against this run's copy rate.
Part `space` (`--parts space`, not by default): per GEMM and row count, a wider config space than the tuner's
(`space`), screened, its 8 fastest and the candidates' fastest timed again: what the candidates leave on the table.
Part 2 (`step` rows): the step's median ms (CUDA events, back-to-back calls) and spread over rounds per variant,
capture seconds (compile and tuning included), the matmuls rewritten and the op's tuned keys; the logits' largest
difference from eager's over eager's largest.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import time

import torch
import torch.utils._pytree as pytree

import fgraph
from benchmarks.common import copy_bandwidth, decode_batch, device_name, jit_step, time_ms
from examples import llama
from fgraph.compile import compiler
from fgraph.kernels import _gemv
from fgraph.ops import attention as A


def emit(row: dict) -> None:
    print(json.dumps(row, default=str), flush=True)


def gemm_shapes(cfg) -> dict:
    """name -> (N, K, bias) of a layer's GEMMs and the head (the weight [N, K])."""
    D, hq, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    return {
        "qkv": ((hq + 2 * hkv) * D, cfg.dim, bool(getattr(cfg, "qkv_bias", False))),
        "o": (cfg.dim, hq * D, False),
        "gate_up": (2 * cfg.intermediate, cfg.dim, False),
        "down": (cfg.dim, cfg.intermediate, False),
        "head": (cfg.vocab_size, cfg.dim, False),
    }


def part_gemms(name, cfg, batches, bw, rep: int = 20) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    rows = []

    for gemm, (n, k, bias) in gemm_shapes(cfg).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        glus = (False, True) if gemm == "gate_up" else (False,)
        for m, glu in [(B, g) for B in batches if B <= _gemv.MAX_ROWS for g in glus]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n // 2 if glu else n, device="cuda", dtype=torch.bfloat16)
            if glu:  # fgraph::linear_glu: against cuBLAS and the activation's launch
                full = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                unfused = lambda: _gemv.silu_mul(_gemv._cublas(x, w, b, out=full), out=y)  # noqa: E731
            else:
                unfused = lambda: _gemv._cublas(x, w, b, out=y)  # noqa: E731
            us = {"cublas": 1e3 * do_bench_cudagraph(unfused, rep=rep)}
            for cfg_ in _gemv.candidates(m, y.shape[1], k, glu):
                us[str(cfg_)] = 1e3 * do_bench_cudagraph(lambda c=cfg_: _gemv._launch(c, x, w, b, y, glu), rep=rep)
            best = min((v, c) for c, v in us.items() if c != "cublas")
            _gemv._choice.pop((m, n, k, torch.bfloat16, bias, glu, 0, x.device.index), None)
            chose = _gemv._tune(x, w, b, glu)
            pct = lambda t: round(100 * 2 * n * k / (t * 1e-6) / bw, 1)  # noqa: E731
            rows.append({"part": "gemm", "model": name, "gemm": gemm + ("+silu_mul" if glu else ""), "M": m, "N": n, "K": k,
                  "bias": bias, "cublas_us": round(us["cublas"], 2), "cublas_pct_bw": pct(us["cublas"]),
                  "best_triton_us": round(best[0], 2), "best_triton": best[1], "best_pct_bw": pct(best[0]),
                  "best_over_cublas": round(best[0] / us["cublas"], 3), "tuner_picks": str(chose) if chose else "cublas",
                  "all_us": {c: round(v, 2) for c, v in us.items()}})  # fmt: skip
            emit(rows[-1])
    return rows


def part_configs(rows: list[dict]) -> None:
    """Per base config (split or not), over every gemm row: its best time over that row's fastest (kernel or cuBLAS),
    the closest it came, and in how many rows it was within 3 % of the fastest kernel: which candidates a search could
    leave out (each base config is a compile per kind of key, most of a cold start's tuning)."""
    closest: dict[str, list[float]] = {}
    for r in rows:
        us = dict(r["all_us"])
        cublas = us.pop("cublas")
        fastest_kernel = min(us.values())
        per_base: dict[str, float] = {}
        for c, t in us.items():
            cfg_ = ast.literal_eval(c)
            base = str((*cfg_[:-1], cfg_[-1] > 1))
            per_base[base] = min(per_base.get(base, float("inf")), t)
        for base, t in per_base.items():
            closest.setdefault(base, []).append((t / min(fastest_kernel, cublas), t / fastest_kernel))
    for base, got in sorted(closest.items(), key=lambda kv: min(a for a, _ in kv[1])):
        emit({"part": "configs", "config (split)": base, "rows": len(got), "closest_to_fastest": round(min(a for a, _ in got), 3),
              "within_3pct_of_fastest_kernel": sum(b <= 1.03 for _, b in got)})  # fmt: skip


def space(m: int, n: int, k: int, glu: bool) -> list[tuple]:
    """A wider config space than the tuner's candidates (`--parts space`): the reduce path (rows <= 4) over BLOCK_N,
    BLOCK_K, warps and stages within its register budget, the dot path over BLOCK_N, BLOCK_K, warps and stages, and
    for K >= 2048 the dot configs split 4 and 8 ways (not with glu)."""
    red = [(bn, bk, w, st, False, 1) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) for w in (1, 2, 4, 8)
           for st in (1, 3) if _gemv.reduce_fits(m, bn, bk, glu) and bk <= max(256, 2 * k)]  # fmt: skip
    dot = [(bn, bk, w, st, True, 1) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (2, 4) for st in (2, 3, 4)]
    split = [(*c[:-1], sp) for c in dot for sp in (4, 8) if not glu and k >= 2048 and k >= 2 * sp * c[1]]
    return red + dot + split


def part_space(name, cfg, batches, bw) -> None:
    """Per GEMM and row count: every config of `space` screened at 2 ms of launches, the 8 fastest and the tuner's
    candidates' fastest timed again at 20 ms, against cuBLAS (for glu: cuBLAS and the activation's launch)."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.testing import do_bench_cudagraph

    for gemm, (n, k, bias) in gemm_shapes(cfg).items():
        if gemm == "head":
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
        for m, glu in [
            (B, g) for B in batches if B <= _gemv.MAX_ROWS for g in ((True,) if gemm == "gate_up" else (False,))
        ]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n // 2 if glu else n, device="cuda", dtype=torch.bfloat16)
            full = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            unfused = (
                (lambda: _gemv.silu_mul(_gemv._cublas(x, w, b, out=full), out=y))
                if glu
                else (lambda: _gemv._cublas(x, w, b, out=y))
            )
            cands = _gemv.candidates(m, y.shape[1], k, glu)
            cfgs = list(dict.fromkeys(space(m, y.shape[1], k, glu) + cands))
            launch = lambda c, warm=False: _gemv._launch(c, x, w, b, y, glu, warm=warm)  # noqa: E731
            with ThreadPoolExecutor(16) as pool:
                ok = list(pool.map(lambda c: _compiles(launch, c), cfgs))
            cfgs = [c for c, good in zip(cfgs, ok) if good]
            screen = {c: do_bench_cudagraph(lambda c=c: launch(c), rep=2) for c in cfgs}
            top = sorted(cfgs, key=screen.get)[:8]
            best_cand = min((c for c in cands if c in screen), key=screen.get)
            full_us = {str(c): round(1e3 * do_bench_cudagraph(lambda c=c: launch(c), rep=20), 2)
                       for c in dict.fromkeys([*top, best_cand])}  # fmt: skip
            cublas = 1e3 * do_bench_cudagraph(unfused, rep=20)
            pct = lambda t: round(100 * 2 * n * k / (t * 1e-6) / bw, 1)  # noqa: E731
            best = min(full_us, key=full_us.get)
            emit({"part": "space", "model": name, "gemm": gemm + ("+silu_mul" if glu else ""), "M": m, "N": n, "K": k,
                  "configs": len(cfgs), "cublas_us": round(cublas, 2), "candidates_best": str(best_cand),
                  "candidates_best_us": full_us[str(best_cand)], "space_best": best, "space_best_us": full_us[best],
                  "space_best_pct_bw": pct(full_us[best]), "top": full_us})  # fmt: skip


def _compiles(launch, cfg) -> bool:
    try:
        launch(cfg, warm=True)
        return True
    except Exception:  # noqa: BLE001 (a config past the registers or shared memory: not in the space)
        return False


def part_steps(name, cfg, batches, ctx, rounds, backend) -> None:
    dtype = torch.bfloat16
    params = llama.init_params(cfg, dtype, "cuda", seed=0)
    ps = A.page_size_for(backend)
    cache = llama.init_cache(cfg, 1 + max(batches) * -(-ctx // ps), ps, dtype, "cuda")
    step = llama.make_step(cfg, backend=backend, max_seq_len=ctx)
    batches_ = {B: decode_batch(cfg.vocab_size, B, ctx, ps)[0] for B in batches}
    on = lambda b: pytree.tree_map(lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t, b)  # noqa: E731
    with torch.no_grad():
        eager = {B: step(params, cache, on(b), "decode")[0].float() for B, b in batches_.items()}
    jitted = {}
    for variant, flag in (("cublas", False), ("fgraph_linear", True)):
        fgraph.config.small_m_gemv = flag
        before, tuned0 = dict(compiler.counts), _gemv.counts["tuned"]
        t0 = time.perf_counter()
        f = jit_step(llama.make_step(cfg, backend=backend, max_seq_len=ctx), "FULL+C", sorted(batches))
        for B in batches:
            f.capture(params, cache, batches_[B], routine="decode", progress=False)
        emit({"part": "capture", "model": name, "variant": variant, "capture_s": round(time.perf_counter() - t0, 1),
              "rewritten": compiler.counts["linear"] - before["linear"], "keys_tuned": _gemv.counts["tuned"] - tuned0,
              "gemv_counts": dict(_gemv.counts)})  # fmt: skip
        jitted[variant] = f
    fgraph.config.small_m_gemv = True
    for B, b in batches_.items():
        errs = {}
        for variant, f in jitted.items():
            got = f(params, cache, b, routine="decode")[0].float()
            errs[variant] = round(((got - eager[B]).abs().max() / eager[B].abs().max()).item(), 4)
        times = {v: [] for v in jitted}
        for _ in range(rounds):  # alternating: cublas, fgraph_linear, cublas, ...
            for variant, f in jitted.items():
                times[variant].append(time_ms(lambda f=f: f(params, cache, b, routine="decode")))
        for variant, ts in times.items():
            emit({"part": "step", "model": name, "backend": backend, "B": B, "ctx": ctx, "variant": variant,
                  "ms_median": round(statistics.median(ts), 4), "ms_spread": round(max(ts) - min(ts), 4),
                  "rel_err_vs_eager": errs[variant], "device": device_name("cuda")})  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "llama3-8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backend", default="flash_attn")
    p.add_argument("--parts", nargs="+", default=["gemm", "step"])
    p.add_argument("--rep", type=int, default=20, help="ms of launches in each gemm timing's CUDA graph")
    a = p.parse_args()
    bw = copy_bandwidth()
    emit({"device": device_name("cuda"), "torch": torch.__version__, "copy_bw_gb_s": round(bw / 1e9)})
    gemms = []
    for name in a.presets:
        cfg = llama.preset(name)
        if "gemm" in a.parts:
            gemms += part_gemms(name, cfg, a.batches, bw, a.rep)
        if "space" in a.parts:
            part_space(name, cfg, a.batches, bw)
        if "step" in a.parts:
            part_steps(name, cfg, a.batches, a.ctx, a.rounds, a.backend)
            torch.cuda.empty_cache()  # (the step's graphs and cache went with it)
    if gemms:
        part_configs(gemms)


if __name__ == "__main__":
    main()
