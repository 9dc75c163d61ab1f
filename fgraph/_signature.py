"""Signatures: what one trace and one graph set are specialised to, and the batch padding that maps a call
with N tokens onto its bucket.

A signature is  static values × bucket × tree structure × (shape, dtype, device) of every leaf,
where batched leaves are counted at their padded size, so every N in a bucket shares one signature.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, NamedTuple

import attrs
import torch
import torch.utils._pytree as pytree

from ._errors import SignatureError


@attrs.frozen
class Batched:
  """Marks a leaf whose `axis` carries the token (batch) axis. It is padded to bucket + `extra` along it.

  pad: a scalar fill value, or a callable (tensor, size) -> tensor of `size` along `axis`, for pads that
  must follow a rule (a monotonic offsets array, a scratch page id).
  """
  axis: int = 0
  pad: Any = 0
  extra: int = 0

  def padded(self, x: torch.Tensor, size: int) -> torch.Tensor:
    have = x.shape[self.axis]
    if have == size:
      return x
    if callable(self.pad):
      return self.pad(x, size)
    shape = list(x.shape)
    shape[self.axis] = size - have
    return torch.cat([x, torch.full(shape, self.pad, dtype=x.dtype, device=x.device)], self.axis)

  def real(self, x: torch.Tensor) -> int:
    return x.shape[self.axis] - self.extra


def default_buckets(max_size: int = 512) -> tuple[int, ...]:
  """vLLM's capture sizes: 1, 2, 4, multiples of 8 up to 256, then multiples of 16 up to 512."""
  sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
  return tuple(s for s in sizes if s <= max_size)


def bucket_for(buckets: tuple[int, ...], n: int) -> int | None:
  """The smallest bucket >= n, or None when n exceeds the largest."""
  i = bisect.bisect_left(buckets, n)
  return buckets[i] if i < len(buckets) else None


class Leaf(NamedTuple):
  """The abstract value of one leaf: a tensor's (shape, dtype, device), or a Python value (by value)."""
  shape: tuple[int, ...] | None
  dtype: torch.dtype | None
  device: str | None
  value: Any = None

  def __str__(self):
    if self.shape is None:
      return f"{type(self.value).__name__}={self.value!r}"
    return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}@{self.device}"


def leaf_of(x: Any) -> Leaf:
  if isinstance(x, torch.Tensor):
    return Leaf(tuple(x.shape), x.dtype, str(x.device))
  return Leaf(None, None, None, x)


class Signature(NamedTuple):
  statics: tuple[tuple[str, Any], ...]
  bucket: int | None
  treespec: pytree.TreeSpec
  leaves: tuple[Leaf, ...]

  def describe(self) -> str:
    st = ", ".join(f"{k}={v!r}" for k, v in self.statics)
    return f"({st}{', ' if st else ''}bucket={self.bucket})"


def path_str(path) -> str:
  """`state.k[3]` for the key path (MappingKey('state'), GetAttrKey('k'), SequenceKey(3))."""
  if not path:
    return "<root>"
  head, rest = path[0], path[1:]
  name = head.key if isinstance(head, pytree.MappingKey) else pytree.keystr((head,))
  return f"{name}{pytree.keystr(rest)}"


def batch_specs(fname: str, batch: dict[str, Any], dynamic: dict[str, Any],
                treespec: pytree.TreeSpec, n_leaves: int) -> list[Batched | None]:
  """Broadcast the user's per-argument prefix trees of `Batched` onto the flat leaves of the call."""
  full = {k: batch.get(k) for k in dynamic}
  flat = pytree._broadcast_to_and_flatten(full, treespec, is_leaf=lambda x: isinstance(x, Batched) or x is None)
  if flat is None:
    raise SignatureError(f"fgraph.jit({fname}): batch= {batch!r} is not a prefix of the arguments' structure",
                         "give, per argument name, a Batched or a tree of Batched/None matching that argument")
  assert len(flat) == n_leaves
  return flat


def pad_count(fname: str, paths, leaves, specs) -> int | None:
  """N: the real token count of the call (max over batched leaves of size - extra)."""
  n = None
  for path, x, spec in zip(paths, leaves, specs):
    if spec is None:
      continue
    if not isinstance(x, torch.Tensor):
      raise SignatureError(f"fgraph.jit({fname}): {path_str(path)} is declared Batched but is a {type(x).__name__}",
                           "declare only tensor leaves as Batched")
    if x.dim() <= spec.axis:
      raise SignatureError(f"fgraph.jit({fname}): {path_str(path)} has shape {list(x.shape)}, "
                           f"expected a batch axis {spec.axis}", "fix the leaf's shape or the Batched(axis=...)")
    n = max(n or 0, spec.real(x))
  return n
