"""Pytrees through `torch.utils._pytree`: attrs classes and dataclasses join dict/list/tuple/NamedTuple/None.

Fields marked static (`fgraph.field(static=True)`, or `metadata={"static": True}` on a dataclass field) go
into the tree structure, so they are part of the signature and must be hashable.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import attrs
import torch.utils._pytree as pytree

from ._errors import FgraphError

KeyPath = tuple  # of torch.utils._pytree key entries
keystr = pytree.keystr


def field(*, static: bool = False, **kwargs):
  """An attrs field; `static=True` puts its value in the treedef instead of the leaves."""
  metadata = dict(kwargs.pop("metadata", {}) or {}, static=static)
  return attrs.field(metadata=metadata, **kwargs)


def _fields(cls):
  if attrs.has(cls):
    return [(f.name, bool(f.metadata.get("static"))) for f in attrs.fields(cls)]
  return [(f.name, bool(f.metadata.get("static"))) for f in dataclasses.fields(cls)]


def register(cls: type) -> type:
  """Register an attrs class or dataclass as a pytree node (usable as a class decorator)."""
  if cls in pytree.SUPPORTED_NODES:
    return cls
  names = _fields(cls)
  dynamic = [n for n, s in names if not s]
  static = [n for n, s in names if s]

  def flatten(x):
    return [getattr(x, n) for n in dynamic], tuple(getattr(x, n) for n in static)

  def flatten_with_keys(x):
    return [(pytree.GetAttrKey(n), getattr(x, n)) for n in dynamic], tuple(getattr(x, n) for n in static)

  def unflatten(values, context):
    kw = dict(zip(dynamic, values)) | dict(zip(static, context))
    obj = object.__new__(cls)  # bypass __init__ validators/converters: values may be fx proxies or fakes
    for k, v in kw.items():
      object.__setattr__(obj, k, v)
    return obj

  pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys,
                              serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
  return cls


def _is_record(x) -> bool:
  return (attrs.has(type(x)) or dataclasses.is_dataclass(x)) and not isinstance(x, type)


def flatten_with_paths(tree: Any) -> tuple[list[tuple[KeyPath, Any]], pytree.TreeSpec]:
  """Flatten, registering attrs/dataclass types met on the way. Leaves come with their key paths."""
  while True:
    leaves, spec = pytree.tree_flatten_with_path(tree)
    new = {type(v) for _, v in leaves if _is_record(v)}
    if not new:
      return leaves, spec
    for cls in new:
      register(cls)


def check_static_fields(tree: Any, where: str) -> None:
  """Static fields must be hashable and must not hold tensors (a frozen tensor is a silent wrong answer)."""
  import torch
  def visit(x, path):
    if type(x) in pytree.SUPPORTED_NODES and _is_record(x):
      for n, s in _fields(type(x)):
        v = getattr(x, n)
        if s:
          if isinstance(v, torch.Tensor):
            raise FgraphError(f"{where}: {path}.{n} is a tensor in a static field",
                              "a static field is frozen into the signature; mark the field dynamic")
          try:
            hash(v)
          except TypeError as e:
            raise FgraphError(f"{where}: static field {path}.{n} is unhashable ({type(v).__name__}: {e})",
                              "use a tuple or a frozen attrs class for static configuration") from None
        else:
          visit(v, f"{path}.{n}")
    elif isinstance(x, dict):
      for k, v in x.items():
        visit(v, f"{path}[{k!r}]")
    elif isinstance(x, (list, tuple)):
      for i, v in enumerate(x):
        visit(v, f"{path}[{i}]")
  visit(tree, where.split(": ")[-1] if ": " in where else "")
