"""torch.compiler.is_compiling() while fgraph traces, and telling that apart from torch.compile tracing fgraph."""

from __future__ import annotations

import contextlib
import threading

import torch

# traces in progress on any thread, and torch.compiler's flag as it was before the first of them began
_compiling_lock, _compiling = threading.Lock(), [0, False]


@contextlib.contextmanager
def compiling_flag():
    """torch.compiler.is_compiling() true while a trace runs, as under torch.compile and torch.export.

    Libraries take their traceable paths then (transformers' MoE experts: a grouped matmul whose fake kernel takes
    bfloat16 only, in any other dtype its fallback). torch keeps the flag for the process, not per thread (export
    sets it the same way): it is set while any thread traces and put back as it was when the last trace ends,
    exceptions included. A torch without the flag traces as before."""
    flags = torch.compiler
    if not hasattr(flags, "_is_compiling_flag"):
        yield
        return
    with _compiling_lock:
        if not _compiling[0]:
            _compiling[1] = flags._is_compiling_flag
        _compiling[0] += 1
        flags._is_compiling_flag = True
    try:
        yield
    finally:
        with _compiling_lock:
            _compiling[0] -= 1
            if not _compiling[0]:
                flags._is_compiling_flag = _compiling[1]


def dynamo_compiling() -> bool:
    """torch.compile (dynamo) is tracing the caller: torch.compiler.is_compiling() true, and not set by fgraph.

    Dynamo reads is_compiling() as true in the code it traces whatever the flag; fgraph sets the flag while it
    traces (`compiling_flag`), which is not torch.compile."""
    return torch.compiler.is_compiling() and not _compiling[0]
