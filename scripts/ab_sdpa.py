"""A Hugging Face decode step's attention: how fgraph's trace of an HF forward calls SDPA, and what each way of
computing that attention costs on this GPU.

  python3 scripts/ab_sdpa.py [--batches 1 8] [--ctx 1088] [--graph]

Part `graph` (--graph): jit a 0.5B-shaped Qwen2 (benchmarks.hf_bench.make_model) as the README's recipe does, run a
static-cache generate at B=1, and print the attention nodes of the piece Inductor compiles (their targets, the
shapes and strides of their inputs, and the nodes making k and v): what a rewrite would match.

Part `time` (always): one layer's decode attention at the 0.5B's shapes (14 query heads, 2 KV heads, head dim 64,
bf16, a boolean mask over a static cache of --ctx positions, half of them visible), each variant replayed in a CUDA
graph (triton.testing.do_bench_cudagraph), µs per call, and its largest difference from the math reference:
- repeat_kv: transformers' compile path (keys and values repeated to every query head), SDPA's own pick;
- packed: a single query token's heads as rows of its KV head (transformers' eager path at decode, `pack_gqa`),
  SDPA's own pick and each backend forced;
- fgraph: fgraph::sdpa_decode's kernel (what compiled pieces run in its place, fgraph.config.sdpa_decode).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fgraph.kernels import _sdpa


def emit(row: dict) -> None:
    print(json.dumps(row, default=str), flush=True)


def graph_part() -> None:
    from benchmarks import hf_bench
    from examples import hf_generate
    from fgraph.compile import _inductor

    seen = []
    real = _inductor._small_m.rewrite

    def spy(gm, **kw):
        seen.append(gm)
        return real(gm, **kw)

    _inductor._small_m.rewrite = spy
    try:
        m = hf_bench.make_model(False, "cuda", torch.bfloat16, 2)
        hf_generate.jit_forward(m, "FULL_AND_PIECEWISE", buckets=[1, 8])
        ids = torch.randint(0, m.config.vocab_size, (1, 32), device="cuda")
        with torch.no_grad():
            m.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static",
                       disable_compile=True)  # fmt: skip
    finally:
        _inductor._small_m.rewrite = real
    for gm in seen[:1]:
        for n in gm.graph.nodes:
            if n.op == "call_function" and "scaled_dot_product" in str(n.target):
                emit({"part": "graph", "node": str(n.target), "args": [_describe(a) for a in n.args],
                      "kwargs": {k: _describe(v) for k, v in n.kwargs.items()}})  # fmt: skip
                for a in n.args[:4]:
                    for src in _chain(a, 6):
                        emit({"part": "graph", "feeds": str(n.target), "producer": src})
                break


def _describe(a):
    if isinstance(a, torch.fx.Node):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return {"node": a.name, "target": str(a.target), "shape": list(v.shape), "stride": list(v.stride()),
                    "dtype": str(v.dtype)}  # fmt: skip
        return {"node": a.name, "target": str(a.target)}
    return repr(a)


def _chain(a, depth):
    out = []
    while isinstance(a, torch.fx.Node) and depth and a.op == "call_function":
        out.append(_describe(a) | {"args": [x if not isinstance(x, torch.fx.Node) else x.name for x in a.args]})
        a = a.args[0] if a.args else None
        depth -= 1
    return out


def time_part(batches, ctx: int) -> None:
    import triton.testing

    Hq, Hkv, D, dt = 14, 2, 64, torch.bfloat16
    G = Hq // Hkv
    for B in batches:
        g = torch.Generator(device="cuda").manual_seed(B)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dt, generator=g)
        k = torch.randn(B, Hkv, ctx, D, device="cuda", dtype=dt, generator=g)
        v = torch.randn(B, Hkv, ctx, D, device="cuda", dtype=dt, generator=g)
        mask = torch.zeros(B, 1, 1, ctx, dtype=torch.bool, device="cuda")
        mask[..., : ctx // 2] = True
        scale = D**-0.5

        def repeat_kv(x):
            return x[:, :, None].expand(B, Hkv, G, ctx, D).reshape(B, Hq, ctx, D)

        ref = F.scaled_dot_product_attention(q.float(), repeat_kv(k).float(), repeat_kv(v).float(), mask, scale=scale)
        bias = torch.where(mask, 0.0, float("-inf")).to(dt)  # (the trace's additive mask)
        variants = {
            "fgraph": lambda: _sdpa.sdpa_decode(q, k, v, bias, scale),
            "repeat_kv": lambda: F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), mask, scale=scale),
            "packed": lambda: F.scaled_dot_product_attention(q.view(B, Hkv, G, D), k, v, mask, scale=scale),
        }
        backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "math": SDPBackend.MATH}  # fmt: skip
        for name, be in backends.items():
            variants[f"packed_{name}"] = lambda be=be: _forced(be, q.view(B, Hkv, G, D), k, v, mask, scale)
            variants[f"repeat_kv_{name}"] = lambda be=be: _forced(be, q, repeat_kv(k), repeat_kv(v), mask, scale)
        for name, fn in variants.items():
            try:
                out = fn().reshape(B, Hq, 1, D)
                us = triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                emit({"part": "time", "B": B, "ctx": ctx, "variant": name, "us": round(us, 2), "rel_err": err})
            except Exception as e:  # noqa: BLE001 (a backend that refuses these inputs: say so)
                emit({"part": "time", "B": B, "variant": name, "error": f"{type(e).__name__}: {str(e)[:120]}"})


def _forced(backend, q, k, v, mask, scale):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, mask, scale=scale)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, default=1088)
    ap.add_argument("--graph", action="store_true")
    a = ap.parse_args()
    import transformers

    emit({"torch": torch.__version__, "transformers": transformers.__version__, "device": torch.cuda.get_device_name()})
    if a.graph:
        graph_part()
    time_part(a.batches, a.ctx)


if __name__ == "__main__":
    main()
