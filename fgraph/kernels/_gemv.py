"""`fgraph::linear`: y [M, N] = x [M, K] @ w [N, K]^T (+ b [N]), for compiled pieces to call at decode sizes; at M <= 16
rows one Triton kernel with no split-K where that is faster than cuBLAS.

Not a break primitive: compiling a piece for CUDA rewrites its few-row matmuls into it (`_small_m`, with
`fgraph.config.small_m_gemv`). Where the kernel does not serve (CPU, float32, more rows, a config that lost to
cuBLAS) it is torch.mm / torch.addmm, the ops it replaced, bit for bit.

At decode, M is the batch: cuBLAS then picks tiles meant for large M and, for long K, a split-K with a second
reduction kernel, and runs the small projections of a 0.5B model far below copy bandwidth. Here each program
owns BLOCK_N output columns for all M rows: it streams its [BLOCK_N, K] slab of w once (the bytes that matter),
accumulates in float32 and adds the bias in the same kernel: up to 4 rows multiply-and-reduce in registers, or (any
row count up to 16) use tl.dot with the rows padded to 16.

A few wide columns over a long K (0.5B's down: N 896, K 4864) leave most SMs idle at one program per BLOCK_N
columns, so a config may split K over SPLITS programs per column block, still in one kernel: each stores its
float32 partial [M, BLOCK_N] to a workspace, then counts itself in at the block's counter (an atomic, after a
barrier: the stream-K pattern); the last to arrive sums the partials in split order (deterministic whatever the
arrival order), adds the bias, stores y and puts the counter back to 0 for the next launch or replay. The counters
are per key (rows, N, K, ...) and persist: kernels of one key must not run concurrently on two streams.

Which kernel serves a shape is measured: a (rows, N, K, dtype, bias) key's first call outside a capture times each
candidate config and cuBLAS in a CUDA graph (launch gaps included) and keeps the fastest where it beats cuBLAS by
MARGIN. A key met first inside a capture runs cuBLAS (`untuned`).

`fgraph::linear_glu`: silu(y[:, :N]) * y[:, N:] for y = x @ w^T, w [2N, K] a gated MLP's fused gate and up rows;
or silu(x @ w^T) * (x @ u^T) for two weights [N, K] (an HF MLP's gate_proj and up_proj). The same kernel, each
program streaming its gate slab and its up slab ([BLOCK_N, K] each) and applying the activation before its store,
so the step runs one kernel where it ran the matmul (or two) and the activation's. Without the kernel (CPU, more
rows, a config that lost) it is cuBLAS's matmul (or two) and then the activation in one launch (`silu_mul`), as
Inductor fuses it; on the CPU torch's ops, bit for bit. Its tuner times the kernel against those launches.

`fgraph::linears`: 2-3 matmuls over the same rows (an HF attention's separate q, k and v projections) in one launch
of the same kernel's loop (`gemv_group`): its grid runs over each weight's column blocks in turn. Its tuner times it
against each matmul as fgraph::linear serves it alone; where it loses, or cannot serve, each is served so.

`fgraph::norm_linear`: the matmul (or linear_glu) of h = nw * rms_norm(s), s = x + r (or x), also returning s. The
same kernel, each program first summing the squares of its rows of s (it reads all of x in its K loop anyway), then
normalising each x tile as it loads it; program 0 stores s. Without the kernel: one launch adds and normalises
(`add_rms_norm`), then fgraph::linear or linear_glu as they serve h alone; on the CPU torch's ops, bit for bit.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .._config import pdl_args
from . import _tuned, _workers
from ._rowwise import _pow2, add_rms_norm, kernel, normable, silu_mul
from ._workers import runner as _runner

MAX_ROWS = 16
# (BLOCK_N, BLOCK_K, num_warps, num_stages, DOT), each also tried with K split in SPLITS (candidates). The reduce
# path (rows <= 4) keeps BLOCK_M x BLOCK_N x BLOCK_K <= 16K elements in registers; the dot path pads the rows to 16
# and lets Triton pipeline w's tiles (cp.async), which keeps more bytes in flight: the large matrices need it. The
# reduce path's one-warp configs fit ~4x the programs on an SM as four warps do, so more of w's rows are in flight
_REDUCE = [(2, 1024, 1, 1, False), (4, 1024, 1, 1, False), (4, 512, 4, 3, False), (8, 512, 4, 3, False)]
_DOT = [(16, 128, 4, 3, True), (16, 256, 4, 4, True), (32, 128, 4, 3, True), (32, 256, 4, 3, True),
        (64, 128, 4, 3, True), (16, 512, 8, 3, True)]  # fmt: skip
# a config replaces cuBLAS only when it is this much faster alone: cuBLAS's kernels start while the kernel before
# them drains, so a kernel's time alone overstates what replacing cuBLAS saves inside a decode graph
# (docs/performance.md: configs faster alone were slower in the step)
MARGIN = 0.85
# the fused gate_up + activation against cuBLAS and the activation's launch: the launch it saves is saved in the step
GLU_MARGIN = 0.95
# a timing: 10 replays of a CUDA graph of this many ms of launches (do_bench_cudagraph); the ranking holds at a few.
# Every candidate is first screened at SCREEN_MS; the FINALISTS fastest (within SCREEN_KEEP of the fastest) are timed
# again at REP_MS, and only that timing picks and is compared with cuBLAS's
REP_MS, SCREEN_MS, SCREEN_KEEP, FINALISTS = 3, 1, 1.15, 3

# tuned: keys timed (glu / norm / group: of them, those with the activation / the norm / of weights grouped);
# triton / cublas: tuned keys each serves (split: the triton ones with K split); untuned: keys met first inside a
# capture (cuBLAS); loaded: keys whose choice an earlier process made (_tuned), timed by none here; compiled:
# distinct kernels compiled for timing (`builds`; Triton's own cache may hold them: then they are loaded, not built);
# unfit: of those, kernels too large for this GPU (never timed)
counts = dict.fromkeys("tuned glu norm group triton split cublas untuned loaded compiled unfit".split(), 0)
seconds = {"tune": 0.0, "compile": 0.0}  # wall time in the tuner, and of it compiling candidates (start-up's share)
_choice: dict[tuple, tuple | None] = {}  # key -> a config or None (cuBLAS)
_tuning: list[tuple] = []  # the keys being tuned now, outermost first


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


def _launch(cfg: tuple, x, w, b, y, glu: bool = False, norm: tuple | None = None, u=None, warm=False) -> None:
    """One launch of `cfg` into y; glu: the gate rows in w and the up rows in u, or (u None) both halves in w; norm:
    (r or None, nw, eps, s) for fgraph::norm_linear (x, r and s contiguous). warm: compile it only (no launch);
    "ahead": start its compile in a worker, for fake tensors (`_workers.runner`)."""
    block_n, block_k, warps, stages, dot, splits = cfg
    if glu:
        w, u = halves(w, u)
    (M, K), N = x.shape, w.shape[0]
    block_m = 16 if dot else _pow2(M)
    k_split = -(-K // (splits * block_k)) * block_k  # each split's K range, whole blocks
    grid = (-(-N // block_n), splits)
    ws, locks = (_workspace(x, N, splits), _locks(x, cfg, N, keep=warm != "ahead")) if splits > 1 else (y, y)
    r, nw, eps, s = norm if norm is not None else (None, x, 0.0, x)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        u = w if u is None else u
        _runner(kernel().gemv, grid, warm)(x, w, u, b if b is not None else w, y, ws, locks, r if r is not None else x,
                                           nw, s, eps, M, N, K, k_split, splits, x.stride(0), w.stride(0),
                                           u.stride(0), y.stride(0), HAS_BIAS=b is not None, BLOCK_M=block_m,
                                           BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, SPLIT=splits > 1,
                                           MAX_SPLITS=MAX_SPLITS, GLU=glu,
                                           NORM=norm is not None,
                                           HAS_RES=r is not None, num_warps=warps, num_stages=stages,
                                           **pdl_args(x))  # fmt: skip


def halves(w: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) [N, K] each: w and u as they are (two weights), or w's two halves (u None: w [2N, K])."""
    if u is not None:
        return w, u
    n = w.shape[0] // 2
    return w[:n], w[n:]


