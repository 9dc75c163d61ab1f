"""The triton attention backend's kernels (the design, grids and semantics: _attn_triton's docstring).

Importing this module imports Triton: _attn_triton.kernels() does, on first use.
"""

import triton
import triton.language as tl

from fgraph.extend import pdl_prologue

after_prior = pdl_prologue()  # (a Triton JIT function the kernels call: griddepcontrol.wait with fgraph.config.pdl)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in float32. UPCAST: for Triton's interpreter, whose dot multiplies bfloat16 operands' bit patterns (numpy
    has no bfloat16): the float32 product of bfloat16 values is exact, so only the summation order differs."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def mul_rn(a, b, PTX: tl.constexpr):
    """a * b in float32, never contracted into a multiply-add with what follows: on CUDA a `mul.rn` (PTX does not
    fuse an instruction with an explicit rounding mode); in the interpreter plain numpy, which never fuses."""
    if PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    return a * b


@triton.jit
def rope(x, xr, c, s, PTX: tl.constexpr):
    """x * c + xr * s rounded as eager torch rounds it in x's dtype: each product, then the sum, so the rotation here
    and the reference's torch ops agree bit for bit in every dtype. Left to the compiler, the half-precision
    products shrink to half-precision multiplies that then fuse with the add (one rounding instead of three).
    xr: x rolled by D / 2 (_rope)."""
    a = mul_rn(x.to(tl.float32), c.to(tl.float32), PTX).to(x.dtype)
    b = mul_rn(xr.to(tl.float32), s.to(tl.float32), PTX).to(x.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)


