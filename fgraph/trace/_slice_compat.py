"""torch 2.11's fake `aten.slice.Tensor`, as torch 2.12 computes it, while fgraph traces and compiles.

A bound computed from a batch size (`x[:6]` of a batch of s rows, `t[: x.shape[0]]`, `t[x.shape[0] :]`) clamps to
the dim's size with sym_min / sym_max in 2.12; 2.11 makes the result's size a fresh unbacked symbol, which fgraph
refuses as a shape that depends on data (tests/padding: every slice bounded by the batch). On torch >= 2.12
`fake_slices()` changes nothing. On 2.11 it swaps the rule in for the duration only (counted across threads), so
other code in the process keeps torch's own."""

from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch._prims_common import canonicalize_dim
from torch._subclasses import fake_impls

NEEDED = torch.torch_version.TorchVersion(torch.__version__) < (2, 12)
_lock, _users, _saved = threading.Lock(), [0], []


def _compute_slice_index(size, index):
    from torch.fx.experimental.symbolic_shapes import guard_or_false, sym_and

    if guard_or_false(sym_and(index >= 0, index <= size)):
        return index
    elif guard_or_false(sym_and(index < 0, index >= -size)):
        return index + size
    elif guard_or_false(index < -size):
        return 0
    elif guard_or_false(index > size):
        return size
    elif guard_or_false(index >= 0):
        return torch.sym_min(index, size)
    elif guard_or_false(index < 0):
        return torch.sym_max(index + size, 0)
    return None


def slice_forward(fake_mode, func, self, dim=0, start=None, end=None, step=1):
    from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

    shape_env = fake_mode.shape_env
    if self.dim() == 0:
        raise RuntimeError("slice() cannot be applied to a 0-dim tensor.")
    dim = canonicalize_dim(self.dim(), dim)
    sizes, strides = list(self.size()), list(self.stride())
    if step <= 0:
        raise RuntimeError("slice step must be positive")
    start_index = 0 if start is None else _compute_slice_index(sizes[dim], start)
    end_index = (
        sizes[dim]
        if end is None or statically_known_true(end == sys.maxsize)
        else _compute_slice_index(sizes[dim], end)
    )
    new_size = None
    if start_index is not None and end_index is not None:
        if guard_or_false(end_index >= start_index):
            new_size = (end_index - start_index + step - 1) // step
        elif guard_or_false(start_index >= end_index):
            new_size = 0
        else:  # both resolved, their order unknown (Min/Max): max(end - start, 0), not an unbacked symbol
            new_size = (torch.sym_max(end_index - start_index, 0) + step - 1) // step
    if new_size is None:
        new_size = shape_env.create_unbacked_symint()
        torch._check(new_size >= 0)
        torch._check(new_size <= sizes[dim])
    if start_index is not None:
        storage_offset = self.storage_offset() + start_index * strides[dim]
    else:
        storage_offset = shape_env.create_unbacked_symint()
        torch._check(storage_offset >= 0)
    sizes[dim], strides[dim] = new_size, strides[dim] * step
    if self.is_quantized:
        raise NotImplementedError("Slice decomposition for quantized tensors aren't implemented")
    return self.as_strided(sizes, strides, storage_offset)


@contextlib.contextmanager
def fake_slices(force: bool = False):
    """2.12's fake slice rule in force meanwhile (force: on any torch, for the specs that keep this code tested)."""
    if not (NEEDED or force):
        yield
        return
    op = torch.ops.aten.slice.Tensor
    with _lock:
        if _users[0] == 0:
            _saved[:] = [fake_impls._compute_slice_index, fake_impls.op_implementations_dict.get(op)]
            fake_impls._compute_slice_index = _compute_slice_index
            fake_impls.op_implementations_dict[op] = slice_forward
        _users[0] += 1
    try:
        yield
    finally:
        with _lock:
            _users[0] -= 1
            if _users[0] == 0:
                fake_impls._compute_slice_index, rule = _saved
                fake_impls.op_implementations_dict[op] = rule