def _workspace(x, n: int, splits: int) -> torch.Tensor:
    # the partials [splits, M, N] float32: per call (inside a capture, from the graph's pool)
    return torch.empty(splits, x.shape[0], n, dtype=torch.float32, device=x.device)


_lock_bufs: dict[tuple, torch.Tensor] = {}


def _locks(x, cfg: tuple, n: int, keep: bool = True) -> torch.Tensor:
    """The arrival counters of one (rows, N, K, dtype, device, config): one per column block, zero between launches
    (the last program of a block resets its own), alive for the process (a captured graph holds their address).
    keep False: a fake tensor's (`ahead`), like them and kept by none."""
    if not keep:
        return torch.empty(-(-n // cfg[0]), dtype=torch.int32, device=x.device)
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
MAX_SPLITS = max(SPLITS)  # the kernel's merge is unrolled to this many partials
MAX_BLOCKS = 1024  # column blocks x splits per launch beyond which splitting K adds no parallelism worth timing


def reduce_fits(m: int, block_n: int, block_k: int, glu: bool = False) -> bool:
    """Whether the reduce path serves m rows with these blocks: m <= 4, and BLOCK_M x BLOCK_N x BLOCK_K within its
    register budget (halved with glu: a program holds two products)."""
    return m <= 4 and _pow2(m) * block_n * block_k <= (8192 if glu else 16384)


def candidates(m: int, n: int, k: int, glu: bool = False, norm: bool = False) -> list[tuple]:
    """The configs worth timing for m rows of an [n, k] weight: each base config unsplit, and split in SPLITS where
    every split keeps at least two BLOCK_K blocks of K and the launch stays under MAX_BLOCKS programs. glu: n output
    columns of a [2n, k] weight; a program holds two products, so the reduce path's register budget is halved. glu
    and norm (each program reads whole rows first) do not split K."""
    got = _DOT + [c for c in _REDUCE if reduce_fits(m, c[0], c[1], glu)]
    got = [c for c in got if c[0] <= max(16, n) and c[1] <= max(128, 2 * k)]
    split = [(*c, s) for c in got for s in SPLITS if k >= 2 * s * c[1] and -(-n // c[0]) * s <= MAX_BLOCKS]
    return [(*c, 1) for c in got] + ([] if glu or norm else split)


def _unfused(x, w, b, glu: bool, norm: tuple | None, u=None):
    """(y, s): what runs where the kernel does not. With norm ((r or None, nw, eps); s = x + r, or x): the norm's
    launch, then whatever serves the matmul of the normalised rows alone (fgraph::linear or linear_glu, its own
    tuned choice: a kernel that lost with the norm inside it may still win without). Else cuBLAS, then the
    activation's launch (glu)."""
    if norm is not None:
        s, h = add_rms_norm(x, *norm)
        return (linear_glu(h, w, u) if glu else linear(h, w, b)), s
    if glu and u is not None:  # two weights: two matmuls, then the activation's launch
        return silu_mul(_cublas(x, w, None), _cublas(x, u, None)), None
    y = _cublas(x, w, b)
    return (silu_mul(y) if glu else y), None


def _cols(w, glu: bool, u) -> int:
    """The output columns of x @ w^T: w's rows, or with glu and one weight its halves'."""
    return w.shape[0] // 2 if glu and u is None else w.shape[0]


def _plan(x, w, b, glu: bool = False, norm: tuple | None = None, u=None) -> tuple[list, object]:
    """(cfgs, launch(cfg, warm=False)): the candidates the tuner times for these tensors and their launch (into an
    output made here). The tuner's and `ahead`'s alike: what ahead compiles is what the tuner will ask for."""
    y = torch.empty(x.shape[0], _cols(w, glu, u), dtype=x.dtype, device=x.device)
    fused = None if norm is None else (*norm, torch.empty_like(x))
    cfgs = candidates(x.shape[0], y.shape[1], w.shape[1], glu, norm is not None)
    return cfgs, lambda cfg, warm=False: _launch(cfg, x, w, b, y, glu, fused, u, warm)


def _tune(x, w, b, glu: bool = False, norm: tuple | None = None, u=None) -> tuple | None:
    """Time every candidate and what runs without the kernel (`_unfused`: cuBLAS and the launches beside it), each
    replayed in a CUDA graph; the fastest config if it beats that by its margin, else None."""
    from triton.testing import do_bench_cudagraph

    y = torch.empty(x.shape[0], _cols(w, glu, u), dtype=x.dtype, device=x.device)
    if norm is not None:  # the matmul alone tuned first: timed inside a capture, its first call could not tune
        _pick(add_rms_norm(x, *norm)[1], w, b, glu)
    if glu or norm is not None:
        unfused_ms = do_bench_cudagraph(lambda: _unfused(x, w, b, glu, norm, u), rep=REP_MS)
    else:
        unfused_ms = do_bench_cudagraph(lambda: _cublas(x, w, b, out=y), rep=REP_MS)
    best = _fastest(*_plan(x, w, b, glu, norm, u), (GLU_MARGIN if glu or norm is not None else MARGIN) * unfused_ms)
    counts["tuned"] += 1
    counts["glu"] += glu
    counts["norm"] += norm is not None
    counts["triton" if best is not None else "cublas"] += 1
    counts["split"] += best is not None and best[-1] > 1
    return best


def _kernel_of(cfg: tuple) -> tuple:
    """What a config's compiled kernel is: its base config, and whether it splits K (the count is an argument)."""
    return (*cfg[:-1], cfg[-1] > 1)


def builds(cfgs: list) -> list:
    """The configs of cfgs that each need a compilation of their own: one per base config, unsplit and split (the
    split count is a kernel argument, not a constant: K split 2, 4 or 8 ways runs one kernel)."""
    first: dict[tuple, tuple] = {}
    for c in cfgs:
        first.setdefault(_kernel_of(c), c)
    return list(first.values())


def _fastest(cfgs: list, launch, limit_ms: float) -> tuple | None:
    """The config whose launch, replayed in a CUDA graph, times fastest under limit_ms; None if none does.

    launch(cfg, warm=True) compiles and loads cfg's kernel without running it: every kernel is made first, side by
    side (`_workers.make`: one after another, a cold start spent most of its time in them), and those too large for
    this GPU are left out. Then each config is screened in a short timing and the finalists timed in full."""
    from triton.testing import do_bench_cudagraph

    t0 = time.perf_counter()
    todo = builds(cfgs)
    unfit = {_kernel_of(c) for c in _workers.make(todo, launch)}
    counts["compiled"] += len(todo)
    counts["unfit"] += len(unfit)
    seconds["compile"] += time.perf_counter() - t0
    cfgs = [c for c in cfgs if _kernel_of(c) not in unfit]
    if not cfgs:
        return None
    screened = {cfg: do_bench_cudagraph(lambda cfg=cfg: launch(cfg), rep=SCREEN_MS) for cfg in cfgs}
    best, best_ms, fastest = None, limit_ms, min(screened.values())
    for cfg in sorted((c for c in cfgs if screened[c] <= SCREEN_KEEP * fastest), key=screened.get)[:FINALISTS]:
        ms = do_bench_cudagraph(lambda cfg=cfg: launch(cfg), rep=REP_MS)
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best


def _chosen(key: tuple, device, tune, ready=None) -> tuple | None:
    """The config tuned for key: read from an earlier process's choices (`_tuned`) or tuned now (`tune()`) on its
    first call; None (cuBLAS) for a key first met inside a capture, where nothing can be timed. ready(cfg): what a
    config needs made outside any capture before it serves (a loaded one was never launched here)."""
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():
            counts["untuned"] += 1
            return None
        found, cfg = _tuned.load(key, device.index)
        if found:
            counts["loaded"] += 1
            if ready is not None and cfg is not None:
                ready(cfg)
        else:
            with torch.cuda.device(device):  # (the timing's graphs and streams on the tensors' device)
                t0, outer = time.perf_counter(), not _tuning
                _tuning.append(key)
                try:
                    cfg = tune()
                finally:
                    _tuning.pop()
                if outer:  # (a group's or a norm's tuner tunes its matmuls' keys inside its own: counted once)
                    seconds["tune"] += time.perf_counter() - t0
                # timings run on side streams; cuBLAS keeps a 32 MiB workspace per stream (~1 GiB cold): freed, as at
                # every capture's start, and given back (memory's own empty_cache: capture_session stubs torch.cuda's)
                getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()  # (a CPU build of torch has none)
                torch.cuda.memory.empty_cache()
            _tuned.store(key, device.index, cfg)
        _choice[key] = cfg
    return _choice[key]


def _key(x, w, b, glu: bool = False, norm: tuple | None = None, u=None) -> tuple | None:
    """The tuner's key for these tensors; None where the kernel cannot serve them."""
    if not eligible(x, w, b) or not normable(x, norm):
        return None
    if glu and (b is not None or (w.shape[0] % 2 if u is None else not _pair(w, u))):
        return None
    normed = 0 if norm is None else 1 + (norm[0] is not None)
    # (two weights: another key, whose tuner times two matmuls and the activation where one weight times one)
    kind = glu if u is None else "pair"
    return (x.shape[0], w.shape[0], w.shape[1], x.dtype, b is not None, kind, normed, x.device.index)


def ahead(x, w, b, glu: bool = False, norm: tuple | None = None, u=None) -> None:
    """Start compiling, in the compile workers, the candidates `_pick` will compile for tensors like these (a trace's
    fake tensors, inside their fake mode) at its first call: those of a key neither tuned here nor by an earlier
    process. Called as a piece is compiled: the workers compile while Inductor does."""
    key = _key(x, w, b, glu, norm, u)
    if key is None or key in _choice:
        return
    if norm is not None:  # (its tuner tunes the matmul of the normalised rows first)
        ahead(torch.empty_like(x), w, b, glu)
    _ahead(key, *_plan(x, w, b, glu, norm, u))


def _ahead(key: tuple, cfgs: list, launch) -> None:
    if not _tuned.load(key, key[-1])[0]:
        for cfg in builds(cfgs):
            launch(cfg, warm="ahead")


def _pick(x, w, b, glu: bool = False, norm: tuple | None = None, u=None) -> tuple | None:
    """The tuned config serving these tensors, tuning their key on its first call; None: cuBLAS serves. glu with u:
    w the gate and u the up weight."""
    key = _key(x, w, b, glu, norm, u)
    if key is None:
        return None
    ready = (lambda cfg: _locks(x, cfg, w.shape[0]) if cfg[-1] > 1 else None) if not glu and norm is None else None
    return _chosen(key, x.device, lambda: _tune(x, w, b, glu, norm, u), ready)


GROUP = 3  # weights over the same rows fgraph::linears takes in one launch


def _grouped(x, ws: list, bs: list) -> bool:
    """Whether one launch of gemv_group can serve these matmuls: 2-3 eligible weights, all with a bias or none."""
    return (
        2 <= len(ws) <= GROUP
        and all(eligible(x, w, b) and w.is_contiguous() for w, b in zip(ws, bs))
        and len({b is None for b in bs}) == 1
    )


def _launch_group(cfg: tuple, x, ws: list, bs: list, ys: list, warm=False) -> None:
    block_n, block_k, warps, stages, dot, _ = cfg
    # GROUP of each: the last weight repeated with no columns (N 0) where there are fewer
    n = [w.shape[0] for w in ws] + [0] * (GROUP - len(ws))
    w3, b3, y3 = ([*t, *t[-1:] * (GROUP - len(t))] for t in (ws, bs, ys))
    b3 = [b if b is not None else w for b, w in zip(b3, w3)]
    grid = (sum(-(-k // block_n) for k in n),)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        _runner(kernel().gemv_group, grid, warm)(x, *w3, *b3, *y3, x.shape[0], *n, x.shape[1], x.stride(0),
                                                 *(w.stride(0) for w in w3), HAS_BIAS=bs[0] is not None,
                                                 BLOCK_M=16 if dot else _pow2(x.shape[0]), BLOCK_N=block_n,
                                                 BLOCK_K=block_k, DOT=dot, num_warps=warps, num_stages=stages,
                                                 **pdl_args(x))  # fmt: skip


def _pick_group(x, ws: list, bs: list) -> tuple | None:
    """The tuned config of gemv_group serving these matmuls, tuning their key on its first call; None: each matmul
    runs as fgraph::linear serves it alone."""
    key = _group_key(x, ws, bs)
    return None if key is None else _chosen(key, x.device, lambda: _tune_group(x, ws, bs))


def _group_key(x, ws: list, bs: list) -> tuple | None:
    if not _grouped(x, ws, bs):
        return None
    return (x.shape[0], tuple(w.shape[0] for w in ws), x.shape[1], x.dtype, bs[0] is not None, "group", x.device.index)


def _plan_group(x, ws: list, bs: list) -> tuple[list, object]:
    """(cfgs, launch(cfg, warm=False)) of gemv_group for these matmuls: as `_plan`."""
    ys = [torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) for w in ws]
    unsplit = [c for c in candidates(x.shape[0], max(w.shape[0] for w in ws), x.shape[1]) if c[-1] == 1]
    return unsplit, lambda cfg, warm=False: _launch_group(cfg, x, ws, bs, ys, warm)


def ahead_group(x, ws: list, bs: list) -> None:
    """`ahead` for fgraph::linears: each matmul alone, then gemv_group's candidates (as `_tune_group` meets them)."""
    for w, b in zip(ws, bs):
        ahead(x, w, b)
    key = _group_key(x, ws, bs)
    if key is not None and key not in _choice:
        _ahead(key, *_plan_group(x, ws, bs))


def _tune_group(x, ws: list, bs: list) -> tuple | None:
    """Time gemv_group's configs against each matmul as fgraph::linear serves it alone (their keys tuned first),
    replayed in CUDA graphs; the fastest config if it beats them by GLU_MARGIN (the launches it saves are saved in
    the step too)."""
    from triton.testing import do_bench_cudagraph

    for w, b in zip(ws, bs):
        _pick(x, w, b)
    alone_ms = do_bench_cudagraph(lambda: [linear(x, w, b) for w, b in zip(ws, bs)], rep=REP_MS)
    best = _fastest(*_plan_group(x, ws, bs), GLU_MARGIN * alone_ms)
    counts["tuned"] += 1
    counts["group"] += 1
    counts["triton" if best is not None else "cublas"] += 1
    return best


def linears(x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """[x @ w^T (+ b) for each weight]: 2-3 matmuls over the same rows (an HF attention's q, k and v projections) in
    one launch, where that times faster than each as fgraph::linear serves it; else each so served."""
    cfg = _pick_group(x, ws, bs)
    if cfg is None:
        return [linear(x, w, b) for w, b in zip(ws, bs)]
    ys = [torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) for w in ws]
    _launch_group(cfg, x, ws, bs, ys)
    return ys


def _pair(w: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether u can be read as w's up rows: the same shape and dtype, rows contiguous."""
    return u.shape == w.shape and u.dtype == w.dtype and u.device == w.device and u.stride(1) == 1


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ b): the tuned kernel where eligible, else cuBLAS (torch.mm / addmm)."""
    cfg = _pick(x, w, b)
    if cfg is None:
        return _cublas(x, w, b)
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    _launch(cfg, x, w, b, y)
    return y


def linear_glu(x: torch.Tensor, w: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """silu(y[:, :N]) * y[:, N:] for y = x [M, K] @ w [2N, K]^T (gate rows, then up rows), or, given u, silu(x @ w^T)
    * (x @ u^T) for a gate w and an up u [N, K] each (an HF MLP's gate_proj and up_proj): at few rows one kernel,
    where it times faster; else cuBLAS's matmul (or two), then `silu_mul`."""
    cfg = _pick(x, w, None, glu=True, u=u)
    if cfg is None:
        return _unfused(x, w, None, True, None, u)[0]
    y = torch.empty(x.shape[0], w.shape[0] // 2 if u is None else w.shape[0], dtype=x.dtype, device=x.device)
    _launch(cfg, x, w, None, y, glu=True, u=u)
    return y


def norm_linear(x, r, nw, eps: float, w, b, glu: bool):
    """(y, s) for s = x + r (r None: s is empty, x is the sum) and h = nw * rms_norm(s): y = h @ w^T (+ b), or with
    glu silu·mul of its halves. At few rows one kernel that normalises as it reads, where it times faster; else the
    norm's launch, then fgraph::linear or linear_glu as they serve the normalised rows (`_unfused`)."""
    norm = (r, nw, eps)
    cfg = _pick(x, w, b, glu, norm)
    if cfg is None:
        y, s = _unfused(x, w, b, glu, norm)
    else:
        y = torch.empty(x.shape[0], w.shape[0] // 2 if glu else w.shape[0], dtype=x.dtype, device=x.device)
        s = torch.empty_like(x) if r is not None else x
        _launch(cfg, x, w, b, y, glu, (*norm, s))
    return y, (s if r is not None else x.new_empty(0))  # (an op's output may not be its input)
