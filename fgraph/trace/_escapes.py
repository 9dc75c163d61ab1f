"""Values that escape a trace: fake tensors left where the function can reach after it was traced.

A traced function runs on fake tensors (shapes and dtypes, no data). One it stores outside itself (a global dict, a
closure cell, an attribute of an argument or of a module, a list a forward hook appends to, a logger's records) stays
fake after the trace: eager code that reads it later computes on no data, and another jitted function that reads it
cannot capture it. jax.jit raises UnexpectedTracerError for this; fgraph raises EscapeError at the end of the trace
that let the value out (`check`), and at the first jitted call that reads such a value (fgraph/_signature.py's
check_leaves). What the trace stored as an attribute of one of the callable's modules is put back first
(`ModuleDicts`): their state before the trace is known, and a module left holding a fake fails its eager calls.

The places scanned are those the function can reach: what Lifted scans (the callable's module, `self`, closure
cells, the globals its code reads, containers in them), the caller's own arguments (an object passed in), the hooks
of the modules reached (their closures), and the objects reached from any of these (a logger's handlers and
records), bounded in depth and count: the scan runs once per trace, never per call.
"""

from __future__ import annotations

import collections
import functools
import types

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules import module as _torch_module

from .._errors import EscapeError
from .._fx import user_code
from ._callable import Inlined
from ._places import global_names

_DEPTH, _BUDGET = 10, 20000  # how deep and how many objects the scan of one trace visits at most
_SKIP = (types.ModuleType, type, types.BuiltinFunctionType, str, bytes, int, float, complex, bool, type(None))
_FIX = (
    "return the value from the jitted function instead (jitted functions are pure, as under jax.jit: what they "
    "store outside themselves at trace time is a placeholder without data), or run the function eagerly "
    "(fgraph.disable_jit()) where it must record values"
)


def _hook_kind(attr: str) -> str | None:
    """`_forward_hooks` -> "forward hook" (a module's hook dicts)."""
    if attr.startswith("_") and attr.endswith("hooks") and "hook" in attr:
        return attr.strip("_").removesuffix("s").replace("_", " ")
    return None


