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

`fgraph::linear_glu`: silu(y[:, :N]) * y[:, N:] for y = x @ w^T, w [2N, K] a gated MLP's fused gate and up rows.
The same kernel, each program streaming its gate slab and its up slab ([BLOCK_N, K] each) and applying the
activation before its store, so the step runs one kernel where it ran the matmul and the activation's. Without the
kernel (CPU, more rows, a config that lost) it is cuBLAS's matmul and then the activation in one launch (`silu_mul`),
as Inductor fuses it; on the CPU torch's ops, bit for bit. Its tuner times the kernel against those two launches.
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
# the fused gate_up + activation against cuBLAS and the activation's own launch: the launch it saves is saved in the
# decode graph too (docs/performance.md: what it measures)
GLU_MARGIN = 0.95

# tuned: keys timed (glu: of them, fgraph::linear_glu's); triton / cublas: tuned keys each serves (split: the triton
# ones with K split); untuned: keys met first inside a capture (cuBLAS)
counts = {"tuned": 0, "glu": 0, "triton": 0, "split": 0, "cublas": 0, "untuned": 0}
_choice: dict[tuple, tuple | None] = {}  # key -> a config or None (cuBLAS)


@functools.cache
def kernel():
    """The Triton kernels (`_gemv_kernels`: gemv, glu); None without Triton."""
    try:
        from . import _gemv_kernels
    except ImportError:
        return None
    return _gemv_kernels


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


def _launch(cfg: tuple, x, w, b, y, glu: bool = False) -> None:
    block_n, block_k, warps, stages, dot, splits = cfg
    (M, K), N = x.shape, w.shape[0] // 2 if glu else w.shape[0]
    block_m = 16 if dot else _pow2(M)
    k_split = -(-K // (splits * block_k)) * block_k  # each split's K range, whole blocks
    grid = (-(-N // block_n), splits)
    ws, locks = (_workspace(x, N, splits), _locks(x, cfg, N)) if splits > 1 else (y, y)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        kernel().gemv[grid](x, w, b if b is not None else w, y, ws, locks, M, N, K, k_split, x.stride(0), w.stride(0),
                            y.stride(0), HAS_BIAS=b is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            DOT=dot, SPLITS=splits, GLU=glu, num_warps=warps, num_stages=stages)  # fmt: skip


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


def candidates(m: int, n: int, k: int, glu: bool = False) -> list[tuple]:
    """The configs worth timing for m rows of an [n, k] weight: each base config unsplit, and split in SPLITS where
    every split keeps at least two BLOCK_K blocks of K and the launch stays under MAX_BLOCKS programs. glu: n output
    columns of a [2n, k] weight; a program holds two products, so the reduce path's register budget is halved and K
    is not split."""
    budget = 8192 if glu else 16384
    got = _DOT + ([c for c in _REDUCE if _pow2(m) * c[0] * c[1] <= budget] if m <= 4 else [])
    got = [c for c in got if c[0] <= max(16, n) and c[1] <= max(128, 2 * k)]
    split = [(*c, s) for c in got for s in SPLITS if k >= 2 * s * c[1] and -(-n // c[0]) * s <= MAX_BLOCKS]
    return [(*c, 1) for c in got] + ([] if glu else split)


def _tune(x, w, b, glu: bool = False) -> tuple | None:
    """Time every candidate and what runs without the kernel (cuBLAS; glu: cuBLAS, then the activation's launch),
    each replayed in a CUDA graph; the fastest config if it beats that by its margin, else None."""
    from triton.testing import do_bench_cudagraph

    n = w.shape[0] // 2 if glu else w.shape[0]
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if glu:
        full = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        unfused_ms = do_bench_cudagraph(lambda: silu_mul(_cublas(x, w, None, out=full), out=y), rep=10)
    else:
        unfused_ms = do_bench_cudagraph(lambda: _cublas(x, w, b, out=y), rep=10)
    best, best_ms = None, (GLU_MARGIN if glu else MARGIN) * unfused_ms
    for cfg in candidates(x.shape[0], n, w.shape[1], glu):
        ms = do_bench_cudagraph(lambda cfg=cfg: _launch(cfg, x, w, b, y, glu), rep=10)
        if ms < best_ms:
            best, best_ms = cfg, ms
    counts["tuned"] += 1
    counts["glu"] += glu
    counts["triton" if best is not None else "cublas"] += 1
    counts["split"] += best is not None and best[-1] > 1
    return best


def _pick(x, w, b, glu: bool = False) -> tuple | None:
    """The tuned config serving these tensors, tuning their key on its first call; None: cuBLAS serves."""
    if not eligible(x, w, b) or (glu and (w.shape[0] % 2 or b is not None)):
        return None
    key = (x.shape[0], w.shape[0], w.shape[1], x.dtype, b is not None, glu, x.device.index)
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():  # no timing inside a capture: cuBLAS, as without the kernel
            counts["untuned"] += 1
            return None
        with torch.cuda.device(x.device):  # (the timing's graphs and streams on the tensors' device)
            _choice[key] = _tune(x, w, b, glu)
    return _choice[key]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ b): the tuned kernel where eligible, else cuBLAS (torch.mm / addmm)."""
    cfg = _pick(x, w, b)
    if cfg is None:
        return _cublas(x, w, b)
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    _launch(cfg, x, w, b, y)
    return y


def silu_mul(y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(y[:, :N]) * y[:, N:] for y [M, 2N]: one Triton launch on CUDA in half precision, else torch's ops (bit
    for bit the unfused ones)."""
    m, n = y.shape[0], y.shape[1] // 2
    if not (y.is_cuda and y.dtype in (torch.bfloat16, torch.float16) and y.stride(1) == 1 and kernel() is not None):
        gate, up = y.split(n, dim=-1)
        return torch.mul(torch.nn.functional.silu(gate), up, out=out)
    out = torch.empty(m, n, dtype=y.dtype, device=y.device) if out is None else out
    if m * n:
        _launch_glu(y, out)
    return out


def _launch_glu(y, out, block: int = 1024) -> None:
    m, n = out.shape
    with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        kernel().glu[(m, -(-n // block))](y, out, n, y.stride(0), out.stride(0), BLOCK=block)


def linear_glu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(y[:, :N]) * y[:, N:] for y = x [M, K] @ w [2N, K]^T (gate rows, then up rows): at few rows one kernel,
    where it times faster; else cuBLAS's matmul, then `silu_mul`."""
    cfg = _pick(x, w, None, glu=True)
    if cfg is None:
        return silu_mul(_cublas(x, w, None))
    y = torch.empty(x.shape[0], w.shape[0] // 2, dtype=x.dtype, device=x.device)
    _launch(cfg, x, w, None, y, glu=True)
    return y


@torch.library.custom_op("fgraph::linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return linear(x, w, b)


@_linear_op.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("fgraph::linear_glu", mutates_args=())
def _linear_glu_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return linear_glu(x, w)


@_linear_glu_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0] // 2)


op = torch.ops.fgraph.linear.default
glu_op = torch.ops.fgraph.linear_glu.default
