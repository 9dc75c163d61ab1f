"""`fgraph::sdpa_decode`: attention of one query token per sequence over a dense KV cache, with an additive bias,
for compiled pieces to call where a traced SDPA decodes (a Hugging Face model's static-cache step).

  out [B, Hq, 1, D] = softmax(q @ k^T * scale + bias) @ v, q [B, Hq, 1, D], k and v [B, Hkv, S, D] (Hq a multiple
  of Hkv: query head i reads KV head i // (Hq / Hkv), as transformers' repeat_kv and SDPA's enable_gqa do), bias
  broadcastable to [B, Hq, 1, S] (float, added; bool, True where a key is visible) or None.

Not a break primitive: compiling a CUDA piece rewrites its one-query SDPA into it (`fgraph.compile`'s `_sdpa`, with
fgraph.config.sdpa_decode). What it replaces: at decode transformers' compile path repeats each KV head to every
query head it serves (a copy of the cache per step) and SDPA runs cuDNN's prefill kernel on one query row, tens of
µs a layer that the bytes read do not explain (docs/performance.md). Here the G query heads of a KV head are the
rows of one tile, so each key and value is read once per KV head, and the keys are split over programs
(flash-decoding) so that a small batch still fills the GPU:

  decode  grid (B, Hkv, SPLITS): program (b, h, s) runs an online softmax (float32, base 2) over its share of keys;
          with one split it writes out, else a normalised partial output and its log-sum-exp (float32);
  merge   grid (B, Hq), with more than one split: the splits' partials weighted by their share of the sum.
SPLITS is a function of the shapes only (B, Hkv, S and the GPU's SMs): a CUDA graph of it is right for any bias.

Semantics are torch's SDPA's: a key whose bias is -inf is skipped, and a row that sees no key is 0, as SDPA gives
it (its safe softmax, since torch 2.5; a plain softmax of only -inf is NaN). Off CUDA (tests on the CPU) the op is
torch's SDPA on the repeated heads: eager's math.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from .._config import pdl_args
from . import _workers
from ._rowwise import _pow2

BLOCK_N = 64  # keys per step, a [64, D] tile of K and of V
WAVES = 4  # decode programs to aim for, per SM (every split reads at least one key block)
MAX_SPLITS = 32  # the merge reads [splits, D] per head
MAX_HEAD_DIM = 256  # the [BLOCK_G, D] accumulator's registers
LOG2E = 1.4426950408889634


@functools.cache
def kernels():
    """The Triton kernels module, or None where Triton is not installed."""
    try:
        from . import _sdpa_kernels
    except ImportError:
        return None
    return _sdpa_kernels


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def splits_for(batch: int, kv_heads: int, keys: int, sms: int = 132) -> int:
    """Key splits per (sequence, KV head): about WAVES programs per SM in all, at least one key block each, at most
    MAX_SPLITS."""
    want = _cdiv(WAVES * sms, max(1, batch * kv_heads))
    return max(1, min(want, MAX_SPLITS, _cdiv(keys, BLOCK_N)))


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these (the op's callers check it before they call it)."""
    return (
        q.dim() == k.dim() == v.dim() == 4
        and q.shape[2] == 1
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and q.shape[-1] == k.shape[-1] == v.shape[-1] <= MAX_HEAD_DIM
        and k.shape[1] == v.shape[1]
        and k.shape[1] > 0
        and q.shape[1] % k.shape[1] == 0
        and k.shape[2] == v.shape[2]
    )


def reference(q, k, v, bias, scale: float) -> torch.Tensor:
    """Eager's math: torch's SDPA on KV heads repeated to every query head."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def sdpa_decode(q, k, v, bias, scale: float) -> torch.Tensor:
    """The op: the kernel on CUDA (where Triton is installed), else eager's math (`reference`)."""
    if not q.is_cuda or kernels() is None:
        return reference(q, k, v, bias, scale)
    return launch(q, k, v, bias, scale)


def launch(q, k, v, bias, scale: float, warm=False) -> torch.Tensor:
    """The kernels on q's device (CPU tensors: Triton's interpreter, TRITON_INTERPRET=1); `serves(q, k, v)` holds.
    warm "ahead": their compiles queued for the compile workers instead, for a trace's fake tensors (`AHEAD`); the
    first launch of each then waits for its compile (`_workers.direct`)."""
    kern = kernels()
    if warm:
        run = functools.partial(_workers.runner, warm=warm)
    else:  # (CPU tensors: Triton's interpreter launches them, with no workers' compile to wait for)
        run = _workers.direct if q.is_cuda else _workers.runner
    B, Hq, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if bias is not None:
        if bias.dtype == torch.bool:  # (visible where True, as SDPA reads a boolean mask)
            bias = torch.where(bias, 0.0, float("-inf"))
        bias = bias.expand(B, Hq, 1, S)
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    if B == 0 or Hq == 0:
        return out
    splits = splits_for(B, Hkv, S, _sms(q.device))
    chunk = _cdiv(_cdiv(S, splits), BLOCK_N) * BLOCK_N  # each split's keys, whole blocks
    block_d = max(16, _pow2(D))
    parts = torch.empty(B, Hq, splits, block_d, dtype=torch.float32, device=q.device) if splits > 1 else out
    lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device) if splits > 1 else out
    b_ = bias if bias is not None else q
    sb = bias.stride() if bias is not None else (0, 0, 0, 0)
    pdl = pdl_args(q)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        run(kern.decode, (B, Hkv, splits))(
            q, k, v, b_, out, parts, lse, S, chunk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), sb[0], sb[1], sb[3], out.stride(0), out.stride(1), scale * LOG2E,
            G=G, BLOCK_G=max(16, _pow2(G)), D=D, BLOCK_D=block_d, BLOCK_N=BLOCK_N, SPLITS=splits,
            HAS_BIAS=bias is not None, F32=q.dtype == torch.float32, UPCAST=not q.is_cuda, num_warps=4, **pdl,
        )  # fmt: skip
        if splits > 1:
            run(kern.merge, (B, Hq))(
                parts, lse, out, out.stride(0), out.stride(1), Hq, D=D, BLOCK_D=block_d, SPLITS=splits,
                SPLITS_P2=_pow2(splits), num_warps=1, **pdl,
            )  # fmt: skip
    return out


@torch.library.custom_op("fgraph::sdpa_decode", mutates_args=())
def _sdpa_decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return sdpa_decode(q, k, v, bias, scale)


@_sdpa_decode_op.register_fake
def _(q, k, v, bias, scale):
    return q.new_empty(q.shape[0], q.shape[1], 1, v.shape[-1])


op = torch.ops.fgraph.sdpa_decode.default

# the op's arguments -> its kernels' compiles, started in the compile workers as a piece is compiled (compile_ahead):
# their first launch compiles on the calling thread, in the first call's capture
AHEAD = {op: lambda q, k, v, bias, scale: launch(q, k, v, bias, scale, warm="ahead") if q.is_cuda else None}
