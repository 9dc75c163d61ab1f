"""Which attention backend runs where: the backends' names, packages and modules, what their kernels take (TAKES),
what "auto" picks per routine (AUTO), "DECODE/MIXED" pairs and their page size. The primitive and its rules are
attention's (fgraph.ops.attention, which re-exports these names)."""

from __future__ import annotations

import importlib

import attrs
import torch

from fgraph.extend import FgraphError

BACKENDS = ("torch", "flash_attn", "flashinfer", "triton")
_MODULES = {
    "torch": "_attn_torch",
    "flash_attn": "_attn_flash",
    "flashinfer": "_attn_flashinfer",
    "triton": "_attn_triton",
}
_PACKAGES = {"flash_attn": "flash_attn", "flashinfer": "flashinfer", "triton": "triton"}


def _importable(backend: str) -> str | None:
    """None if the backend's package imports, else why not."""
    pkg = _PACKAGES.get(backend)
    if pkg is None:
        return None
    try:
        importlib.import_module(pkg)
    except Exception as e:  # an ImportError, or a broken build raising anything at import
        return f"{type(e).__name__}: {e}"
    return None


# "auto" per routine, best first on CUDA (docs/performance.md): triton's decode kernel is the fastest decode measured
# (no split + combine of another's making, no plan); FA2's mixed kernel is capturable on any metadata. FlashInfer's
# mixed kernel serves faster where the metadata is padded to its bucket (a serving engine's: docs/performance.md,
# Serving), and only there is it capturable, so it leads for callers that say so (`padded_metadata`). One cache
# serves both routines, so a pair shares its page size.
AUTO = {"decode": ("triton", "flashinfer", "flash_attn"), "mixed": ("flash_attn", "flashinfer", "triton")}
AUTO_PADDED = {**AUTO, "mixed": ("flashinfer", "flash_attn", "triton")}


def backend_pair(name: str) -> tuple[str, str]:
    """A backend spec -> (decode's backend, mixed's): "triton" -> both triton; "triton/flash_attn" -> each its own."""
    parts = name.split("/") if isinstance(name, str) else [name]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or any(p not in BACKENDS for p in parts):
        raise FgraphError(
            f"attention: unknown attention backend {name!r}",
            f"use 'auto', one of {BACKENDS}, or 'DECODE/MIXED' of two of them (e.g. 'triton/flash_attn')",
        )
    return parts[0], parts[1]


def backend_for(name: str, routine: str) -> str:
    """The backend that runs `routine` under a resolved spec (backend_pair)."""
    decode, mixed = backend_pair(name)
    return decode if routine == "decode" else mixed


_HALF = (torch.float16, torch.bfloat16)


@attrs.frozen
class HeadDims:
    """The head dims a backend's kernels take: a rule, and the same in words for an error."""

    ok: object  # head dim -> bool
    words: str


# What each backend's kernels take: (q dtypes, head dims); None: any. flash_attn: its
# kernels' bound and the multiple of 8 its kvcache entry point needs; triton: tl.arange tiles of D.
TAKES = {
    "torch": (None, None),
    "flash_attn": (_HALF, HeadDims(lambda d: d % 8 == 0 and d <= 256, "a multiple of 8 up to 256")),
    "flashinfer": (_HALF, None),
    "triton": (_HALF + (torch.float32,), HeadDims(lambda d: d >= 16 and not d & (d - 1), "a power of two >= 16")),
}


def _refuses(backend: str, head_dim: int | None = None, dtype: torch.dtype | None = None) -> str | None:
    """Why `backend`'s kernels cannot take this head dim or q dtype, naming every requirement unmet (None: they can,
    or nothing was given)."""
    dtypes, dims = TAKES[backend]
    why = []
    if dtype is not None and dtypes is not None and dtype not in dtypes:
        why.append(f"q in {' or '.join(str(t).removeprefix('torch.') for t in dtypes)}, got {dtype}")
    if head_dim is not None and dims is not None and not dims.ok(head_dim):
        why.append(f"a head dim that is {dims.words}, got {head_dim}")
    return " and ".join(why) or None


def resolve_backend(
    name: str = "auto", device="cpu", head_dim: int | None = None, dtype=None, padded_metadata: bool = False
) -> str:
    """ "auto" -> the best available on `device`, per routine (AUTO, or AUTO_PADDED for a caller whose mixed metadata
    is padded to its bucket, as a serving engine's is; "DECODE/MIXED" when they differ), of the backends whose kernels
    take this head dim and q dtype where they are given (TAKES); a name or pair -> checked."""
    dev = torch.device(device)
    if name == "auto":
        if dev.type != "cuda":
            return "torch"

        def best(routine):
            order = (AUTO_PADDED if padded_metadata else AUTO)[routine]
            ok = (b for b in order if _importable(b) is None and _refuses(b, head_dim, dtype) is None)
            return next(ok, "torch")

        decode, mixed = best("decode"), best("mixed")
        return decode if decode == mixed else f"{decode}/{mixed}"
    for part in dict.fromkeys(backend_pair(name)):
        if part == "torch":
            continue
        if dev.type != "cuda":
            raise FgraphError(
                f"resolve_backend: the {part} backend needs a CUDA device, got {dev}",
                "use backend='torch' (or 'auto') on the CPU",
            )
        why = _importable(part)
        if why is not None:
            raise FgraphError(
                f"resolve_backend: backend {part!r} does not import ({why})",
                f"pip install fgraph[{part.replace('_', '-')}], or use backend='auto'",
            )
    return name


def page_size_for(backend: str) -> int:
    """The default KV page size for a backend or pair (flash_attn's paged kernels need a multiple of 256).

    triton: 16, like torch and flashinfer (its kernels look up every key row's page, so a page costs them nothing
    over a larger one; small pages waste less of the cache on partly filled tails). A pair: the larger of its
    two (one cache serves both routines)."""
    if backend == "auto":
        raise FgraphError("page_size_for: backend 'auto'", "resolve it first: A.resolve_backend(...)")
    return max(256 if b == "flash_attn" else 16 for b in backend_pair(backend))


def _module(backend: str):
    return importlib.import_module(f"fgraph.ops.{_MODULES[backend]}")
