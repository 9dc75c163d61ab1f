"""Paged attention: the KV cache and metadata pytrees, and one break primitive (KV write + attention), three backends.

    cache = KVCache.allocate(layers, num_pages, page_size, kv_heads, head_dim, dtype, device)
    meta = build_metadata(query_lens, seq_lens, block_tables, page_size, max_pages)   # host, per step
    out = attention(q, k, v, cache.k[i], cache.v[i], meta, backend=..., routine=..., max_seq_len=..., rope=None)

`attention` calls the break `torch.ops.fgraph.attention(out, q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
block_table, slot_mapping, cos, sin, backend, routine, scale, max_seq_len, page_size)`, which rotates q and k when given
rope=(cos, sin) (_rope), writes the new keys/values into their slots, then `out`, and dispatches on `backend`. The KV
write lives inside the break (the op declares k_cache and v_cache mutated): as ordinary ops in the piece before it, an
in-place write into a graph input, Inductor (`jit(compile=True)`) functionalized it into a copy of the whole cache layer
per layer and step (a much slower decode step: docs/performance.md). The pieces between breaks never touch the cache.

  torch       the reference: CPU and GPU, any page size, static shapes (capturable: Support.ALWAYS)
  flash_attn  FlashAttention-2: decode via flash_attn_with_kvcache, which appends k/v itself (one kernel);
              mixed: index_copy_, then flash_attn_varlen_func with the block table; both capturable (ALWAYS),
              each routine its own kernels. Page size a multiple of 256.
  flashinfer  index_copy_, then per-bucket CUDA-graph wrappers planned on the host before every replay: decode,
              and mixed (the fa2 prefill wrapper over fixed buffers) where the metadata is padded to the bucket,
              as fgraph pads it; both capturable (ALWAYS).
  "auto"      per routine (AUTO): on CUDA, triton's decode and FA2's mixed ("triton/flash_attn"), each falling
              back to the next importable backend; torch on the CPU. A caller whose mixed metadata is padded to
              its bucket (the serving engine) gets FlashInfer's mixed kernel first (AUTO_PADDED). Any
              "DECODE/MIXED" pair of the above may be named; its cache has the page size both accept.
  triton      fgraph's own Triton kernels (_attn_triton): decode is one GQA-grouped split-KV kernel that also
              writes the new k/v (and a merge kernel when it splits); mixed: the one-launch write, then one
              causal paged kernel. Both capturable (ALWAYS). Any page size; head dims a power of two >= 16.
Backend modules (and flash_attn / flashinfer / triton themselves) are imported on first use: `import fgraph`
never does.

Routines: "decode" means one new token per sequence (S == N); "mixed" is any batch (prefill chunks and decodes).

Padding contract (what `metadata_batching()` declares and `pad_metadata()` applies). A bucket of B tokens has
B sequences too; the padded ones never touch a real page:
  seq_lens          padded with 1            (flashinfer reads a last-page length of 0 as a full page)
  block_table       rows of 0                (page 0 is the scratch page, never handed to a request)
  slot_mapping      0                        (padded tokens write their k/v into the scratch page: slot 0)
  query_start_loc   min(last + i, B)         (monotonic, ends at B: each padded sequence takes <= 1 token)
Outputs of padded rows are garbage and discarded. An all-padding batch (what fgraph captures with) is valid.

Host-side decisions (kernel routine, split count, grid) depend only on the signature (backend, routine,
bucket, shapes, max_seq_len), never on the lengths of a call: a graph captured on one batch is right for all.
"""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import torch

from fgraph.extend import Batched, FgraphError, PlanCall, Support, primitive, register
from fgraph.ops import _rope
from fgraph.ops._backends import (  # noqa: F401 (re-exported: the backends' names are attention's)
    AUTO,
    BACKENDS,
    TAKES,
    _module,
    _refuses,
    backend_for,
    backend_pair,
    page_size_for,
    resolve_backend,
)
from fgraph.ops._rope import apply_rope  # noqa: F401 (re-exported: rope= is attention's)

ROUTINES = ("decode", "mixed")
SCRATCH_PAGE = 0


