"""Capture leaves no trace: the donated state that warm-up and capture write is put back afterwards.

So after a jitted call the caller's state is what one eager call leaves (JAX's contract: tracing runs nothing).

Warm-up runs the program eagerly; capture runs it too on the CPU (HostGraph) and runs breaks eagerly between
PIECEWISE pieces on the GPU. Both write whatever the program writes in place. The donated leaves it writes are
copied before and copied back after, except those declared `jit(scratch=[...])`: state too large to copy (a KV
cache) whose padded rows, by the function's own padding values, write only into a scratch area (the KV cache's
page 0). Capture runs on an all-padding batch, so then it writes nothing else there.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def put_back(tensors: list[torch.Tensor]):
    """Restore `tensors` in place when the block ends (raised or not): same storage, the values they had.

    Yields the restore itself, for a block that runs the function more than once and must start each run from
    these values (warm-up, then capture)."""
    saved = [t.clone() for t in tensors]

    def restore() -> None:
        with torch.no_grad():
            for t, s in zip(tensors, saved):
                t.copy_(s)

    try:
        yield restore
    finally:
        restore()


def root_of(path: str) -> str:
    """The argument name a key path starts with: `cache.k[3]` -> `cache`."""
    return path.split("[")[0].split(".")[0]


@contextlib.contextmanager
def outside_inference_mode():
    """Tensors made here are normal tensors, grad off: the slot buffers signatures of either inference mode share.

    Made under torch.inference_mode() they would be inference tensors, which a call outside that mode (under
    no_grad) cannot write in place. (A signature's own buffers and graphs are made in its own mode: inference mode
    is part of the signature, TorchState.)"""
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield
