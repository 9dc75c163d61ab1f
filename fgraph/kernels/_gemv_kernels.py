"""fgraph::linear's Triton kernels (the design, grids and tuning: _gemv's docstring).

Importing this module imports Triton: _rowwise.kernel() does, on first use.
"""

import triton
import triton.language as tl

from ._pdl import after_prior


@triton.jit
def silu_mul(g, u, TY: tl.constexpr):
    """silu(g) * u as eager torch rounds it in TY: silu's result rounded to TY, then the product (g, u: float32 of
    TY values, as the matmul's rounded output reads back)."""
    s = (g / (1.0 + tl.exp(-g))).to(TY).to(tl.float32)
    return (s * u).to(TY)


@triton.jit
def summed(x_rows, r_rows, kk, ok, HAS_RES: tl.constexpr):
    """x's tile [rows, cols] (+ r's, the sum rounded to x's dtype as eager's add is)."""
    x = tl.load(x_rows + kk[None, :], mask=ok, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def normed(s, nw_ptr, kk, k_ok, rstd):
    """RMSNorm of the tile s [rows, cols] given its rows' 1 / rms, rounded as eager's rms_norm: the normalised value
    to s's dtype, then its product with the weight."""
    n = (s.to(tl.float32) * rstd[:, None]).to(s.dtype)
    nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0)
    return (nw[None, :].to(tl.float32) * n.to(tl.float32)).to(s.dtype)


@triton.jit
def gemv(x_ptr, w_ptr, u_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, r_ptr, nw_ptr, s_ptr, eps, M, N, K, K_SPLIT, SPLITS, sx,
         sw, su, sy, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         DOT: tl.constexpr, SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr,
         HAS_RES: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """y [M, N] = x [M, K] @ w [N, K]^T (+ b). GLU: w holds the gate rows and u the up rows ([N, K] each, rows of
    stride sw and su: two weights, or the halves of one), and y = silu(x @ w^T) * (x @ u^T), each product rounded to
    y's dtype first as the unfused matmul's output is (no bias, no split).
    NORM: the matmul reads rms_norm(s) * nw for s = x (+ r with HAS_RES; program 0 stores s [M, K], rows of stride
    sx too), each program first summing the squares of s's whole rows (no split).
    SPLIT: K split over SPLITS <= MAX_SPLITS programs per column block (grid axis 1), each over K_SPLIT of it. SPLITS
    is an argument, not a constexpr, so that one compilation serves every split count a tuner tries (a cold start
    compiles them); the merge is unrolled to MAX_SPLITS loads, those past SPLITS masked off, so that they are all in
    flight at once (a loop to SPLITS loads them one after another: slower, docs/performance.md)."""
    after_prior(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GLU: the up rows' product
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw
    u_rows = u_ptr + rn.to(tl.int64)[:, None] * su
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx
    r_rows = r_ptr + rm.to(tl.int64)[:, None] * sx
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)  # NORM: 1 / rms of each row of s
    if NORM:
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            ok = m_ok[:, None] & (kk < K)[None, :]
            s = summed(x_rows, r_rows, kk, ok, HAS_RES)
            squares += tl.sum(s.to(tl.float32) * s.to(tl.float32), axis=1)
            if HAS_RES:
                first = rm[:, None] * 0 + tl.program_id(0) == 0  # a tensor: masks take no scalar bool (interpreter)
                tl.store(s_ptr + rm.to(tl.int64)[:, None] * sx + kk[None, :], s, mask=ok & first)
        rstd = tl.rsqrt(squares / K + eps)
    k_lo = tl.program_id(1) * K_SPLIT  # this program's K range: [k_lo, k_hi); K_SPLIT a multiple of BLOCK_K
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        w_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0)  # [BLOCK_N, BLOCK_K]
        x = summed(x_rows, r_rows, kk, m_ok[:, None] & k_ok[None, :], HAS_RES)  # [BLOCK_M, BLOCK_K]
        if NORM:
            x = normed(x, nw_ptr, kk, k_ok, rstd)
        if DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        if GLU:
            u = tl.load(u_rows + kk[None, :], mask=w_ok, other=0.0)
            if DOT:
                up += tl.dot(x, tl.trans(u))
            else:
                up += tl.sum(x[:, None, :].to(tl.float32) * u[None, :, :].to(tl.float32), axis=2)
    ok = m_ok[:, None] & n_ok[None, :]
    out = y_ptr + rm.to(tl.int64)[:, None] * sy + rn[None, :]
    ty = y_ptr.dtype.element_ty
    if SPLIT:  # ws [SPLITS, M, N] float32; the last program of this column block to arrive sums them
        part = rm[:, None] * N + rn[None, :]
        tl.store(ws_ptr + tl.program_id(1) * M * N + part, acc, mask=ok, cache_modifier=".wt")
        tl.debug_barrier()  # every thread's partial stored before the count (acq_rel) publishes it
        arrived = tl.atomic_add(lock_ptr + tl.program_id(0), 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(MAX_SPLITS):  # in split order: the same sum whichever program is last
                live = ok & (part * 0 + s < SPLITS)  # a tensor, as above
                acc += tl.load(ws_ptr + s * M * N + part, mask=live, other=0.0, cache_modifier=".cv")
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(ty), mask=ok)
            tl.atomic_xchg(lock_ptr + tl.program_id(0), 0)  # ready for the next launch
    elif GLU:
        g, u = acc.to(ty).to(tl.float32), up.to(ty).to(tl.float32)
        tl.store(out, silu_mul(g, u, ty), mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(ty), mask=ok)