class _Scan:
    """One walk over what a traced function can reach, collecting this trace's fake tensors with where they lie."""

    def __init__(self, mode):
        self.mode, self.seen, self.found, self.left = mode, set(), [], _BUDGET

    def mine(self, t) -> bool:
        return isinstance(t, FakeTensor) and (self.mode is None or t.fake_mode is self.mode)

    def value(self, where: str, v, via: str | None, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            if self.mine(v) and all(t is not v for *_, t in self.found):
                self.found.append((where, via, v))
            return
        if isinstance(v, _SKIP) or depth > _DEPTH or id(v) in self.seen or self.left <= 0:
            return
        self.seen.add(id(v))
        self.left -= 1
        if isinstance(v, Inlined):  # a jitted function: what it reads, not its own caches (which hold fakes)
            self.callable(where, v.fn, via, depth)
        elif isinstance(v, torch.nn.Module):
            self.module(where, v, via, depth)
        elif isinstance(v, types.FunctionType):
            if user_code(v):
                self.function(v, where if via is None else via, depth + 1)
        elif isinstance(v, types.MethodType):
            self.value(where.rpartition(".")[0] or where, v.__self__, via, depth + 1)
            self.value(where, v.__func__, via, depth + 1)
        elif isinstance(v, functools.partial):
            for i, a in enumerate(v.args):
                self.value(f"{where}.args[{i}]", a, via, depth + 1)
            for k, a in v.keywords.items():
                self.value(f"{where}.keywords[{k!r}]", a, via, depth + 1)
            self.value(where, v.func, via, depth + 1)
        elif isinstance(v, dict):
            for k, x in list(v.items()):
                self.value(f"{where}[{k!r}]", x, via, depth + 1)
        elif isinstance(v, (list, tuple, collections.deque)):
            for i, x in enumerate(list(v)):
                self.value(f"{where}[{i}]", x, via, depth + 1)
        elif isinstance(v, (set, frozenset)):
            for x in list(v):
                self.value(f"an item of {where}", x, via, depth + 1)
        elif isinstance(v, fx.GraphModule) or type(v).__module__.startswith("torch._"):
            return  # torch's own internals (a graph's node metadata holds fakes of other traces by design)
        else:
            self.attributes(where, v, via, depth)

    def attributes(self, where: str, obj, via, depth: int) -> None:
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            for k, x in list(d.items()):
                self.value(f"{where}.{k}", x, via, depth + 1)
        for c in type(obj).__mro__:
            for k in getattr(c, "__slots__", ()):
                if isinstance(k, str) and not k.startswith("__") and hasattr(obj, k):
                    self.value(f"{where}.{k}", getattr(obj, k), via, depth + 1)

    def module(self, where: str, m: torch.nn.Module, via, depth: int) -> None:
        for k, x in list(vars(m).items()):
            if k in ("_parameters", "_buffers", "_modules"):
                for name, y in list(x.items()):
                    self.value(f"{where}.{name}", y, via, depth + 1)
            elif (kind := _hook_kind(k)) is not None and isinstance(x, dict):
                for hook in list(x.values()):
                    self.value(f"a {kind} of {where}", hook, via, depth + 1)
            else:
                self.value(f"{where}.{k}", x, via, depth + 1)

    def function(self, fn: types.FunctionType, via: str | None, depth: int) -> None:
        """A user function's closure cells and the globals its code reads, named by variable (reached `via`)."""
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                v = cell.cell_contents
            except ValueError:  # not yet assigned
                continue
            self.value(var, v, via, depth)
        g = fn.__globals__
        for var in dict.fromkeys(global_names(fn.__code__)):
            if var in g:
                self.value(var, g[var], via, depth)

    def callable(self, where: str, fn, via, depth: int) -> None:
        """What fgraph.jit was given: a module, a bound method, a partial, a jitted function, a wrapper of one."""
        if isinstance(fn, torch.nn.Module):
            self.value(where, fn, via, depth)
            fn = type(fn).forward
        elif isinstance(fn, types.MethodType):
            self.value(where, fn.__self__, via, depth)
            fn = fn.__func__
        elif isinstance(fn, (functools.partial, Inlined)):
            self.value(where, fn, via, depth)
            return
        if isinstance(fn, types.FunctionType) and user_code(fn):
            self.seen.add(id(fn))
            self.function(fn, via, depth)
        elif (inner := getattr(fn, "__wrapped__", None)) is not None and id(inner) not in self.seen:
            self.seen.add(id(inner))
            self.callable(where, inner, via, depth + 1)
        if isinstance(fn, types.FunctionType):  # a library wrapper (torch.func.grad): what its closure holds
            for cell in fn.__closure__ or ():
                try:
                    self.value(where, cell.cell_contents, via, depth + 1)
                except ValueError:
                    continue


def _global_hooks() -> list[tuple[str, dict]]:
    """torch's process-wide module hooks (register_module_forward_hook and the like), by kind."""
    return [(kind, v) for k, v in vars(_torch_module).items() if (kind := _hook_kind(k)) and isinstance(v, dict)]


class ModuleDicts:
    """The instance dicts of the modules the traced callable holds, as they were before its trace.

    What the trace stored there (a module keeping a value it makes on its first call: transformers' longrope rotary
    embedding's `long_inv_freq`) is put back after the trace, traced or failed (`restore`): a fake tensor left on
    the module would break its eager calls too, `fgraph.disable_jit()` included. A copy of ~400 small dicts for an
    HF model: once per trace, never per call."""

    def __init__(self, fn):
        self.before = [(name, m, dict(vars(m))) for name, m in _modules_of(fn)]

    def restore(self, mode) -> list[tuple[str, torch.Tensor]]:
        """Put back each attribute the trace set to one of its fake tensors (`mode`; None: any): (where, the fake)."""
        mine = _Scan(mode).mine
        put = []
        for name, m, before in self.before:
            d = vars(m)
            for k, v in list(d.items()):
                if mine(v) and before.get(k, _ABSENT) is not v:
                    if k in before:
                        d[k] = before[k]
                    else:
                        del d[k]
                    put.append((f"{name}.{k}", v))
        return put


_ABSENT = object()


def _modules_of(fn, name: str = "self"):
    """(name, module) of every module a callable holds: a module, the module of a bound method, what a partial or a
    jitted function wraps."""
    if isinstance(fn, torch.nn.Module):
        return [(f"{name}.{k}" if k else name, m) for k, m in fn.named_modules()]
    if isinstance(fn, types.MethodType):
        return _modules_of(fn.__self__, name)
    if isinstance(fn, functools.partial):
        return _modules_of(fn.func, name)
    if isinstance(fn, Inlined):
        return _modules_of(fn.fn, name)
    return []


def check(fname: str, fn, arguments: dict, mode, gm: fx.GraphModule, restored: list = ()) -> None:
    """Raise EscapeError if a fake tensor of this trace (fake `mode`; None: any) lies where `fn` can reach, or was
    stored on one of its modules (`restored`: ModuleDicts.restore's, put back already).

    fn: the traced callable; arguments: the caller's own arguments by parameter name (not the trace's copies). The
    error's `left`: whether a fake is still where it went (those put back are not)."""
    scan = _Scan(mode)
    scan.callable("self", fn, None, 0)
    for name, v in arguments.items():
        scan.value(name, v, None, 0)
    for kind, hooks in _global_hooks():
        for hook in list(hooks.values()):
            scan.value(f"a {kind}", hook, None, 0)
    found = [(where, None, t) for where, t in restored] + scan.found
    if not found:
        return
    where, via, t = found[0]
    line = _line_of(gm, t)
    line = None if line is None or line.startswith("<string>") else line  # (torch's generated code: no line)
    more = f" (and {len(found) - 1} more value(s) elsewhere)" if len(found) > 1 else ""
    back = " (put back: the module holds what it held before the call)" if restored else ""
    e = EscapeError(
        f"fgraph.jit({fname}): a value made while tracing{f' at {line}' if line else ''} escaped the trace into "
        f"{where}{f' (reached through {via})' if via else ''}{more}; it is a fake tensor (shape "
        f"{list(t.shape)}, {str(t.dtype).removeprefix('torch.')}, no data), and eager code or another jitted "
        f"function that reads it computes on nothing{back}",
        (_KEPT_FIX + "; or " if restored else "") + _FIX,
    )
    e.left = bool(scan.found)
    raise e


_KEPT_FIX = (
    "if the module keeps a value it makes on its first call (transformers' longrope `long_inv_freq`), call it once "
    "before jitting it (or under fgraph.disable_jit()), so that it holds a real tensor"
)


def _line_of(gm: fx.GraphModule, t) -> str | None:
    """The user's line that made the traced value `t` (the node whose value it is, or views of one)."""
    try:
        key = (t.untyped_storage()._cdata, tuple(t.shape), tuple(t.stride()), t.storage_offset())
    except Exception:  # (symbolic sizes compare as symbols)
        key = None
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if val is t:
            return node.meta.get("line")
        if key is not None and isinstance(val, torch.Tensor):
            try:
                if (val.untyped_storage()._cdata, tuple(val.shape), tuple(val.stride()), val.storage_offset()) == key:
                    return node.meta.get("line")
            except Exception:
                continue
    return None
