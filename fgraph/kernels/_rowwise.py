"""The row-wise launches beside fgraph::linear's matmuls, and what they and its kernels share: the gated activation
(`silu_mul`: silu(gate) * up in one launch) and the residual add with its RMSNorm (`add_rms_norm`), which run where
the fused kernel does not; `kernel()`, the Triton kernels of both, imported on first use."""

from __future__ import annotations

import contextlib
import functools

import torch

from .._config import pdl_args


@functools.cache
def kernel():
    """The Triton kernels (`_gemv_kernels`: gemv, glu, add_rms_norm); None without Triton."""
    try:
        from . import _gemv_kernels
    except ImportError:
        return None
    return _gemv_kernels


def _pow2(m: int) -> int:
    """The power of two at or above m (m >= 1): the reduce path's BLOCK_M for m rows, sdpa_decode's tile sizes."""
    return 1 << (m - 1).bit_length()


def normable(x, norm: tuple | None) -> bool:
    """Whether the kernel can read rms_norm(x (+ r)) * nw: x and r contiguous alike, nw one weight per column."""
    if norm is None:
        return True
    r, nw, _ = norm
    return (
        x.is_contiguous()
        and (r is None or (r.shape == x.shape and r.dtype == x.dtype and r.is_contiguous()))
        and nw.shape == (x.shape[1],)
        and nw.dtype == x.dtype
        and nw.is_contiguous()
    )


def silu_mul(y: torch.Tensor, up: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(y[:, :N]) * y[:, N:] for y [M, 2N] (or, given up [M, N], silu(y) * up): one Triton launch on CUDA in half
    precision, else torch's ops (bit for bit the unfused ones)."""
    gate, up = y.split(y.shape[1] // 2, dim=-1) if up is None else (y, up)
    half = y.dtype in (torch.bfloat16, torch.float16) and up.dtype == y.dtype
    if not (y.is_cuda and half and y.stride(1) == 1 and up.stride(1) == 1 and kernel() is not None):
        return torch.mul(torch.nn.functional.silu(gate), up, out=out)
    out = torch.empty(gate.shape, dtype=y.dtype, device=y.device) if out is None else out
    if out.numel():
        _launch_glu(gate, up, out)
    return out


def _launch_glu(gate, up, out, block: int = 1024) -> None:
    m, n = out.shape
    with torch.cuda.device(gate.device) if gate.is_cuda else contextlib.nullcontext():  # (CPU: Triton's interpreter)
        kernel().glu[(m, -(-n // block))](gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block,
                                          **pdl_args(gate))  # fmt: skip


def add_rms_norm(x: torch.Tensor, r: torch.Tensor | None, nw: torch.Tensor, eps: float):
    """(s, h): s = x + r (x itself without r), h = nw * rms_norm(s) rounded as the examples' and HF's rms_norm round
    it (in float32, the normalised value cast back, then the weight): one Triton launch on CUDA in half precision,
    else those torch ops, bit for bit."""
    if not (
        x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and kernel() is not None and normable(x, (r, nw, eps))
    ):
        s = x if r is None else x + r
        sf = s.float()
        return s, nw * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    s = x if r is None else torch.empty_like(x)  # (x contiguous: s and h share its row stride in the kernel)
    h = torch.empty_like(x)
    if x.numel():
        with torch.cuda.device(x.device):
            kernel().add_rms_norm[(x.shape[0],)](x, r if r is not None else x, nw, s, h, x.shape[1], x.stride(0),
                                                 h.stride(0), eps, HAS_RES=r is not None,
                                                 BLOCK=_pow2(x.shape[1]), **pdl_args(x))  # fmt: skip
    return s, h
