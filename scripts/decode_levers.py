"""Decode levers, one kernel at a time (a diagnostic, not the benchmark): what each candidate change to the decode
step's kernels would save, measured alone on the device before it is built into the step.

Every case captures REPEAT calls of one op (one per layer, as in a decode graph) into one CUDA graph and reports µs
per call over replays (median of 7 rounds of 20 replays), so launch gaps inside a graph are counted as a step
pays them. Shapes: Qwen2.5-0.5B (14 q heads, 2 kv heads, D 64, hidden 896, ffn 4864) and Llama-3-8B (32 / 8 /
128, hidden 4096, ffn 14336), decode batches 1 and 64, sequences at 512 keys (the benchmark's "ctx 1k" cell,
`benchmarks.common.decode_batch`) and 4096 keys.

  splits   FA2 decode (flash_attn_with_kvcache, paged, page 256) at each split count and at the one fgraph
           chooses: the split kernel plus its combine kernel against one kernel without splits.
  fisplit  FlashInfer's tensor-core decode (both models' GQA groups take it) with and without split-KV
           (plan(disable_split_kv=True)).
  kvwrite  the KV write of FlashInfer and FA2's mixed step: two index_copy_ (one per cache) against one Triton
           kernel for both (fgraph.ops._kv_write).
  blas     the step's GEMMs at B 1 and 64 (x @ W.T, W [out, in] bf16): µs, % of copy bandwidth, kernels per call
           (a split-K GEMM adds a reduction kernel), with torch's defaults and with reduced-precision reductions
           disallowed (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False).

usage (device, repo root, .gpu carried): source .gpu/activate.sh; python3 scripts/decode_levers.py [part ...]
Writes $OUT/levers.txt when OUT is set.
"""

from __future__ import annotations

import io
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from benchmarks.common import gpu_ms  # noqa: E402
from benchmarks.kernels import kernel_table  # noqa: E402
from fgraph.ops import _attn_torch as T  # noqa: E402
from fgraph.ops import attention as A  # noqa: E402

DEV, DT, REPEAT = "cuda", torch.bfloat16, 32
LOG = io.StringIO()
MODELS = {"0.5B": dict(hq=14, hkv=2, d=64, h=896, ffn=4864), "8B": dict(hq=32, hkv=8, d=128, h=4096, ffn=14336)}
BW = 4.27e12  # copy bandwidth measured on the H200 (benchmarks.common.copy_bandwidth), bytes/s


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")


