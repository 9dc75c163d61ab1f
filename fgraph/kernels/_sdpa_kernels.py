"""`fgraph::sdpa_decode`'s Triton kernels (the design and grids: _sdpa's docstring). Importing this module imports
Triton: _sdpa.kernels() does, on first use."""

import triton
import triton.language as tl

from ._pdl import after_prior


@triton.jit
def _dot(a, b, F32: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in float32: float32 operands multiplied in IEEE float32 (not TF32), as eager's math is; UPCAST: Triton's
    interpreter, whose dot cannot take half-precision operands."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if F32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def decode(q_ptr, k_ptr, v_ptr, bias_ptr, o_ptr, part_ptr, lse_ptr, S, chunk, s_qb, s_qh, s_kb, s_kh, s_ks, s_vb,
           s_vh, s_vs, s_bb, s_bh, s_bs, s_ob, s_oh, qk_scale, G: tl.constexpr, BLOCK_G: tl.constexpr,
           D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
           HAS_BIAS: tl.constexpr, F32: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Program (b, h, s): the G query heads of KV head h of sequence b (rows of one [BLOCK_G, D] tile, so tl.dot
    serves GQA) over keys [s * chunk, (s + 1) * chunk) of S. Scores in log2 units: (q . k * scale + bias) * log2(e),
    qk_scale = scale * log2(e)."""
    after_prior(PDL)
    b, h, s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads, live, dk = h * G + g, g < G, d < D  # [BLOCK_G] this group's q heads (rows >= G pad the tile)
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=live[:, None] & dk[None, :], other=0.0)
    kb, vb = k_ptr + b * s_kb + h * s_kh, v_ptr + b * s_vb + h * s_vh
    bb = bias_ptr + b * s_bb + heads[:, None] * s_bh  # [BLOCK_G, 1]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = s * chunk
    end = tl.minimum(start + chunk, S)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        kt = tl.load(kb + pos[None, :] * s_ks + d[:, None], mask=ok[None, :] & dk[:, None], other=0.0)  # [D, N]
        x = _dot(q, kt, F32, UPCAST) * qk_scale  # [BLOCK_G, BLOCK_N]
        if HAS_BIAS:  # (in log2 units too)
            bias = tl.load(bb + pos[None, :] * s_bs, mask=live[:, None] & ok[None, :], other=0.0)
            x += bias.to(tl.float32) * 1.4426950408889634
        x = tl.where(ok[None, :], x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        # a row whose keys so far are all masked (-inf) keeps m = -inf: subtract 0 there, not -inf (no NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(x - m_safe[:, None])
        v = tl.load(vb + pos[:, None] * s_vs + d[None, :], mask=ok[:, None] & dk[None, :], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32, UPCAST)
        den = den * alpha + tl.sum(p, 1)
        m = m_new
    if SPLITS == 1:  # a row with no visible key: acc and den are 0, and its output 0, as torch's SDPA (safe softmax)
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(o_ptr + b * s_ob + heads[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None] & dk[None, :])  # fmt: skip
    else:
        at = ((b * tl.num_programs(1) * G + heads) * SPLITS + s).to(tl.int64)  # rows of part [B, Hq, SPLITS, D]
        some = den > 0  # a split that saw no visible key: lse -inf, its part never read by the merge
        tl.store(lse_ptr + at, tl.where(some, m + tl.log2(tl.where(some, den, 1.0)), float("-inf")), mask=live)
        tl.store(part_ptr + at[:, None] * BLOCK_D + d[None, :], acc / tl.where(some, den, 1.0)[:, None],
                 mask=live[:, None])  # fmt: skip


@triton.jit
def merge(part_ptr, lse_ptr, o_ptr, s_ob, s_oh, Hq, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
          SPLITS_P2: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out[b, head] = the splits' normalised partial outputs weighted by their share of the softmax's sum; a head
    with no visible key in any split is 0, as torch's SDPA gives (its safe softmax)."""
    after_prior(PDL)
    b, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    sp, d = tl.arange(0, SPLITS_P2), tl.arange(0, BLOCK_D)
    at = (b * Hq + head) * SPLITS + sp
    lse = tl.load(lse_ptr + at, mask=sp < SPLITS, other=float("-inf"))
    some = lse > float("-inf")
    top = tl.max(lse, 0)
    w = tl.where(some, tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)), 0.0)
    part = tl.load(part_ptr + at[:, None] * BLOCK_D + d[None, :], mask=some[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * s_ob + head * s_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)
