"""What every benchmark here shares: CUDA-event timing, the copy-bandwidth ceiling, a decode batch."""
from __future__ import annotations

import statistics

import torch


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


def copy_bandwidth(device: str = "cuda") -> float:
  """Bytes per second of a device copy, counting what it reads and what it writes (the anchors' convention)."""
  a = torch.empty(2 << 30, dtype=torch.uint8, device=device)
  b = torch.empty_like(a)
  ms = gpu_ms(lambda: b.copy_(a), iters=10, reps=5, warm=2)
  del a, b
  return 2 * (2 << 30) / (ms / 1e3)


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
