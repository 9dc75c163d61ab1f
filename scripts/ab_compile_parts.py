"""A Hugging Face decode piece compiled whole or in parts (fgraph.config.compile_parts): the first generate's seconds,
Inductor's seconds and compilations, and the tokens against eager's; each setting in a fresh process and Inductor
cache, alternating.

  python3 scripts/ab_compile_parts.py [--layers 24] [--rounds 1]

A Qwen2 of tiny widths (hidden 64) and --layers layers, the README's recipe with compiled pieces. On CUDA its own
pieces; elsewhere the pieces rewritten as CUDA's are (sdpa_decode as eager's math), compiled by Inductor's CPU
backend, whose C++ builds are a larger share than on the GPU: the CPU shows the count of compilations and the
direction, the GPU the seconds (`ROUNDS=2 bash scripts/startup_ab.sh compile_parts=True`: the 0.5B shape, cold)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def one(parts: bool, layers: int) -> dict:
    import torch

    import fgraph
    from benchmarks.common import rewrite_cpu_pieces
    from examples import hf_generate as G
    from fgraph.compile import compiler

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        rewrite_cpu_pieces()
    fgraph.config.compile_parts = parts
    base, model = G.tiny("qwen2", device, layers=layers), G.tiny("qwen2", device, layers=layers)
    for m in (base, model):
        m.set_attn_implementation("sdpa")
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0)).to(device)
    want = G.generate(base, ids, 5)
    G.jit_forward(model, compile=True)
    t0 = time.perf_counter()
    got = G.generate(model, ids, 5)
    first = time.perf_counter() - t0
    c = compiler.counts
    return {
        "compile_parts": parts, "layers": layers, "device": device, "first_generate_s": round(first, 2),
        "inductor_s": round(c["seconds"], 2), "compiled": c["compiled"], "shared": c["shared"], "sdpa": c["sdpa"],
        "repeats": c["repeats"], "tokens_equal_eager": bool(torch.equal(got, want)),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--child", choices=["on", "off"])
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (the repo's packages)
    from benchmarks.common import cold_env

    if a.child:
        print(json.dumps(one(a.child == "on", a.layers)), flush=True)
        return
    for _ in range(a.rounds):
        for setting in ("off", "on"):
            cmd = [sys.executable, __file__, "--child", setting, "--layers", str(a.layers)]
            out = subprocess.run(cmd, env=cold_env(), capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if lines else json.dumps({"setting": setting, "rc": out.returncode}), flush=True)


if __name__ == "__main__":
    main()
