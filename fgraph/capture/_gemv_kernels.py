"""fgraph::linear's Triton kernels (the design, grids and tuning: _gemv's docstring).

Importing this module imports Triton: _gemv.kernel() does, on first use.
"""

import triton
import triton.language as tl


@triton.jit
def silu_mul(g, u, TY: tl.constexpr):
    """silu(g) * u as eager torch rounds it in TY: silu's result rounded to TY, then the product (g, u: float32 of
    TY values, as the matmul's rounded output reads back)."""
    s = (g / (1.0 + tl.exp(-g))).to(TY).to(tl.float32)
    return (s * u).to(TY)


@triton.jit
def gemv(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, K_SPLIT, sx, sw, sy, HAS_BIAS: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
         SPLITS: tl.constexpr, GLU: tl.constexpr):  # fmt: skip
    """y [M, N] = x [M, K] @ w [N, K]^T (+ b). GLU: w is [2N, K], gate rows then up rows, and y = silu(x @ gate^T) *
    (x @ up^T), each product rounded to y's dtype first as the unfused matmul's output is (no bias, no split)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GLU: the up rows' product
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw
    u_rows = w_ptr + (rn + N).to(tl.int64)[:, None] * sw
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx
    k_lo = tl.program_id(1) * K_SPLIT  # this program's K range: [k_lo, k_hi); K_SPLIT a multiple of BLOCK_K
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        w_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
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
def glu(y_ptr, out_ptr, N, sy, so, BLOCK: tl.constexpr):
    """out [M, N] = silu(y[:, :N]) * y[:, N:], y [M, 2N]: the activation after a gate_up matmul cuBLAS ran (one
    launch, as Inductor's fused kernel for it). Grid (M, cdiv(N, BLOCK)): a row's block, contiguous loads."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < N
    g = tl.load(y_ptr + row * sy + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + row * sy + N + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + col, silu_mul(g, u, out_ptr.dtype.element_ty), mask=ok)