@triton.jit
def rotate(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, s_qt, s_qh, s_kt, s_kh, s_c, Hq, D: tl.constexpr,
           PTX: tl.constexpr):  # fmt: skip
    """Program (t, h): head h of token t, a q head for h < Hq, else k head h - Hq, into its contiguous copy."""
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = tl.arange(0, D)
    dr = (d + D // 2) % D
    c, s = tl.load(cos_ptr + t * s_c + d), tl.load(sin_ptr + t * s_c + d)
    if h < Hq:
        row, out = q_ptr + t * s_qt + h * s_qh, qo_ptr + (t * Hq + h) * D
    else:
        Hkv = tl.num_programs(1) - Hq
        row, out = k_ptr + t * s_kt + (h - Hq) * s_kh, ko_ptr + (t * Hkv + h - Hq) * D
    tl.store(out + d, rope(tl.load(row + d), tl.load(row + dr), c, s, PTX))


@triton.jit
def attend_block(acc, m, den, q, kc_ptr, vc_ptr, bt_row, n0, end, visible_to, qk_scale, s_page, s_row,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):  # fmt: skip
    """Keys [n0, n0 + BLOCK_N) below `end` into the running softmax (acc [R, D], m [R], den [R]) of q [R, D].

    kc_ptr/vc_ptr point at this kv head of page 0, row 0; bt_row at the sequence's block-table row; row r sees
    keys <= visible_to[r]. m is in log2 units (q @ k * qk_scale)."""
    pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    ok = pos < end
    page = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)  # [BLOCK_N] page of each key
    row = page * s_page + (pos % PAGE).to(tl.int64) * s_row  # [BLOCK_N] element offset of each key row
    d = tl.arange(0, D)
    kt = tl.load(kc_ptr + row[None, :] + d[:, None], mask=ok[None, :], other=0.0)  # [D, BLOCK_N]
    s = dot(q, kt, PRECISION, UPCAST) * qk_scale  # [R, BLOCK_N]
    s = tl.where(ok[None, :] & (pos[None, :] <= visible_to[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite: every caller's first block holds a key each row sees
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    # masked rows are never read: a poisoned (NaN) slot past `end` cannot reach acc through 0 * NaN
    v = tl.load(vc_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, D]
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, den * alpha + tl.sum(p, 1)


@triton.jit
def decode(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, o_ptr, part_ptr, lse_ptr, lock_ptr, seq_lens_ptr, bt_ptr, slot_ptr,
           cos_ptr, sin_ptr, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_page, s_row, s_head, s_bt, s_c,
           qk_scale, chunk, Hq, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
           BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, LAST_MERGES: tl.constexpr,
           PART_CACHE: tl.constexpr, ROPE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
           PTX: tl.constexpr, PDL: tl.constexpr, EVEN: tl.constexpr = False):  # fmt: skip
    after_prior(PDL)
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b64 = b.to(tl.int64)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, D)
    dr = (d + D // 2) % D  # ROPE: the rolled half of each row
    heads, live = h * G + g, g < G  # [BLOCK_G] the group's q heads; rows >= G are padding
    q_rows = q_ptr + b64 * s_qt + heads[:, None] * s_qh
    q = tl.load(q_rows + d[None, :], mask=live[:, None], other=0.0)
    if ROPE:  # q and the new k arrive before RoPE: rotate them here (cos/sin [N, D], this token's row)
        c, sn = tl.load(cos_ptr + b64 * s_c + d), tl.load(sin_ptr + b64 * s_c + d)
        q = rope(q, tl.load(q_rows + dr[None, :], mask=live[:, None], other=0.0), c[None, :], sn[None, :], PTX)
    cached = tl.load(seq_lens_ptr + b) - 1  # positions [0, cached) come from the cache
    if EVEN:  # the sequence's own keys in whole blocks over the splits (chunk: max_seq_len's share, unused)
        chunk = tl.cdiv(tl.cdiv(cached, SPLITS), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, cached)
    end = tl.where(s == SPLITS - 1, cached, end)  # the last split takes any rest (a seq_len past max_seq_len)
    kc_head, vc_head = kc_ptr + h * s_head, vc_ptr + h * s_head
    if s == 0:  # the new token: into its slot, and into the softmax from registers
        k_row = k_ptr + b64 * s_kt + h * s_kh
        k_new = tl.load(k_row + d)  # [D]
        if ROPE:
            k_new = rope(k_new, tl.load(k_row + dr), c, sn, PTX)
        v_new = tl.load(v_ptr + b64 * s_vt + h * s_vh + d)
        slot = tl.load(slot_ptr + b)
        slot_at = (slot // PAGE) * s_page + (slot % PAGE) * s_row + d
        tl.store(kc_head + slot_at, k_new)
        tl.store(vc_head + slot_at, v_new)
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale  # [BLOCK_G]
        den = tl.full([BLOCK_G], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32) + v_new.to(tl.float32)[None, :]
    else:
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
    bt_row = bt_ptr + b64 * s_bt
    sees_all = tl.zeros([BLOCK_G], tl.int32) + cached
    for n0 in range(start, end, BLOCK_N):
        acc, m, den = attend_block(acc, m, den, q, kc_head, vc_head, bt_row, n0, end, sees_all, qk_scale, s_page,
                                   s_row, PAGE, BLOCK_N, D, PRECISION, UPCAST)  # fmt: skip
    if SPLITS == 1:
        out = acc / den[:, None]
        tl.store(o_ptr + b64 * s_ot + heads[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])  # fmt: skip
    else:
        at = (b64 * Hq + heads) * SPLITS + s  # [BLOCK_G] rows of part [N, Hq, SPLITS, D] and lse [N, Hq, SPLITS]
        some = den > 0  # an empty split (past the sequence's keys) leaves its part unwritten: the merge skips it
        den = tl.where(some, den, 1.0)
        # PART_CACHE: ".wt" (write-through) with LAST_MERGES, whose last program reads them on another SM
        tl.store(lse_ptr + at, tl.where(some, m + tl.log2(den), float("-inf")), mask=live, cache_modifier=PART_CACHE)
        tl.store(part_ptr + at[:, None] * D + d[None, :], acc / den[:, None], mask=(live & some)[:, None],
                 cache_modifier=PART_CACHE)  # fmt: skip
        if LAST_MERGES:  # the group's last split program to finish merges them all (no merge kernel)
            tl.debug_barrier()  # every thread's stores made before the count (acq_rel) publishes them
            lock = lock_ptr + b64 * tl.num_programs(1) + h
            if tl.atomic_add(lock, 1, sem="acq_rel") == SPLITS - 1:
                first = (b64 * Hq + heads) * SPLITS  # [BLOCK_G] split 0's row of each head
                sp = tl.arange(0, SPLITS_P2)
                every = tl.load(lse_ptr + first[:, None] + sp[None, :], mask=live[:, None] & (sp < SPLITS)[None, :],
                                other=float("-inf"), cache_modifier=".cv")  # fmt: skip
                top = tl.where(live, tl.max(every, 1), 0.0)  # finite: split 0 holds the new token
                out = tl.zeros([BLOCK_G, D], tl.float32)
                total = tl.zeros([BLOCK_G], tl.float32)
                # unrolled, so every split's loads may be in flight together; in split order, so the same sums
                # whichever program is last
                for t in tl.static_range(SPLITS):
                    lse = tl.load(lse_ptr + first + t, mask=live, other=float("-inf"), cache_modifier=".cv")
                    has = lse > float("-inf")  # an empty split's part is unwritten
                    w = tl.where(has, tl.exp2(lse - top), 0.0)
                    part = tl.load(part_ptr + (first + t)[:, None] * D + d[None, :], mask=has[:, None], other=0.0,
                                   cache_modifier=".cv")  # fmt: skip
                    out += w[:, None] * part
                    total += w
                out = out / tl.where(live, total, 1.0)[:, None]
                tl.store(o_ptr + b64 * s_ot + heads[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                         mask=live[:, None])  # fmt: skip
                tl.atomic_xchg(lock, 0)  # ready for the next launch or replay


@triton.jit
def merge(part_ptr, lse_ptr, o_ptr, s_ot, s_oh, Hq, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
          D: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out[b, head] = the splits' partial outputs weighted by their share of the softmax's sum."""
    after_prior(PDL)
    b, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    sp, d = tl.arange(0, SPLITS_P2), tl.arange(0, D)
    at = (b * Hq + head) * SPLITS + sp  # [SPLITS_P2]
    lse = tl.load(lse_ptr + at, mask=sp < SPLITS, other=float("-inf"))
    some = lse > float("-inf")  # split 0 always is (it holds the new token): the max is finite
    w = tl.where(some, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    part = tl.load(part_ptr + at[:, None] * D + d[None, :], mask=some[:, None], other=0.0)  # [SPLITS_P2, D]
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(o_ptr + b * s_ot + head * s_oh + d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def mixed(q_ptr, kc_ptr, vc_ptr, o_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, s_qt, s_qh, s_ot, s_oh, s_page, s_row,
          s_head, s_bt, qk_scale, S, G: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
          D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SEARCH: tl.constexpr,
          PRECISION: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    t, h = tl.program_id(0), tl.program_id(1)
    # the tile's sequence: the last s with first_tile(s) = qsl[s] // BLOCK_M + s <= t (strictly increasing in
    # s; first_tile(0) = 0). SEARCH = ceil(log2(S)) halvings of [lo, hi].
    lo, hi = t * 0, t * 0 + S - 1
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi + 1) // 2
        go = tl.load(qsl_ptr + mid) // BLOCK_M + mid <= t
        lo, hi = tl.where(go, mid, lo), tl.where(go, hi, mid - 1)
    q0, q1 = tl.load(qsl_ptr + lo), tl.load(qsl_ptr + lo + 1)  # the sequence's tokens [q0, q1)
    tok0 = q0 + (t - (q0 // BLOCK_M + lo)) * BLOCK_M
    if tok0 < q1:  # else a spare tile (the grid's bound is static): nothing to do
        r, d = tl.arange(0, ROWS), tl.arange(0, D)
        tok, heads = tok0 + r // G, h * G + r % G  # [ROWS] row r: token tok0 + r // G, head h * G + r % G
        valid = (r // G < BLOCK_M) & (tok < q1)
        tok64 = tok.to(tl.int64)
        q = tl.load(q_ptr + tok64[:, None] * s_qt + heads[:, None] * s_qh + d[None, :], mask=valid[:, None],
                    other=0.0)  # fmt: skip
        # position of each token: its sequence's tail holds the new tokens; spare rows see key 0 only
        pos = tl.where(valid, tl.load(seq_lens_ptr + lo) - (q1 - tok), 0)  # [ROWS]
        end = tl.max(pos, 0) + 1
        m = tl.full([ROWS], float("-inf"), tl.float32)
        den = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        bt_row, kc_head, vc_head = bt_ptr + lo.to(tl.int64) * s_bt, kc_ptr + h * s_head, vc_ptr + h * s_head
        for n0 in range(0, end, BLOCK_N):
            acc, m, den = attend_block(acc, m, den, q, kc_head, vc_head, bt_row, n0, end, pos, qk_scale, s_page,
                                       s_row, PAGE, BLOCK_N, D, PRECISION, UPCAST)  # fmt: skip
        out = acc / den[:, None]
        tl.store(o_ptr + tok64[:, None] * s_ot + heads[:, None] * s_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=valid[:, None])  # fmt: skip
