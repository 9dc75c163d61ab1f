"""trace: a pure function of flat leaves -> an FX graph of aten ops and break primitives.

Traced with make_fx in fake mode, with the checks that reject what a static graph cannot honour, at trace time, with the
user's source line.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext, free_unbacked_symbols
from torch.overrides import TorchFunctionMode

from .. import _fx
from .._errors import FgraphError, TraceError
from .._state import root_of
from .._traceback import cause, frames_of
from . import _errors as E
from . import _escapes, _foreign
from ._compiling import compiling_flag
from ._constants import embed_host_constants
from ._slice_compat import fake_slices


def user_line(skip_ops: bool = True) -> str:
    """file:line of the innermost frame outside torch and fgraph (the user's code that caused an op)."""
    return _where(*_user_frame())


def _user_frame() -> tuple[str | None, int]:
    f = sys._getframe(2)
    while f is not None:
        if not _fx.in_framework(f.f_code.co_filename):
            return f.f_code.co_filename, f.f_lineno
        f = f.f_back
    return None, 0


def _where(fn: str | None, line: int) -> str:
    return "<unknown>" if fn is None else f"{os.path.relpath(fn) if not fn.startswith('<') else fn}:{line}"


def _package_of(path: str | None) -> str | None:
    """The installed package (under site-packages) whose file `path` is, else None (the user's own code)."""
    if path is None:
        return None
    path = os.path.abspath(path)
    for d in _fx.LIBRARY_DIRS:
        if d.rstrip(os.sep).endswith("-packages") and path.startswith(d):
            return path[len(d) :].split(os.sep)[0].removesuffix(".py")
    return None


def _host_sync_fix(path: str | None) -> str:
    package = _package_of(path)
    if package is None:
        return (
            "keep the value on the device (torch.where instead of if, masks instead of indexing by values), or pass "
            "it as a static argument"
        )
    hint = ""
    if package == "transformers" and os.path.basename(path) == "modeling_rope_utils.py":
        hint = (  # (longrope picks its frequencies with an `if` on the positions before transformers 5.21)
            " (a RoPE type that does not choose its frequencies on the host from the positions' values: not 'dynamic',"
            " nor 'longrope' before transformers 5.21)"
        )
    return (
        f"the line is the installed package `{package}`'s, not yours: choose a configuration of it whose forward keeps "
        f"tensor values on the device{hint}, or run the function without fgraph.jit"
    )


_HOST_SYNCS = {  # Tensor methods that need a value on the host, by name (C methods and Python ones alike)
    "item": ".item() (or .tolist())",
    "tolist": ".tolist()",
    "cpu": ".cpu()",
    "numpy": ".numpy()",
    "__repr__": "printing a tensor",
    "__format__": "formatting a tensor",
    "__bool__": "bool() of a tensor (Python control flow on a tensor value)",
    "__int__": "int() of a tensor",
    "__float__": "float() of a tensor",
    "__index__": "using a tensor as a Python index",
}


def _host_sync(func) -> str | None:
    owner, _, name = getattr(func, "__qualname__", "").rpartition(".")
    return _HOST_SYNCS.get(name) if owner in ("Tensor", "TensorBase") else None


class _RejectHostSyncs(TorchFunctionMode):
    """Host syncs cannot be replayed by a graph: reject them where the user wrote them."""

    def __init__(self, fname: str):
        super().__init__()
        self.fname = fname

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _host_sync(func)
        if what is not None:
            path, line = _user_frame()
            raise TraceError(
                f"fgraph.jit({self.fname}): {what} at {_where(path, line)} needs the tensor's value on the host, "
                "which a captured graph cannot provide (it replays without running Python)",
                _host_sync_fix(path),
            )
        try:
            return func(*args, **(kwargs or {}))
        except Exception as e:
            E.tag(e, func, args, kwargs, user_line())  # the user's op and line, for the error at the boundary
            raise


@contextlib.contextmanager
def _record_source_lines():
    """Stamp each FX node with the user's source line at its creation (make_fx keeps no stack here)."""
    create = fx.Graph.create_node

    def create_node(self, *a, **k):
        node = create(self, *a, **k)
        node.meta["line"] = user_line()
        return node

    fx.Graph.create_node = create_node
    try:
        yield
    finally:
        fx.Graph.create_node = create


class Shapes:
    """The symbolic batch dims of a trace and the guards the trace assumed.

    Which leaf's axis became which symbol, and the guards, so that a program traced once can be checked against every
    other bucket before reuse."""

    def __init__(self, shape_env: ShapeEnv, syms: list[tuple[Any, int]]):
        self.shape_env, self.syms = shape_env, syms  # [(symbol, extra)] per batched leaf

    def values(self, bucket: int) -> dict:
        return {sym: bucket + extra for sym, extra in self.syms}

    def fits(self, bucket: int) -> bool:
        """Every guard recorded while tracing holds when each batched dim is bucket + extra."""
        subst = self.values(bucket)
        for sym, v in subst.items():
            r = self.shape_env.var_to_range.get(sym)
            if r is not None and not (r.lower <= v <= r.upper):
                return False
        return all(bool(g.expr.xreplace(subst)) is True for g in self.shape_env.guards)

    def size(self, d, bucket: int) -> int:
        """A traced size (an int, or a SymInt over the batch symbols) at `bucket`."""
        return d if isinstance(d, int) else int(d.node.expr.xreplace(self.values(bucket)))


def _size_oblivious():
    """Trace batch dims without assuming they are >= 2 (torch's 0/1 specialization).

    A size-1 check then becomes a guard like any other, so a trace whose guards hold at 1 also serves bucket 1
    (Shapes.fits). Where torch lacks the switch, symbols keep their [2, inf] range and bucket 1 gets a trace of its
    own, as before."""
    cfg = torch.fx.experimental._config
    return cfg.patch(backed_size_oblivious=True) if hasattr(cfg, "backed_size_oblivious") else contextlib.nullcontext()


class _Tracing(threading.local):
    """Traces in progress on this thread: a jitted function called inside one is inlined (Jitted.__call__).

    Per thread: another thread's call meanwhile is its own, through its function's lock."""

    depth = 0


tracing = _Tracing()


class _GradModeReads(threading.local):
    """Whether the function this thread traces called torch.is_grad_enabled() from its own code.

    Such a trace (a branch on grad mode) serves only the grad mode it was traced in. Reads from torch's and fgraph's
    own frames are not counted: torch.no_grad() saving the mode it restores, and torch's module fast paths, whose
    branches also ask for inputs that require grad (a jitted call's never do)."""

    read = False


_grad_reads = _GradModeReads()
_watch_lock, _watchers = threading.Lock(), [0]


def _is_grad_enabled() -> bool:
    if tracing.depth and not sys._getframe(1).f_code.co_filename.startswith(_fx.FRAMEWORK_DIRS):
        _grad_reads.read = True
    return torch._C.is_grad_enabled()


@contextlib.contextmanager
def _watch_grad_mode():
    """torch.is_grad_enabled replaced while any thread traces (one C call otherwise).

    Yields a list that holds, once the block ends, the grad mode the trace read, or None when it read none."""
    with _watch_lock:
        _watchers[0] += 1
        torch.is_grad_enabled = _is_grad_enabled
    outer, _grad_reads.read, got = _grad_reads.read, False, [None]
    try:
        yield got
    finally:
        got[0] = torch._C.is_grad_enabled() if _grad_reads.read else None
        _grad_reads.read = outer or _grad_reads.read  # a trace inside a trace: its read is the outer one's too
        with _watch_lock:
            _watchers[0] -= 1
            if not _watchers[0]:
                torch.is_grad_enabled = torch._C.is_grad_enabled


def trace(
    fname: str,
    flat_fn: Callable[..., list],
    example: list[torch.Tensor],
    batch_axes: list[tuple[int, int] | None],
    paths: list[str] | None = None,
    reach: tuple[Any, dict] | None = None,
    device: str = "cpu",
) -> tuple[fx.GraphModule, Shapes | None]:
    """make_fx over fake tensors: nothing runs and donated state is not touched.

    The batch axes are traced as symbols (every other dim static), so the program serves every bucket whose size
    satisfies its guards. paths: each input's key path, for errors. reach: (the traced callable, the caller's own
    arguments by name): where a value made while tracing must not be left (EscapeError, fgraph/trace/_escapes.py).
    device: the signature's (a device trace records fgraph/trace/_foreign.py's equivalents of other libraries' ops).
    gm.meta["grad_mode"]: the grad mode the function read, else None."""
    shapes, names = None, E.Names()
    names.args = reach[1] if reach is not None else {}
    paths = paths or [f"input {i}" for i in range(len(example))]
    # one tensor passed for two leaves (tied weights) is two inputs: fake tensors are made once per tensor object,
    # so both placeholders would share one fake and every use of either be traced through the later one; a later
    # call passing two tensors there would read one of them twice. An alias (same memory) gets a fake of its own.
    firsts = {id(t): i for i, t in reversed(list(enumerate(example)))}
    example = [t if firsts[id(t)] == i else t.detach() for i, t in enumerate(example)]

    def named_fn(*tensors):
        names.mode = torch._guards.detect_fake_mode(tensors)  # this trace's fakes: those that must not escape it
        names.inputs.update({id(t): p for t, p in zip(tensors, paths)})
        names.keep.extend(tensors)
        return flat_fn(*tensors)

    decompositions = _foreign.foreign_decompositions(device)
    dicts = _escapes.ModuleDicts(reach[0]) if reach is not None else None
    tracing.depth += 1
    try:
        with (
            _record_source_lines(),
            _RejectHostSyncs(fname),
            E.quiet(),
            _watch_grad_mode() as grad_mode,
            compiling_flag(),
            fake_slices(),
        ):
            if any(a is not None for a in batch_axes):
                env = ShapeEnv()
                mode = FakeTensorMode(shape_env=env)
                fakes, syms = [], []
                with _size_oblivious():  # the symbols are made here (their range) and reasoned about in make_fx
                    for t, ax in zip(example, batch_axes):  # ax: (axis, extra rows beyond the bucket) or None
                        if (
                            ax is None
                        ):  # parameters, cache: plain static shapes (a symbolic context costs symbols per dim)
                            fakes.append(mode.from_tensor(t, static_shapes=True))
                            continue
                        dims = [DimDynamic.DYNAMIC if i == ax[0] else DimDynamic.STATIC for i in range(t.dim())]
                        fakes.append(mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)))
                        syms.append((fakes[-1].shape[ax[0]].node.expr, ax[1]))
                        names.symbol(syms[-1][0], paths[len(fakes) - 1])
                    with mode:
                        gm = make_fx(named_fn, decompositions, tracing_mode="symbolic")(*fakes)
                shapes = Shapes(env, syms)
            else:
                gm = make_fx(named_fn, decompositions, tracing_mode="fake")(*example)
    except FgraphError:
        raise
    except Exception as e:
        name = type(e).__name__
        if "DataDependent" in name or "GuardOnDataDependent" in name or "DynamicOutputShape" in name:
            raise TraceError(
                f"fgraph.jit({fname}): the traced function depends on tensor values at {_tb_line(e)} "
                f"({name}): Python control flow or shapes that come from data cannot be captured",
                "use torch.where / masking instead of `if tensor`, keep shapes static",
            ).with_traceback(frames_of(e)) from cause(e)
        # a batch size (a symbol) where Python wants an int, or hashes it (`{n: x}`, `hash(n)`)
        if isinstance(e, TypeError) and ("'SymInt'" in str(e) or "non-nested SymInt" in str(e)):
            raise TraceError(
                f"fgraph.jit({fname}): {str(e).splitlines()[0]} at {_tb_line(e)}: a batch size is a symbol while "
                "fgraph traces, and this Python operation does not take one",
                "compute with the size's own operators (n // k, n % k instead of divmod(n, k)), or keep the value "
                "out of the traced function",
            ).with_traceback(frames_of(e)) from cause(e)
        if E.raised_by_user(e):
            # as jax.jit does: the function's own exception, of its own type (callers may catch it), with a note
            e.add_note(
                f"(raised by {fname} while fgraph.jit traced it at this call's shapes and dtypes; "
                f"`with fgraph.disable_jit(): {fname}(...)` runs it eagerly)"
            )
            raise
        raise E.translate(fname, e, names).with_traceback(frames_of(e)) from cause(e)
    finally:
        tracing.depth -= 1
        restored = dicts.restore(names.mode) if dicts is not None else []
    if reach is not None:
        _escapes.check(fname, *reach, names.mode, gm, restored)
    gm.meta["grad_mode"] = grad_mode[0]
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (torch.Tensor, torch.SymInt)) and free_unbacked_symbols(val):
            sized = [a for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.SymInt)]
            if sized and not any(free_unbacked_symbols(a.meta["val"]) for a in sized):
                # bounds computed from a (backed) size, e.g. x[x.shape[0] - 2:]: torch cannot derive the result's
                # size, so it makes it a fresh unknown, as it would for data
                raise TraceError(
                    f"fgraph.jit({fname}): {E.op_label(node)} at {node.meta.get('line')} takes bounds computed "
                    "from a size, and torch cannot derive the size of its result from them",
                    "slice with constant bounds, or pick the rows with an index tensor passed in (e.g. the "
                    "positions of the last tokens)",
                )
            raise TraceError(
                f"fgraph.jit({fname}): {E.op_label(node)} at {node.meta.get('line')} has a shape that "
                "depends on tensor values, which a captured graph cannot replay",
                "use torch.where / masking instead of data-dependent shapes (nonzero, boolean indexing)",
            )
        if node.op == "call_function" and node.target is torch.ops.aten._local_scalar_dense.default:
            raise TraceError(
                f"fgraph.jit({fname}): a host sync (reading a tensor value, e.g. .item()/.tolist()) "
                f"at {node.meta.get('line')}",
                "keep the value on the device or make it static",
            )
    return gm, shapes


