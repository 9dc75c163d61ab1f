"""`fgraph::linear`: y [M, N] = x [M, K] @ w [N, K]^T (+ b [N]), for compiled pieces to call at decode sizes; at M <= 16
rows one Triton kernel with no split-K where that is faster than cuBLAS.

Not a break primitive: a graph piece keeps it inside. Compiling a piece for CUDA rewrites its matmuls of a small
weight's transpose into this op (`_small_m`) when `fgraph.config.small_m_gemv` is on. Anywhere the kernel does not
serve (CPU, float32, more rows, a config that lost to cuBLAS) it is torch.mm / torch.addmm, the ops it replaced,
bit for bit.

At decode, M is the batch: cuBLAS then picks tiles meant for large M and, for long K, a split-K with a second
reduction kernel, and runs the small projections of a 0.5B model at 9-31 % of copy bandwidth. Here each program
owns BLOCK_N output columns for all M rows: it streams its [BLOCK_N, K] slab of w once (the bytes that matter),
accumulates in float32 and adds the bias in the same kernel: up to 4 rows multiply-and-reduce in registers, or (any
row count up to 16) use tl.dot with the rows padded to 16.

A few wide columns over a long K (0.5B's down: N 896, K 4864) leave most SMs idle at one program per BLOCK_N
columns, so a config may split K over SPLITS programs per column block, still in one kernel: each stores its
float32 partial [M, BLOCK_N] to a workspace, then counts itself in at the block's counter (an atomic, after a
barrier: the stream-K pattern); the last to arrive sums the partials in split order (deterministic whatever the
arrival order), adds the bias, stores y and puts the counter back to 0 for the next launch or replay. The counters
are per key (rows, N, K, ...) and persist: kernels of one key must not run concurrently on two streams.

Which kernel serves a shape is measured, not guessed: the first call of a (rows, N, K, dtype, bias) key outside a
CUDA-graph capture times each candidate config and cuBLAS itself, replayed in a CUDA graph (kernel time with its
launch gaps, as in a decode graph), and keeps the fastest where it beats cuBLAS by a margin (MARGIN); elsewhere
cuBLAS stays. A key met first inside a capture (no timing possible there) runs cuBLAS, counted as `untuned`.
"""

from __future__ import annotations

import contextlib
import functools

import torch

MAX_ROWS = 16
# (BLOCK_N, BLOCK_K, num_warps, num_stages, DOT), each also tried with K split in SPLITS (candidates). The reduce
# path (rows <= 4) keeps BLOCK_M x BLOCK_N x BLOCK_K
# <= 16K elements in registers; the dot path pads the rows to 16 and lets Triton pipeline w's tiles (cp.async), which
# keeps more bytes in flight: the large matrices need it
_REDUCE = [(4, 512, 4, 3, False), (8, 512, 4, 3, False), (16, 256, 4, 3, False), (16, 512, 8, 3, False)]
_DOT = [(16, 128, 4, 3, True), (16, 256, 4, 4, True), (32, 128, 4, 3, True), (32, 256, 4, 3, True),
        (64, 128, 4, 3, True), (16, 512, 8, 3, True)]  # fmt: skip
# a config replaces cuBLAS only when it is this much faster alone: cuBLAS's kernels start while the kernel before
# them drains, so a kernel's time alone overstates what replacing cuBLAS saves inside a decode graph
# (docs/performance.md: 5-10 % faster alone measured as 1 % slower in the step)
MARGIN = 0.85

# tuned: keys timed; triton / cublas: tuned keys each serves (split: the triton ones with K split); untuned: keys
# met first inside a capture (cuBLAS)
counts = {"tuned": 0, "triton": 0, "split": 0, "cublas": 0, "untuned": 0}
_choice: dict[tuple, tuple | None] = {}  # key -> a config or None (cuBLAS)


@functools.cache
def kernel():
    """The Triton kernel; None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gemv(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, sx, sw, sy, HAS_BIAS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
             SPLITS: tl.constexpr):  # fmt: skip
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok, m_ok = rn < N, rm < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx
        k_lo = tl.program_id(1) * K_SPLIT  # this program's K range: [k_lo, k_hi); K_SPLIT a multiple of BLOCK_K
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < k_hi
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            if DOT:
                acc += tl.dot(x, tl.trans(w))
            else:
                acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        ok = m_ok[:, None] & n_ok[None, :]
        if SPLITS > 1:  # ws [SPLITS, M, N] float32; the last program of this column block to arrive sums them
            part = rm[:, None] * N + rn[None, :]
            tl.store(ws_ptr + tl.program_id(1) * M * N + part, acc, mask=ok, cache_modifier=".wt")
            tl.debug_barrier()  # every thread's partial stored before the count (acq_rel) publishes it
            arrived = tl.atomic_add(lock_ptr + tl.program_id(0), 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLITS):  # in split order: the same sum whichever program is last
                    acc += tl.load(ws_ptr + s * M * N + part, mask=ok, other=0.0, cache_modifier=".cv")
                if HAS_BIAS:
                    acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                out = y_ptr + rm.to(tl.int64)[:, None] * sy + rn[None, :]
                tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(lock_ptr + tl.program_id(0), 0)  # ready for the next launch
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            out = y_ptr + rm.to(tl.int64)[:, None] * sy + rn[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)

    return gemv


def eligible(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the kernel can serve these tensors (else cuBLAS runs): CUDA, half precision, rows contiguous."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == x.dtype
        and w.dim() == 2
        and w.shape[1] == x.shape[1]
        and x.stride(1) == 1
        and w.stride(1) == 1
        and (b is None or (b.dtype == x.dtype and b.shape == (w.shape[0],) and b.is_contiguous()))
        and kernel() is not None
    )


def _pow2(m: int) -> int:
    """The reduce path's BLOCK_M for m rows: the power of two at or above m."""
    return 1 << (m - 1).bit_length()


