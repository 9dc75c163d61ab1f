"""What every benchmark here shares: timing (CUDA events on the GPU, the wall clock on the CPU), the copy-bandwidth
ceiling, a decode batch, a time budget, and rows appended to a .jsonl as soon as they are measured."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time

import torch


@contextlib.contextmanager
def knobs(module, values: dict):
    """Set module constants for the duration (a variant's setup or timing), then restore them."""
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def cold_env() -> dict:
    """A cold process's environment, as a user starts one: empty Inductor and Triton caches of its own, and no
    TRITON_CACHE_DIR (Inductor sets it, to its own cache's triton/<device>, as it loads its first kernel; what fgraph
    compiles before that must find the same dir), so Triton's default dir is moved under a fresh TRITON_HOME."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    env["TRITON_HOME"] = tempfile.mkdtemp(prefix="triton-home-")
    return env


def rewrite_cpu_pieces() -> None:
    """From now on, compiled CPU pieces' SDPA calls rewritten (fgraph::sdpa_decode) as CUDA pieces' are (the rewrite
    is for CUDA pieces): on the CPU the op is eager's math, so a CPU run meets the rewritten pieces and their cut
    (fgraph.config.compile_parts)."""
    from fgraph.compile import _sdpa

    rewrite = _sdpa.rewrite
    _sdpa.rewrite = lambda gm, device_type="cuda": rewrite(gm, "cpu")


def sync(device="cuda") -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def gpu_ms(fn, iters: int = 30, reps: int = 5, warm: int = 3) -> float:
    """Median over `reps` of the mean ms per call over `iters` back-to-back calls (host cost included)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / iters)
    return statistics.median(times)


def time_ms(fn, device="cuda", rep_s: float = 0.04, reps: int = 5, warm: int = 2, max_iters: int = 200) -> float:
    """Like gpu_ms, with `iters` picked so that one rep takes ~rep_s (a 30 ms eager step and a 0.3 ms graph replay
    cost the same wall time to measure). CUDA events on the GPU, perf_counter on the CPU. Median over reps of the
    mean ms per call over back-to-back calls (host cost included: what a serving loop pays)."""
    for _ in range(warm):
        fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    iters = max(3, min(max_iters, int(rep_s / max(time.perf_counter() - t0, 1e-6))))
    cuda = str(device).startswith("cuda")
    times = []
    for _ in range(reps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / iters)
        else:
            times.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(times)


def copy_bandwidth(device: str = "cuda", nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device copy, counting what it reads and what it writes (the anchors' convention)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), device, rep_s=0.05)
    del a, b
    return 2 * nbytes / (ms / 1e3)


def decode_batch(vocab: int, B: int, ctx: int, page_size: int, max_ctx: int | None = None):
    """B sequences at position ctx/2, each with its own contiguous pages after the scratch page 0; block tables
    sized for max_ctx (so cells of several contexts share one signature family). Returns (batch, pages used)."""
    from examples import llama
    from fgraph.ops import attention as A

    L, per = ctx // 2 + 1, -(-ctx // page_size)
    tables = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(B)]
    meta = A.build_metadata([1] * B, [L] * B, tables, page_size, -(-(max_ctx or ctx) // page_size))
    tokens = torch.randint(0, vocab, (B,), generator=torch.Generator().manual_seed(B))
    return llama.Batch(tokens, torch.full((B,), L - 1, dtype=torch.int64), meta), 1 + B * per


class Budget:
    """Wall-clock budget of one benchmark part: optional work is skipped (and says so) rather than cut by the
    device's timeout, so the part always ends with its table, JSON and plot."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def why_not(self, need_s: float) -> str | None:
        """None if `need_s` more seconds fit, else the reason to print."""
        if need_s <= self.left():
            return None
        return f"time budget: needs ~{need_s:.0f} s, {max(self.left(), 0):.0f} s of {self.seconds:.0f} s left"


def emit(path: str, row: dict) -> None:
    """Print a result and append it to `path` (.jsonl) at once: a part cut short by its time limit keeps its rows."""
    print(json.dumps(row, default=str), flush=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if str(device).startswith("cuda") else f"cpu ({os.cpu_count()} cores)"


def jit_step(step, mode: str, buckets, inductor=None):
    """fgraph.jit of a decode step (llama's, or a TP rank's) the way the benchmarks run it: mode "FULL+C" is FULL
    with Inductor-compiled pieces (`inductor`: Inductor's options, or its defaults), "DEFAULT" jit's defaults; the KV cache donated and
    declared scratch (padded rows write only its page 0), outputs zero-copy (read before the next call)."""
    import fgraph
    from examples import llama
    from fgraph.ops import attention as A

    spec = llama.Batch(fgraph.Batched(pad=0), fgraph.Batched(pad=0), A.metadata_batching())
    # "DEFAULT": fgraph.jit's own mode and compile choice (on CUDA: FULL decode graphs of compiled pieces)
    chosen = (
        {}
        if mode == "DEFAULT"
        else {"mode": mode.split("+")[0], "compile": dict(inductor or {}) if mode.endswith("+C") else False}
    )
    return fgraph.jit(
        step,
        static=["routine"],
        donate=["cache"],
        scratch=["cache"],
        batch={"batch": spec},
        buckets=buckets,
        copy_outputs=False,
        **chosen,
    )