def _tb_line(e: BaseException) -> str:
    tb, line = e.__traceback__, "<unknown>"
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if not fn.startswith(_fx.FRAMEWORK_DIRS):
            line = f"{os.path.relpath(fn) if not fn.startswith('<') else fn}:{tb.tb_lineno}"
        tb = tb.tb_next
    return line


def _is_module_state(path: str) -> bool:
    return path.startswith("self.")  # a lifted module's parameter or buffer (fgraph/trace/_callable.py names them so)


def _same_storage(a: fx.Node, b: fx.Node) -> bool:
    """Whether two placeholders were traced as one tensor (the same one passed twice, or views of its storage)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (
        a is not b
        and isinstance(va, torch.Tensor)
        and isinstance(vb, torch.Tensor)
        and (va is vb or va.untyped_storage()._cdata == vb.untyped_storage()._cdata)
    )


def check(
    fname: str,
    gm: fx.GraphModule,
    placeholder_paths: dict[fx.Node, str],
    donated: Callable[[fx.Node], bool],
    device: str,
) -> None:
    """Reject in-place writes to non-donated inputs and host tensors in a device graph.

    An output that is a non-donated input or a view of one (`return x`, `x.reshape(...)`, `x[:, :1]`) gets a copy
    inside the program: outputs are values, and a replay must not hand back a view of the caller's tensor or of
    fgraph's buffers. Host constants the function makes are moved into a device program first
    (embed_host_constants)."""
    embed_host_constants(gm, device)
    for node in gm.graph.nodes:
        for tgt in _fx.write_targets(node):
            b = _fx.base_of(tgt)
            if b in placeholder_paths and not donated(b):
                twin = next((p for p in placeholder_paths if donated(p) and _same_storage(p, b)), None)
                if twin is not None:  # one tensor passed twice, written through the name that is not donated
                    raise TraceError(
                        f"fgraph.jit({fname}): {placeholder_paths[twin]} (donated) and {placeholder_paths[b]} are the "
                        f"same tensor, and {node.target} at {node.meta.get('line')} writes it in place through "
                        f"{placeholder_paths[b]}, which is not donated",
                        f"write it through {placeholder_paths[twin]}, or pass it once",
                    )
                raise TraceError(
                    f"fgraph.jit({fname}): {node.target} at {node.meta.get('line')} writes in place into "
                    f"{placeholder_paths[b]}, which is not donated",
                    f"add {root_of(placeholder_paths[b])!r} to donate=[...] (fgraph then updates it in place across "
                    "calls), or use the out-of-place op"
                    + (
                        " (a module's training statistics: model.eval())"
                        if _is_module_state(placeholder_paths[b])
                        else ""
                    ),
                )
        val = node.meta.get("val")
        if device != "cpu" and isinstance(val, torch.Tensor) and val.device.type == "cpu" and node.op != "placeholder":
            raise TraceError(
                f"fgraph.jit({fname}): a CPU tensor ({E.op_label(node)}) at {node.meta.get('line')} in a "
                f"{device} signature",
                f"create it on the device (device={device!r}), or pass it as an argument",
            )
        if node.op == "output":
            outs = list(node.args[0])
            for i, o in enumerate(outs):
                b = _fx.base_of(o)
                t = getattr(gm, b.target, None) if isinstance(b, fx.Node) and b.op == "get_attr" else None
                if isinstance(t, torch.Tensor):  # a real tensor reached where fgraph lifts none, returned as it is
                    raise TraceError(
                        f"fgraph.jit({fname}): output {i}, a tensor ({str(t.dtype).removeprefix('torch.')}"
                        f"{list(t.shape)}) the function returns, is not one of its inputs (a captured graph would "
                        "freeze its value and address)",
                        "pass it as an argument (arguments are read in place, not copied); fgraph lifts the tensors "
                        "held by closures, globals, modules, dicts and lists, not those inside other containers "
                        "(tuples, objects) nor those a fgraph.repeated function reads",
                    )
                if isinstance(o, fx.Node) and b in placeholder_paths and not donated(b):
                    with gm.graph.inserting_before(node):
                        outs[i] = gm.graph.call_function(torch.ops.aten.clone.default, (o,))
                    outs[i].meta.update(o.meta)
            if outs != list(node.args[0]):
                node.args = (type(node.args[0])(outs),)
                gm.recompile()