# ---------------------------------------------------------------------------------------------- state
@register
@attrs.frozen
class KVCache:
    """Paged KV cache (donated state, updated in place).

    k[i], v[i]: [num_pages, page_size, kv_heads, head_dim]. Page 0 is the scratch page: padded rows read and write
    only there, so never give it to a request."""

    k: tuple = attrs.field(converter=tuple)
    v: tuple = attrs.field(converter=tuple)

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype=torch.bfloat16,
        device="cpu",
    ) -> KVCache:
        if num_pages < 2:
            raise FgraphError(
                f"KVCache.allocate: num_pages={num_pages} leaves no page besides the scratch page 0",
                "allocate at least 2 pages",
            )
        z = lambda: torch.zeros(num_pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)
        return cls(tuple(z() for _ in range(num_layers)), tuple(z() for _ in range(num_layers)))

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


@register
@attrs.frozen
class AttentionMetadata:
    """Per-call attention inputs (a pytree of int tensors, built on the host, padded to the bucket by fgraph).

    query_start_loc [S+1] int32  query offsets: sequence s owns tokens [qsl[s], qsl[s+1])
    seq_lens        [S]   int32  KV length of each sequence, new tokens included
    block_table     [S, max_pages] int32  page ids of each sequence (unused tail: 0)
    slot_mapping    [N]   int64  page * page_size + offset of each new token's k/v
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> AttentionMetadata:
        return AttentionMetadata(*(t.to(device, non_blocking=non_blocking) for t in attrs.astuple(self, recurse=False)))


def build_metadata(query_lens, seq_lens, block_tables, page_size: int, max_pages: int) -> AttentionMetadata:
    """Host metadata for S sequences.

    Sequence s has query_lens[s] new tokens, the last of its seq_lens[s] KV positions, stored in pages
    block_tables[s] (a list of page ids, at least ceil(seq_len / page_size) long). Vectorized in numpy (a serving
    loop builds one per step: far cheaper than a loop of torch ops per sequence)."""
    ql, sl = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
    if ql.shape != sl.shape or len(sl) != len(block_tables):
        raise FgraphError(
            f"build_metadata: {len(ql)} query_lens, {len(sl)} seq_lens, {len(block_tables)} block tables",
            "give one of each per sequence",
        )
    bad = np.flatnonzero((ql < 1) | (ql > sl))
    if bad.size:
        s = int(bad[0])
        raise FgraphError(
            f"build_metadata: sequence {s} has {ql[s]} new tokens and KV length {sl[s]}",
            "each sequence needs 1 <= query_len <= seq_len (the new tokens count in seq_len)",
        )
    have = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(sl))
    need = -(-sl // page_size)
    bad = np.flatnonzero((have < need) | (have > max_pages))
    if bad.size:
        s = int(bad[0])
        raise FgraphError(
            f"build_metadata: sequence {s} (length {sl[s]}) needs {need[s]} pages of {page_size}, got "
            f"{have[s]} (max_pages={max_pages})",
            "allocate enough pages; raise max_pages",
        )
    table = np.zeros((len(sl), max_pages), dtype=np.int32)
    table[np.arange(max_pages) < have[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(have.sum())
    )  # row-major
    qsl = np.zeros(len(ql) + 1, dtype=np.int64)
    np.cumsum(ql, out=qsl[1:])
    # position of every new token in its sequence: the last query_len positions before seq_len
    sid = np.repeat(np.arange(len(ql)), ql)  # [N]
    pos = sl[sid] - (qsl[1:][sid] - np.arange(qsl[-1]))
    slots = table[sid, pos // page_size].astype(np.int64) * page_size + pos % page_size  # [N]
    return AttentionMetadata(
        torch.from_numpy(qsl.astype(np.int32)),
        torch.from_numpy(sl.astype(np.int32)),
        torch.from_numpy(table),
        torch.from_numpy(slots),
    )


# ------------------------------------------------------------------------------------------ padding
PADS = {  # field -> (pad, extra): the padding contract (see the module docstring)
    "query_start_loc": ("ramp", 1),  # padded sequence i takes token min(last + i, bucket): <= 1 token each
    "seq_lens": (1, 0),
    "block_table": (SCRATCH_PAGE, 0),
    "slot_mapping": (SCRATCH_PAGE, 0),  # slot 0 of page 0
}


def metadata_batching() -> AttentionMetadata:
    """The `fgraph.Batched` spec of each metadata field, for `fgraph.jit(batch={...: Batch(meta=...)})`."""
    return AttentionMetadata(**{k: Batched(axis=0, pad=p, extra=e) for k, (p, e) in PADS.items()})


def pad_metadata(meta: AttentionMetadata, bucket: int) -> AttentionMetadata:
    """Pad to a bucket of `bucket` tokens (and sequences) as fgraph does: for eager runs and hand-made graphs."""
    out = {}
    for k, (p, e) in PADS.items():
        t = getattr(meta, k)
        if t.shape[0] - e > bucket:
            raise FgraphError(
                f"pad_metadata: {k} has {t.shape[0] - e} rows, more than the bucket {bucket}",
                "pick a bucket >= the number of tokens",
            )
        out[k] = Batched(axis=0, pad=p, extra=e).padded(t, bucket + e)
    return AttentionMetadata(**out)


# ------------------------------------------------------------------------------------------ the primitive
def _support(args) -> tuple[Support, str]:
    return Support.ALWAYS, f"{args.get('backend')} attention is capturable in both routines"


def _plan(call: PlanCall) -> bool:
    """Before every execution: flashinfer plans its kernels from the call's host metadata (others: nothing).

    True when its wrappers for this call exist and are planned (see fgraph.primitive): before a decode capture it
    makes them from the traced q and k_cache (call.avals), which a call by hand (plan_attention) lacks."""
    if call.args.get("backend") != "flashinfer":
        return True
    bucket = call.bucket if call.bucket is not None else int(call.inputs["query_start_loc"][-1])
    return _module("flashinfer").on_plan(
        call.args["routine"],
        bucket,
        call.args["page_size"],
        call.args["scale"],
        call.inputs,
        call.capturing,
        call.avals,
    )


@primitive(
    "attention",
    mutates_args=("out", "k_cache", "v_cache"),
    support=_support,
    plan=_plan,
    plan_needed=lambda args: args.get("backend") == "flashinfer",
)
def attention_p(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    backend: str,
    routine: str,
    scale: float,
    max_seq_len: int,
    page_size: int,
) -> None:
    """The attention break primitive: write k/v into the paged cache, then causal paged attention.

    Write k/v [N, Hkv, D] (cache dtype, any row stride, unit stride in D) into their slots of k_cache/v_cache, then
    out [N, Hq, D] = causal paged attention of q [N, Hq, D] over the cache. cos/sin [N, (1,) D] (or None): q and k are
    before RoPE, and the break rotates them first (_rope)."""
    assert k_cache.shape[1] == page_size, (k_cache.shape, page_size)
    rope = {}
    if cos is not None:
        if not cos.shape[0] == sin.shape[0] == q.shape[0]:
            raise FgraphError(
                f"attention: rope's cos and sin have {cos.shape[0]} and {sin.shape[0]} rows for {q.shape[0]} tokens",
                "pass cos and sin with one row per token of q (padded with q: compute them from the padded positions)",
            )
        cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)  # [N, D] views
        if (backend, routine) in _rope.FUSES:
            rope = {"rope": (cos, sin)}  # the kernel rotates q and k as it loads them (q of any row stride)
        else:
            q, k = _rope.rotate(q, k, cos, sin)  # fresh and contiguous
    if not rope:
        q = q.contiguous()  # (at run time, inside the break: a no-op for the usual q, fresh from RoPE)
    _module(backend).forward(
        out,
        q,
        k,
        v,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        slot_mapping,
        routine=routine,
        scale=scale,
        max_seq_len=max_seq_len,
        **rope,
    )


def plan_attention(
    meta: AttentionMetadata, *, backend: str, routine: str, page_size: int, scale: float, capturing: bool = False
) -> None:
    """Run the plan hook by hand, as fgraph.jit does before each execution (for driving CUDA graphs yourself).

    meta: this call's padded host metadata; scale: the one attention() gets (default head_dim ** -0.5). Knowing no
    shapes or dtypes of q and the cache, it makes no flashinfer wrapper: run one eager call before capturing."""
    bucket = meta.seq_lens.shape[0]
    inputs = {
        "query_start_loc": meta.query_start_loc,
        "seq_lens": meta.seq_lens,
        "block_table": meta.block_table,
        "slot_mapping": meta.slot_mapping,
    }
    args = {"backend": backend_for(backend, routine), "routine": routine, "scale": float(scale), "page_size": page_size}
    _plan(PlanCall(attention_p.p, args, inputs, bucket, bucket, {"routine": routine}, capturing))


# ------------------------------------------------------------------------------------------ the op
def _check(q, k, v, cache_k, cache_v, meta: AttentionMetadata, backend: str, routine: str):
    where = "attention"
    N, Hq, D = q.shape if q.dim() == 3 else (None, None, None)
    if N is None or cache_k.dim() != 4 or cache_k.shape != cache_v.shape:
        raise FgraphError(
            f"{where}: q {list(q.shape)}, cache_k {list(cache_k.shape)}, cache_v {list(cache_v.shape)}",
            "q is [N, Hq, D]; the caches are [num_pages, page_size, Hkv, D], the same for k and v",
        )
    Hkv = cache_k.shape[2]
    if k.shape != (N, Hkv, D) or v.shape != (N, Hkv, D) or cache_k.shape[3] != D or Hq % Hkv:
        raise FgraphError(
            f"{where}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit a cache of "
            f"{Hkv} kv heads of dim {cache_k.shape[3]}",
            "k and v are [N, Hkv, D]; Hq a multiple of Hkv",
        )
    S = meta.seq_lens.shape[0]
    if meta.query_start_loc.shape != (S + 1,) or meta.block_table.shape[0] != S or meta.slot_mapping.shape != (N,):
        raise FgraphError(
            f"{where}: metadata for {S} sequences and {meta.slot_mapping.shape[0]} tokens "
            f"(query_start_loc {list(meta.query_start_loc.shape)}, block_table "
            f"{list(meta.block_table.shape)}) does not fit q with {N} tokens",
            "build it with build_metadata and pad it with the same bucket as the tokens",
        )
    want = {
        "query_start_loc": torch.int32,
        "seq_lens": torch.int32,
        "block_table": torch.int32,
        "slot_mapping": torch.int64,
    }
    for name, dt in want.items():
        t = getattr(meta, name)
        if t.dtype != dt or t.device != q.device:
            raise FgraphError(
                f"{where}: meta.{name} is {t.dtype} on {t.device}, expected {dt} on {q.device}",
                "build it with build_metadata; move it to q's device (fgraph.jit does for Batched inputs)",
            )
    if routine not in ROUTINES:
        raise FgraphError(f"{where}: unknown routine {routine!r}", f"use one of {ROUTINES}")
    if routine == "decode" and S != N:
        raise FgraphError(
            f"{where}: routine='decode' with {S} sequences and {N} tokens",
            "decode means one token per sequence; use routine='mixed'",
        )
    pair = backend_pair(backend)
    if "flash_attn" in pair and cache_k.shape[1] % 256:  # one cache serves both routines of a pair
        raise FgraphError(
            f"{where}: flash_attn needs a page size that is a multiple of 256, the cache has {cache_k.shape[1]}",
            "allocate the cache with page_size=A.page_size_for('flash_attn')",
        )
    mine = backend_for(backend, routine)
    why = _refuses(mine, D, q.dtype)
    if why is not None:
        raise FgraphError(
            f"{where}: the {mine} backend needs {why}",
            "use backend='auto' (it picks a backend that takes them: resolve_backend(..., head_dim, dtype)) or 'torch'",
        )


def _check_rope(rope, q) -> tuple[torch.Tensor, torch.Tensor]:
    """attention's rope= -> (cos, sin), or an FgraphError naming what does not fit. (No reshape here: the break
    takes [N, 1, D] as it is, so the trace reads no size of a tensor made outside a `fgraph.repeated` layer.)"""
    N, _, D = q.shape
    if not (isinstance(rope, (tuple, list)) and len(rope) == 2 and all(isinstance(t, torch.Tensor) for t in rope)):
        raise FgraphError(
            f"attention: rope= is {type(rope).__name__}, not a (cos, sin) pair of tensors",
            "pass rope=(cos, sin), each [N, D] (examples/layers.rope_cos_sin makes them), or leave it None",
        )
    cos, sin = rope
    for name, t in (("cos", cos), ("sin", sin)):
        # the token count is compared where both are ints (here, or in the break): comparing symbolic sizes records
        # nodes on cos's size, a tensor made outside a `fgraph.repeated` layer, which the layer may not read
        rows = t.shape[0] if t.dim() in (2, 3) else None
        if (
            t.dim() not in (2, 3)
            or t.shape[-1] != D
            or (t.dim() == 3 and t.shape[1] != 1)
            or (isinstance(rows, int) and isinstance(N, int) and rows != N)
            or t.dtype != q.dtype
            or t.device != q.device
        ):
            raise FgraphError(
                f"attention: rope's {name} is {t.dtype}{list(t.shape)} on {t.device}; q is {q.dtype}{list(q.shape)} "
                f"on {q.device}",
                "pass cos and sin as [N, D] (or [N, 1, D]) in q's dtype on its device: one row per token",
            )
    return cos, sin


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float | None = None,
    backend: str = "torch",
    routine: str = "mixed",
    max_seq_len: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Write k/v [N, Hkv, D] into their slots of cache_k/cache_v, then attend: q [N, Hq, D] -> out [N, Hq, D].

    Both happen inside the one break `attention_p` (the cache is the break's in-place output, never a piece's).

    rope: (cos, sin), each [N, D] or [N, 1, D] in q's dtype: q and k are given before RoPE and the break rotates
    them, `x * cos + roll(x, D / 2) * sin` per head (HF's rotate-half with sin's first half negated: _rope), before
    it writes k and attends. The same result as rotating them first with `apply_rope`, with fewer kernels: triton's
    decode rotates as it loads. Pass q, k and v as views of a fused qkv output: no copy is made before the break.

    max_seq_len: a static bound on every seq_len (sizes flash_attn's mixed grid and triton's decode splits); default
    and cap: the block table's capacity (max_pages * page_size). scale: default D ** -0.5.
    """
    if backend == "auto":
        backend = resolve_backend("auto", q.device, q.shape[-1], q.dtype)
    _check(q, k, v, cache_k, cache_v, meta, backend, routine)
    N, Hq, D = q.shape
    cos, sin = _check_rope(rope, q) if rope is not None else (None, None)
    if cos is not None and (D % 2 or cache_k.dtype != q.dtype):
        # k rotates in q's dtype, then is cast to the cache's (and an odd D is no rotate-half): the reference, here
        cos, sin = (t if t.dim() == 3 else t[:, None] for t in (cos, sin))  # [N, 1, D]
        q, k, cos, sin = apply_rope(q, cos, sin), apply_rope(k, cos, sin), None, None
    backend = backend_for(backend, routine)
    page = cache_k.shape[1]
    cap = meta.block_table.shape[1] * page
    max_seq_len = cap if max_seq_len is None else min(int(max_seq_len), cap)
    # The break writes k/v into the cache itself (see the module docstring for why not here). Padded tokens hit
    # the scratch page. The casts are ordinary ops on [N, Hkv, D]: cheap, and they stay in the piece. No
    # .contiguous() here: k/v are often strided views of a fused qkv, contiguous only when N == 1, so asking would
    # record an N == 1 guard and cost bucket 1 a trace of its own; the backends take rows of any stride. (A view
    # keeps its whole base alive between PIECEWISE pieces: pass views of a small fresh tensor, as the example
    # models do with their roped k and v, not of a wide one such as qkv, whose large blocks fragment the pool.)
    k, v = k.to(cache_k.dtype), v.to(cache_v.dtype)
    out = torch.empty((N, Hq, D), dtype=q.dtype, device=q.device)
    attention_p(
        out,
        q,
        k,
        v,
        cache_k,
        cache_v,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        meta.slot_mapping,
        cos,
        sin,
        backend,
        routine,
        float(D**-0.5 if scale is None else scale),
        max_seq_len,
        page,
    )
    return out