def per_call_us(fn, repeat: int = REPEAT) -> float:
    """µs per call of fn, captured `repeat` times into one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(repeat):
            fn()
    return gpu_ms(g.replay, iters=20, reps=7) * 1e3 / repeat


def kernels_per_call(fn) -> float:
    return kernel_table(fn, steps=10)["kernels_per_step"]


def paged(m, B, keys, page):
    """q/k/v of one decode token per sequence, caches with each sequence on its own pages after page 0, and the
    block table / lengths / slots of that layout."""
    per = -(-keys // page)
    kc = torch.randn(1 + B * per, page, m["hkv"], m["d"], device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    tables = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(B)]
    meta = A.build_metadata([1] * B, [keys] * B, tables, page, per).to(DEV)
    bt, lens, slots = meta.block_table, meta.seq_lens, meta.slot_mapping
    q = torch.randn(B, m["hq"], m["d"], device=DEV, dtype=DT)
    k = torch.randn(B, m["hkv"], m["d"], device=DEV, dtype=DT)
    v = torch.randn_like(k)
    return q, k, v, kc, vc, bt, lens, slots


def splits(_):
    from fgraph.ops import _attn_flash as F

    chosen_fn = F.decode_num_splits
    for name, m in MODELS.items():
        for B in (1, 64):
            for keys in (512, 4096):
                q, k, v, kc, vc, bt, lens, slots = paged(m, B, keys, 256)
                out = torch.empty_like(q)
                L = bt.shape[1] * 256
                chosen = chosen_fn(
                    B,
                    m["hkv"],
                    m["hq"] // m["hkv"],
                    m["d"],
                    L,
                    torch.cuda.get_device_properties(0).multi_processor_count,
                )
                row = []
                for s in sorted({1, 2, 4, 8, 16, chosen}):
                    F.decode_num_splits = lambda *a, s=s: s
                    try:
                        call = lambda: F.forward(
                            out, q, k, v, kc, vc, None, lens, bt, slots, routine="decode", scale=0.1, max_seq_len=L
                        )
                        row.append(f"{s}{'*' if s == chosen else ''}: {per_call_us(call):6.1f}")
                    finally:
                        F.decode_num_splits = chosen_fn
                say(
                    f"FA2 decode {name:4s} B={B:3d} keys={keys:5d} (block table {L}) us/call by splits: "
                    + ", ".join(row)
                )


def fisplit(_):
    import flashinfer

    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    for name, m in MODELS.items():
        for B in (1, 64):
            for keys in (512, 4096):
                q, k, v, kc, vc, bt, lens, slots = paged(m, B, keys, 16)
                per = bt.shape[1]
                indptr = torch.arange(B + 1, dtype=torch.int32) * per
                indices = bt.flatten().cpu()
                last = torch.full((B,), (keys - 1) % 16 + 1, dtype=torch.int32)
                out = torch.empty_like(q)
                row, ref0 = [], None
                for disable in (False, True):
                    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                        ws,
                        "NHD",
                        use_cuda_graph=True,
                        use_tensor_cores=True,
                        paged_kv_indptr_buffer=torch.empty(B + 1, dtype=torch.int32, device=DEV),
                        paged_kv_indices_buffer=torch.empty(B * per, dtype=torch.int32, device=DEV),
                        paged_kv_last_page_len_buffer=torch.empty(B, dtype=torch.int32, device=DEV),
                    )
                    w.plan(
                        indptr,
                        indices,
                        last,
                        m["hq"],
                        m["hkv"],
                        m["d"],
                        16,
                        q_data_type=DT,
                        kv_data_type=DT,
                        disable_split_kv=disable,
                    )
                    ref = w.run(q, (kc, vc))
                    try:
                        row.append(
                            f"{'no split' if disable else 'split'} {per_call_us(lambda: w.run(q, (kc, vc), out=out)):6.1f}"
                        )
                    except Exception as e:  # a failure is a result: say so
                        row.append(f"{'no split' if disable else 'split'} failed: {type(e).__name__} {str(e)[:80]}")
                    if disable:
                        row.append(f"max |diff| {(w.run(q, (kc, vc)) - ref0).abs().max().item():.1e}")
                    ref0 = ref
                say(f"FlashInfer tc decode {name:4s} B={B:3d} keys={keys:5d} us/call: " + ", ".join(row))


def kvwrite(_):
    from fgraph.ops import _kv_write as W

    for name, m in MODELS.items():
        for B in (1, 64, 256):
            q, k, v, kc, vc, bt, lens, slots = paged(m, B, 512, 16)
            kc2, vc2 = kc.clone(), vc.clone()
            T.write_kv(k, v, kc, vc, slots)
            W.write_kv(k, v, kc2, vc2, slots)
            same = torch.equal(kc, kc2) and torch.equal(vc, vc2)
            a = per_call_us(lambda: T.write_kv(k, v, kc, vc, slots))
            b = per_call_us(lambda: W.write_kv(k, v, kc2, vc2, slots))
            say(
                f"KV write {name:4s} B={B:3d}: 2 x index_copy_ {a:5.1f} us, one Triton kernel {b:5.1f} us; caches equal: {same}"
            )


def blas(_):
    mm = torch.backends.cuda.matmul
    for name, m in MODELS.items():
        h, qkv = m["h"], (m["hq"] + 2 * m["hkv"]) * m["d"]
        for label, (n, kdim) in {
            "qkv": (qkv, h),
            "o": (h, m["hq"] * m["d"]),
            "gate_up": (2 * m["ffn"], h),
            "down": (h, m["ffn"]),
        }.items():
            W = torch.randn(n, kdim, device=DEV, dtype=DT)
            for B in (1, 64):
                x = torch.randn(B, kdim, device=DEV, dtype=DT)
                row = []
                for reduced in (True, False):
                    mm.allow_bf16_reduced_precision_reduction = reduced
                    call = lambda: x @ W.T
                    us = per_call_us(call)
                    row.append(
                        f"{'default' if reduced else 'no reduced-precision reduction'} {us:6.1f} us "
                        f"({W.numel() * 2 / (us * 1e-6) / BW * 100:3.0f} % bw, {kernels_per_call(call):.0f} kernels)"
                    )
                mm.allow_bf16_reduced_precision_reduction = True
                say(f"GEMM {name:4s} {label:7s} [{B}, {kdim}] x [{kdim}, {n}]: " + "; ".join(row))


def main():
    parts = sys.argv[1:] or ["splits", "fisplit", "kvwrite", "blas"]
    say(
        torch.cuda.get_device_name(), torch.__version__, "commit", os.popen("git rev-parse --short HEAD").read().strip()
    )
    for p in parts:
        say(f"==== {p}")
        try:
            globals()[p](None)
        except Exception:
            import traceback

            say(traceback.format_exc())
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "levers.txt"), "w") as fh:
                fh.write(LOG.getvalue())


if __name__ == "__main__":
    main()
