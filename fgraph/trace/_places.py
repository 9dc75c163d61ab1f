"""Where a value a traced function reads lives (a Place: a closure cell, a global, a container's item, a partial's
argument or an attribute), how it is read and put back, and which Python values a guard compares."""

from __future__ import annotations

import enum
import functools
import types

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensor


@attrs.frozen(eq=False)
class Place:
    """Where a lifted value lives: its leaf name, how it is held (`cell`, `global`, `item`, `parg` or `attr`), the
    object holding it and its key there (read, write)."""

    name: str
    kind: str
    holder: object
    key: object


def read(kind, holder, key):
    if kind == "cell":
        return holder.cell_contents
    if kind == "global":
        return holder.get(key)
    if kind == "item":
        if isinstance(holder, list):
            return holder[key] if key < len(holder) else None
        return holder.get(key)
    if kind == "len":
        return len(holder)
    if kind == "parg":
        return holder.args[key]
    return getattr(holder, key, None)


def reader(kind, holder, key):
    """A callable reading the slot now, as `read(kind, holder, key)` does: for a global, a cell or an attribute, a
    partial of a C function (no bytecode per read on the replay path: LiftedView.proven)."""
    if kind == "global":
        return functools.partial(holder.get, key)
    if kind == "cell":
        return functools.partial(getattr, holder, "cell_contents")
    if kind == "attr":
        return functools.partial(getattr, holder, key, None)
    return functools.partial(read, kind, holder, key)


def restore(kind, holder, key, installed, old):
    """Put a lifted slot's value back, unless the function stored a fake tensor of its own there.

    That one is a value escaping the trace, left for the escape check to find where it was stored."""
    now = read(kind, holder, key)
    if now is installed or not isinstance(now, FakeTensor):
        write(kind, holder, key, old)


def write(kind, holder, key, v):
    if kind == "cell":
        holder.cell_contents = v
    elif kind in ("global", "item"):
        holder[key] = v
    elif kind == "parg":  # a partial's arguments are a tuple: the partial is re-made in place
        args = list(holder.args)
        args[key] = v
        holder.__setstate__((holder.func, tuple(args), holder.keywords, holder.__dict__ or None))
    else:  # (a module's plain tensor attribute, or any object's: past its __setattr__, frozen or not)
        object.__setattr__(holder, key, v)


MAX_GUARDS = 64  # Python values of one container guarded one by one; past it, listed as unguarded


def guardable(v, depth: int = 0) -> bool:
    """Whether v is a Python value a trace bakes in and a guard compares cheaply: None, a bool, int, float, str,
    torch dtype or device, or enum member, or a short tuple (or torch.Size) of them."""
    if v is None or type(v) in (bool, int, float, str, torch.dtype, torch.device) or isinstance(v, enum.Enum):
        return True
    return type(v) in (tuple, torch.Size) and depth < 2 and len(v) <= 16 and all(guardable(x, depth + 1) for x in v)


def global_names(code) -> list[str]:
    """Names a code object (and the functions defined inside it) may read as globals."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(global_names(c))
    return names