def _launch(cfg: tuple, x, w, b, y) -> None:
    block_n, block_k, warps, stages, dot, splits = cfg
    (M, K), N = x.shape, w.shape[0]
    block_m = 16 if dot else _pow2(M)
    k_split = -(-K // (splits * block_k)) * block_k  # each split's K range, whole blocks
    grid = (-(-N // block_n), splits)
    ws, locks = (_workspace(x, N, splits), _locks(x, cfg, N)) if splits > 1 else (y, y)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        kernel()[grid](x, w, b if b is not None else w, y, ws, locks, M, N, K, k_split, x.stride(0), w.stride(0),
                       y.stride(0), HAS_BIAS=b is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       DOT=dot, SPLITS=splits, num_warps=warps, num_stages=stages)  # fmt: skip


def _workspace(x, n: int, splits: int) -> torch.Tensor:
    # the partials [splits, M, N] float32: per call (inside a capture, from the graph's pool)
    return torch.empty(splits, x.shape[0], n, dtype=torch.float32, device=x.device)


_lock_bufs: dict[tuple, torch.Tensor] = {}


def _locks(x, cfg: tuple, n: int) -> torch.Tensor:
    """The arrival counters of one (rows, N, K, dtype, device, config): one per column block, zero between launches
    (the last program of a block resets its own), alive for the process (a captured graph holds their address)."""
    key = (x.shape[0], n, x.shape[1], x.dtype, x.device, cfg)
    got = _lock_bufs.get(key)
    if got is None:
        # (made by the config's first launch, which the tuner runs outside any capture: a buffer made inside one
        # would belong to that graph's pool)
        assert not (x.is_cuda and torch.cuda.is_current_stream_capturing()), "split-K counters made inside a capture"
        got = _lock_bufs[key] = torch.zeros(-(-n // cfg[0]), dtype=torch.int32, device=x.device)
    return got


def _cublas(x, w, b, out=None):
    return torch.mm(x, w.t(), out=out) if b is None else torch.addmm(b, x, w.t(), out=out)


SPLITS = (2, 4, 8)
MAX_BLOCKS = 1024  # column blocks x splits per launch beyond which splitting K adds no parallelism worth timing


def candidates(m: int, n: int, k: int) -> list[tuple]:
    """The configs worth timing for m rows of an [n, k] weight: each base config unsplit, and split in SPLITS where
    every split keeps at least two BLOCK_K blocks of K and the launch stays under MAX_BLOCKS programs."""
    got = _DOT + ([c for c in _REDUCE if _pow2(m) * c[0] * c[1] <= 16384] if m <= 4 else [])
    got = [c for c in got if c[0] <= max(16, n) and c[1] <= max(128, 2 * k)]
    split = [(*c, s) for c in got for s in SPLITS if k >= 2 * s * c[1] and -(-n // c[0]) * s <= MAX_BLOCKS]
    return [(*c, 1) for c in got] + split


def _tune(x, w, b) -> tuple | None:
    """Time every candidate and cuBLAS on these tensors (each replayed in a CUDA graph); the fastest config if it
    beats cuBLAS by MARGIN, else None (cuBLAS)."""
    from triton.testing import do_bench_cudagraph

    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    cublas_ms = do_bench_cudagraph(lambda: _cublas(x, w, b, out=y), rep=10)
    best, best_ms = None, MARGIN * cublas_ms
    for cfg in candidates(x.shape[0], w.shape[0], w.shape[1]):
        ms = do_bench_cudagraph(lambda cfg=cfg: _launch(cfg, x, w, b, y), rep=10)
        if ms < best_ms:
            best, best_ms = cfg, ms
    counts["tuned"] += 1
    counts["triton" if best is not None else "cublas"] += 1
    counts["split"] += best is not None and best[-1] > 1
    return best


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ b): the tuned kernel where eligible, else cuBLAS (torch.mm / addmm)."""
    if not eligible(x, w, b):
        return _cublas(x, w, b)
    key = (x.shape[0], w.shape[0], w.shape[1], x.dtype, b is not None, x.device.index)
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():  # no timing inside a capture: cuBLAS, as without the kernel
            counts["untuned"] += 1
            return _cublas(x, w, b)
        with torch.cuda.device(x.device):  # (the timing's graphs and streams on the tensors' device)
            _choice[key] = _tune(x, w, b)
    cfg = _choice[key]
    if cfg is None:
        return _cublas(x, w, b)
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    _launch(cfg, x, w, b, y)
    return y


@torch.library.custom_op("fgraph::linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return linear(x, w, b)


@_linear_op.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0])


op = torch.ops.fgraph.linear.default
