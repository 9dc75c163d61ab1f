"""The triton attention backend: paged decode and mixed attention in Triton kernels. CUDA only (and Triton's
interpreter on CPU tensors, for tests); head dims a power of two >= 16; any page size.

Both routines are full-graph capturable (Support.ALWAYS): every grid and split count is a function of the
signature (bucket N, Hq, Hkv, D, page size, max_seq_len), never of a call's lengths, which the kernels read from
the device metadata.

  decode  one kernel, grid (N sequences, Hkv, splits). Program (b, h, s) attends the G = Hq / Hkv query heads of
          group h together (a [BLOCK_G >= 16, D] tile, so tl.dot serves GQA) to the cached positions of split s
          within [0, seq_len - 1) (EVEN_SPLITS: those positions in whole key blocks, as many per split, so a short
          sequence in a graph sized for long ones keeps every split busy; the split count stays static), read
          through the block table, plus the new token at seq_len - 1 taken from the
          k/v inputs (split 0 only). Split 0 also writes that token's k/v into its slot: the other splits read
          positions < seq_len - 1 only, so there is no race with the write. With more than one split each writes
          a partial output (float32, normalised) and its log-sum-exp; `merge` (grid (N, Hq)) combines them,
          skipping the splits past a sequence's length (lse = -inf). One split writes `out` directly. With
          LAST_MERGES, each split program instead counts itself in at its group's counter (an atomic after a
          barrier: the stream-K pattern), and the group's last program to arrive merges all splits in split order
          (the same sums whichever arrives last), writes `out` and puts the counter back to 0: no merge kernel.
  mixed   write_kv (one launch for k and v: _kv_write), then `mixed`: grid (query tiles, Hkv). A tile is up to
          BLOCK_M = ROWS // G query tokens of one sequence times its G heads (ROWS rows of tl.dot). Sequence s
          owns tiles [qsl[s] // BLOCK_M + s, qsl[s + 1] // BLOCK_M + s + 1): at least ceil(query_len / BLOCK_M),
          and N // BLOCK_M + S tiles bound them all, a static grid. Each program binary-searches qsl for its
          sequence; tiles past a sequence's tokens exit. Causal: the token at position p (its sequence's tail,
          as in the reference) attends keys [0, p].
A key block may span pages: every key row looks its page up in the block table ([BLOCK_N] int32 loads of one
row, cache-resident), so BLOCK_N does not depend on the page size. Two key rows of one head are Hkv * D elements
apart within a page (the cache is [pages, page, Hkv, D]): each row is its own D-element load either way, and a
page boundary between them costs nothing more. Hence the default page size of 16 (attention.page_size_for).

Semantics are the torch reference's (_attn_torch), with one difference, as with flash_attn's decode: decode
attends the new token from the k/v inputs, so when slot_mapping[b] is not the slot of position seq_len - 1 (metadata
that breaks the contract) the reference reads whatever that slot holds and this backend the new token. Padded
decode rows (seq_len 1, slot 0) attend their own token; the reference, any token that landed in slot 0 (garbage
either way).
Online softmax in float32 (base 2, the scale folded into log2(e)); partial outputs and lse in float32.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools

import torch

from fgraph.extend import pdl_args
from fgraph.ops._kv_write import write_kv

# Block sizes and warps: tiles that fit the registers without spilling for head dims 64 and 128 (ptxas, sm_90).
BLOCK_N = 64  # decode: keys per block, a [64, D] tile of K and of V per step
MIXED_ROWS = 64  # rows of a mixed query tile: BLOCK_M = MIXED_ROWS // G tokens times G heads
NUM_SMS = 132  # the H200's; on CUDA the device's own count is used
WAVES = 8  # decode programs to aim for when splitting, per SM (splits_for; docs/performance.md)
UNSPLIT_WAVES = 2  # a batch of this many programs per SM or more is not split
MAX_SPLITS = 32  # the merge reads [splits, D] per head; past this the merge costs more than longer splits
DECODE_STAGES = 2  # software-pipelined key blocks in flight per decode program (3, Triton's default, was slower)
WIDE_WAVES = 2  # head dim 128: decode programs per SM up to which each gets 8 warps, 2 past it (_decode_warps)
# decode's last split program of a group merges the splits (True), or a merge kernel after it (False): True
# is faster (docs/performance.md); its counters are made outside any capture (_zeros_outside_pools)
LAST_MERGES = True
# decode's keys per split: the sequence's own keys over the splits (True: every split works while the sequence has
# a block for each), or max_seq_len's share (False: a split past the sequence's end has nothing to do)
EVEN_SPLITS = True
LOG2E = 1.4426950408889634


def splits_for(batch: int, kv_heads: int, max_seq_len: int, block_n: int = BLOCK_N, num_sms: int = NUM_SMS) -> int:
    """Decode splits per (sequence, kv head): a function of static sizes only, so a graph is right for all lengths.

    batch * kv_heads programs alone leave most SMs idle at small batches (the 0.5B at B=1: 2 programs), and at
    long contexts too few key blocks in flight (a program streams its keys one block after another). Below
    UNSPLIT_WAVES programs per SM, each sequence's keys are split so that there are ~WAVES programs per SM in all,
    each over at least one key block, at most MAX_SPLITS; at or above it there is no split (1: no merge), since a
    split there costs more in the merge and in shorter programs than it gains (docs/performance.md).
    Splits get whole blocks, as many each, and none is left with no block of max_seq_len at all.

    The batch counts as its next power of two: an unpadded eager call of N sequences and the graph of N's bucket
    then split alike, so their float sums, and bf16 greedy tokens, are the same (every power of two is one of
    fgraph's default buckets, so N and its bucket round to the same one)."""
    programs = max(1, _pow2(batch) * kv_heads)
    if programs >= UNSPLIT_WAVES * num_sms:
        return 1
    want = -(-WAVES * num_sms // programs)
    blocks = -(-max(1, max_seq_len) // block_n)
    per = -(-blocks // max(1, min(want, blocks, MAX_SPLITS)))  # blocks per split
    return -(-blocks // per)


@functools.cache
def kernels():
    """The Triton kernels (_attn_triton_kernels: decode, merge, mixed), compiled per shape on first use; None
    without Triton."""
    try:
        from fgraph.ops import _attn_triton_kernels
    except ImportError:
        return None
    return _attn_triton_kernels


_lock_bufs: dict[tuple, torch.Tensor] = {}


def _locks(device: torch.device, n: int) -> torch.Tensor:
    """decode's arrival counters, one per (sequence, kv head) of a launch: zero between launches (the group's last
    program puts its own back), one buffer per device and size for the process, shared by every layer's launch (one
    after another on a stream: decodes of one size must not run concurrently on two streams). Met first inside a
    CUDA-graph capture, a buffer is made zero in the graph instead (a memset node), not kept: it belongs to that
    graph's pool. Kept ones are made outside any pool the calling thread allocates to (`_zeros_outside_pools`)."""
    key = (device, n)
    got = _lock_bufs.get(key)
    if got is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(n, dtype=torch.int32, device=device)
        got = _lock_bufs[key] = _zeros_outside_pools(n, device)
    return got


def _zeros_outside_pools(n: int, device: torch.device) -> torch.Tensor:
    """int32 zeros [n] from the device's own memory, not a pool the calling thread's allocations are routed to:
    torch.compile's cudagraph trees warm a function up with its thread's allocations in the tree's pool, and a
    tensor left alive there that is not an output fails the recording. A helper thread's allocation is not routed;
    it zeroes them on its own stream and waits for that, so the caller's stream finds them zero."""
    if device.type != "cuda":
        return torch.zeros(n, dtype=torch.int32, device=device)
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)

    def made():
        zeros = torch.zeros(n, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        return zeros

    with concurrent.futures.ThreadPoolExecutor(1) as helper:
        return helper.submit(made).result()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device(x: torch.Tensor):
    """The launch context: the tensors' CUDA device, or none for CPU tensors (Triton's interpreter)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def decode_launch(batch: int, kv_heads: int, head_dim: int, max_seq_len: int, num_sms: int) -> tuple[int, int]:
    """(splits, warps) of decode's launch: static sizes only, and the batch as its next power of two, as in
    splits_for, so that an unpadded eager call and its bucket's graph run the same launch (warps change the dot's
    summation order, so the bits)."""
    splits = splits_for(batch, kv_heads, max_seq_len, BLOCK_N, num_sms)
    return splits, _decode_warps(head_dim, _pow2(batch) * kv_heads * splits, num_sms)


def _decode_warps(head_dim: int, programs: int, sms: int) -> int:
    """decode's warps per program. Head dim 64: 4. Head dim 128: 8 for a grid of at most WIDE_WAVES programs per SM
    (a split batch of one: few programs, each with its own loads to keep in flight), else 2 (more programs resident
    per SM). The knobs measured per cell: docs/performance.md, `scripts/ab_decode_attn.py`."""
    if head_dim <= 64:
        return 4
    return 8 if programs <= WIDE_WAVES * sms else 2


def _mixed_block_n(head_dim: int) -> int:
    """mixed: keys per block (its [ROWS, D] q tile and accumulator leave less room than decode's [16, D])."""
    return 64 if head_dim <= 64 else 32


def _dot_options(q: torch.Tensor) -> tuple[str, bool]:
    """(input_precision, upcast) of the kernels' dots: float32 exact, not tf32 (the reference's accuracy); CPU
    tensors mean the interpreter, which needs bfloat16 operands upcast (kernels.dot)."""
    return ("ieee" if q.dtype == torch.float32 else "tf32"), (q.dtype == torch.bfloat16 and not q.is_cuda)


def decode(
    out, q, k, v, k_cache, v_cache, seq_lens, block_table, slot_mapping, *, scale, max_seq_len, rope=None
) -> None:
    """One token per sequence: q/out [N, Hq, D], k/v [N, Hkv, D] (rows of any stride, unit stride in D);
    caches [P, page, Hkv, D]; seq_lens [N]; block_table [N, max_pages]; slot_mapping [N]. Writes k/v, then out.

    rope: None, or (cos, sin) [N, D] (unit stride in D): q and k arrive before RoPE and the kernel rotates them as
    it loads them (_rope), writing the rotated k into the cache."""
    K = kernels()
    N, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    sms = _num_sms(q.device.index or 0) if q.is_cuda else NUM_SMS
    splits, warps = decode_launch(N, Hkv, D, max_seq_len, sms)
    chunk = -(-max_seq_len // (splits * BLOCK_N)) * BLOCK_N  # keys per split, whole blocks (EVEN_SPLITS: per sequence)
    part = lse = locks = out  # (unused with one split)
    if splits > 1:
        part = torch.empty(N, Hq, splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(N, Hq, splits, dtype=torch.float32, device=q.device)
        locks = _locks(q.device, N * Hkv) if LAST_MERGES else out
    precision, upcast = _dot_options(q)
    cos, sin = rope if rope is not None else (q, q)  # (unread without ROPE)
    with _device(q):
        K.decode[(N, Hkv, splits)](
            q, k, v, k_cache, v_cache, out, part, lse, locks, seq_lens, block_table, slot_mapping, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
            out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
            cos.stride(0), scale * LOG2E, chunk, Hq, G=G, BLOCK_G=max(16, _pow2(G)), D=D, PAGE=page,
            BLOCK_N=BLOCK_N, SPLITS=splits, SPLITS_P2=_pow2(splits), LAST_MERGES=LAST_MERGES,
            PART_CACHE=".wt" if LAST_MERGES else "", ROPE=rope is not None, PRECISION=precision, UPCAST=upcast,
            PTX=q.is_cuda, EVEN=EVEN_SPLITS, num_warps=warps, num_stages=DECODE_STAGES, **pdl_args(q),
        )  # fmt: skip
        if splits > 1 and not LAST_MERGES:
            K.merge[(N, Hq)](part, lse, out, out.stride(0), out.stride(1), Hq, SPLITS=splits,
                             SPLITS_P2=_pow2(splits), D=D, num_warps=4, **pdl_args(q))  # fmt: skip


def mixed(out, q, k_cache, v_cache, query_start_loc, seq_lens, block_table, *, scale) -> None:
    """Causal paged attention over caches that already hold every token's k/v: q/out [N, Hq, D]."""
    K = kernels()
    N, Hq, D = q.shape
    page, Hkv = k_cache.shape[1], k_cache.shape[2]
    S, G = seq_lens.shape[0], Hq // Hkv
    rows = max(MIXED_ROWS, _pow2(G))
    block_m = rows // G
    tiles = N // block_m + S  # bounds sum(ceil(query_len / block_m)) (module docstring)
    precision, upcast = _dot_options(q)
    with _device(q):
        K.mixed[(tiles, Hkv)](
            q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_table.stride(0), scale * LOG2E, S, G=G, BLOCK_M=block_m, ROWS=rows, D=D, PAGE=page,
            BLOCK_N=_mixed_block_n(D), SEARCH=(S - 1).bit_length(), PRECISION=precision, UPCAST=upcast, num_warps=8,
        )  # fmt: skip


def forward(out, q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, *, routine, scale,
            max_seq_len, rope=None):  # fmt: skip
    """The triton backend's eager rule: write k/v into their cache slots, then attend (module docstring).

    out, q: [N, Hq, D] (q: rows of any stride); k/v: [N, Hkv, D]; k_cache/v_cache: [P, page, Hkv, D] (unit stride
    in D); block_table: [S, max_pages]. rope: (cos, sin) [N, D] for decode only (_rope.FUSES), q and k before RoPE."""
    if q.shape[0] == 0:
        return
    assert k_cache.stride(-1) == v_cache.stride(-1) == out.stride(-1) == 1
    # the kernels need unit stride in D only
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if routine == "decode":
        decode(out, q, k, v, k_cache, v_cache, seq_lens, block_table, slot_mapping, scale=scale,
               max_seq_len=max_seq_len, rope=rope)  # fmt: skip
    else:
        assert rope is None, "triton's mixed kernel takes q and k after RoPE"
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        mixed(out, q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale=scale)