@triton.jit
def glu(g_ptr, u_ptr, out_ptr, N, sg, su, so, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out [M, N] = silu(g) * u, g and u [M, N] (rows of stride sg and su: the two halves of a gate_up matmul's
    output, or two matmuls' outputs): the activation after cuBLAS ran the matmul (one launch, as Inductor's fused
    kernel for it). Grid (M, cdiv(N, BLOCK)): a row's block, contiguous loads."""
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < N
    g = tl.load(g_ptr + row * sg + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + col, silu_mul(g, u, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def add_rms_norm(x_ptr, r_ptr, nw_ptr, s_ptr, h_ptr, K, sx, sh, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    """h = rms_norm(s) * nw for s = x (+ r, stored to s), one row per program (BLOCK >= K): what runs before
    cuBLAS where fgraph::norm_linear's kernel does not (one launch, as Inductor's fused kernel for it)."""
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK)
    ok = kk < K
    s = summed(x_ptr + row * sx, r_ptr + row * sx, kk, ok[None, :], HAS_RES)  # [1, BLOCK]
    if HAS_RES:
        tl.store(s_ptr + row * sx + kk[None, :], s, mask=ok[None, :])
    rstd = tl.rsqrt(tl.sum(s.to(tl.float32) * s.to(tl.float32), axis=1) / K + eps)
    tl.store(h_ptr + row * sh + kk[None, :], normed(s, nw_ptr, kk, ok, rstd), mask=ok[None, :])


@triton.jit(do_not_specialize=["N0", "N1", "N2", "sw0", "sw1", "sw2"])  # (the branches yield one type)
def gemv_group(x_ptr, w0, w1, w2, b0, b1, b2, y0, y1, y2, M, N0, N1, N2, K, sx, sw0, sw1, sw2,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """y_i [M, N_i] = x [M, K] @ w_i [N_i, K]^T (+ b_i) for up to three weights over the same rows (q, k and v
    projections), one launch: the grid runs over each weight's column blocks in turn, and a program picks its weight
    by its block. Each y_i contiguous; an absent third weight has N2 = 0. No split of K."""
    after_prior(PDL)
    pid = tl.program_id(0)
    nb0 = tl.cdiv(N0, BLOCK_N)
    nb1 = tl.cdiv(N1, BLOCK_N)
    if pid < nb0:
        w_ptr, b_ptr, y_ptr, N, sw, blk = w0, b0, y0, N0, sw0, pid
    elif pid < nb0 + nb1:
        w_ptr, b_ptr, y_ptr, N, sw, blk = w1, b1, y1, N1, sw1, pid - nb0
    else:
        w_ptr, b_ptr, y_ptr, N, sw, blk = w2, b2, y2, N2, sw2, pid - nb0 - nb1
    rn = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
