"""Start-up: the seconds a user waits before generating, each way, every one a fresh process.

  python3 -m benchmarks.startup_bench [--preset qwen2.5-0.5b] [--backend flash_attn] [--out DIR or FILE.jsonl]

Rows (one JSON line each):
  fgraph            `python -m examples.generate --preset P --num-prompts 8 --max-new-tokens 64 --no-compile`
  fgraph+C cold     the same with compiled pieces (the default on CUDA), on empty Inductor and Triton caches
  fgraph+C warm     again, a second process on the caches the cold run left
  torch.compile     torch.compile(step, mode="reduce-overhead", fullgraph=True) of the same step, one decode shape
    cold / warm     (B=1), on empty Inductor and Triton caches, then again on the caches it left: the seconds to
                    its third call (the recorded graph replayed)
Each row: wall seconds of the whole process (generating included), and for fgraph the capture line it printed:
the CLI captures each signature on its first use (2 for these prompts), and says how many graphs, signatures and
traces when it is done; with --capture-all (every bucket up front, as a server) capture() says it per routine
(graphs, signatures, pool, and what Inductor did: pieces compiled, loaded from its cache, shared). The CLI's rows
also record its phases (`phases`: imports, model, engine, first token, done, each in seconds since its start).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from .common import cold_env, emit

GENERATE = ["-m", "examples.generate", "--num-prompts", "8", "--max-new-tokens", "64", "--no-progress"]


def child_torch_compile(preset: str, backend: str) -> None:
    """The peer: torch.compile of the same pure step at one decode shape, timed from this process's start."""
    import torch
    import torch.utils._pytree as pytree

    from examples import engine, llama

    cfg = llama.preset(preset)
    params = llama.init_params(cfg, torch.bfloat16, "cuda", seed=0)
    eng = engine.build(cfg, params, backend=backend, mode="eager", max_seqs=8, max_seq_len=256)
    step = torch.compile(eng.step_fn, mode="reduce-overhead", fullgraph=True)
    batch = pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, eng.example_batch())
    for _ in range(3):  # cudagraph trees: warm-up, record, replay
        torch.compiler.cudagraph_mark_step_begin()
        logits, _ = step(params, eng.cache, batch, "decode")
    torch.cuda.synchronize()
    print(f"ready {logits.shape}")


def run(cmd: list[str], env: dict) -> tuple[float, str, int]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, r.stdout + r.stderr, r.returncode


def capture_line(text: str) -> str | None:
    """The capture lines fgraph printed (the engine captures its routines in one call each), joined."""
    found = re.findall(r"fgraph: captured .*", text)
    return " | ".join(found) if found else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--backend", default="flash_attn")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="a folder, or a .jsonl file")
    p.add_argument("--child", choices=["torch_compile"])
    a = p.parse_args()
    if not a.out.endswith(".jsonl"):  # a folder, as the other benchmarks' --out
        a.out = os.path.join(a.out, "startup.jsonl")
    if a.child:
        child_torch_compile(a.preset, a.backend)
        return
    gen = [*GENERATE, "--preset", a.preset, "--backend", a.backend]
    # a cold row has empty Inductor and Triton caches of its own (a shared Triton cache would hand the later rows the
    # kernels an earlier row compiled: torch.compile's pieces share fgraph's Triton source); warm reuses cold's
    shared, peer = cold_env(), cold_env()
    child = ["-m", "benchmarks.startup_bench", "--child", "torch_compile", "--preset", a.preset, "--backend", a.backend]
    runs = [
        ("fgraph", [*gen, "--no-compile"], cold_env()),
        ("fgraph+C cold", [*gen, "--compile"], shared),
        ("fgraph+C warm", [*gen, "--compile"], shared),
        ("torch.compile cold", child, peer),
        ("torch.compile warm", child, peer),
    ]  # fmt: skip
    for name, cmd, env in runs:
        secs, text, rc = run(cmd, env)
        row = {"bench": "startup", "row": name, "preset": a.preset, "backend": a.backend, "seconds": round(secs, 1)}
        row.update({"rc": rc, "capture": capture_line(text)} if rc == 0 else {"rc": rc, "error": text[-1500:]})
        phases = re.findall(r"start-up, since the process started: (.*)", text)  # (the CLI's rows: where it went)
        if phases:
            row["phases"] = phases[-1]
        row["command"] = "python " + " ".join(cmd)
        emit(a.out, row)


if __name__ == "__main__":
    main()
