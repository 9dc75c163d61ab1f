"""Errors raised while tracing the user's function, re-raised at fgraph's boundary.

What failed, the user's source line, the inputs involved by key path, symbolic sizes named by the argument they came
from ("batch axis of `x`"), and torch's own error kept as the cause when tracebacks are not filtered
(fgraph/_traceback.py)."""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import re
import types

import attrs
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from .. import _fx
from .._errors import EscapeError, TraceError
from .._traceback import filtering

_NOISY = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes", "torch.fx.experimental.recording")


def op_label(node: fx.Node) -> str:
    """The op a user would recognise for a traced node.

    `aten.nonzero.default`; an output of a multi-output op by that op (`aten._unique2.default (output 0)`), not fx's
    node dump (`%getitem : [num_users=1] = ...`)."""
    if node.target is operator.getitem and node.args and isinstance(node.args[0], fx.Node):
        return f"{op_label(node.args[0])} (output {node.args[1]})"
    if node.op == "get_attr":  # a tensor made from data while tracing: torch.tensor(2.0), torch.as_tensor(list)
        return "a constant, as torch.tensor(...) makes"
    return str(node.target) if node.op == "call_function" else node.format_node()


@contextlib.contextmanager
def quiet():
    """Fake-tensor and shape-env loggers print a traceback for an error that is about to be re-raised anyway."""
    loggers = [logging.getLogger(n) for n in _NOISY]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


@attrs.frozen(eq=False)
class TaggedOp:
    """The innermost torch call of the user's code an exception came from: the op, its arguments, its source line."""

    func: object
    args: tuple
    kwargs: dict
    line: str


def tag(e: BaseException, func, args, kwargs, line: str) -> None:
    """Remember, on the exception, the innermost torch call of the user's code it came from (first tag wins)."""
    if not hasattr(e, "_fgraph_op"):
        with contextlib.suppress(Exception):
            e._fgraph_op = TaggedOp(func, args, kwargs or {}, line)


class Names:
    """What the trace knows to name things by: input tensors -> key path, batch symbols -> their argument."""

    def __init__(self):
        self.inputs: dict[int, str] = {}  # id(traced input tensor) -> key path
        self.symbols: dict[str, list[str]] = {}  # "s26" -> key paths of the leaves whose batch axis it is
        self.keep: list = []  # the inputs themselves (ids stay valid while they live)
        self.mode = None  # the trace's fake mode
        self.args: dict = {}  # the caller's own arguments by name (where a tensor read but not input may live)

    def inside_argument(self, t, depth: int = 5, budget: int = 5000) -> tuple[str, str] | None:
        """(key path, argument name) of `t` inside an argument's plain objects, lists, tuples or dicts, if there.

        A tensor there is read without being an input when fgraph does not see into its object: an argument of a
        plain class is seen into only when donated (an HF StaticCache passed but not donated)."""
        todo = [(v, name, name, 0) for name, v in self.args.items()]
        while todo and budget > 0:
            v, path, arg, d = todo.pop()
            budget -= 1
            if v is t:
                return path, arg
            if d >= depth or isinstance(v, (torch.Tensor, torch.nn.Module, type, types.ModuleType, str, bytes)):
                continue
            if isinstance(v, dict):
                kids = [(w, f"{path}[{k!r}]") for k, w in v.items()]
            elif isinstance(v, (list, tuple)):
                kids = [(w, f"{path}[{i}]") for i, w in enumerate(v)]
            elif isinstance(getattr(v, "__dict__", None), dict) and not callable(v):
                kids = [(w, f"{path}.{a}") for a, w in vars(v).items()]
            else:
                continue
            todo.extend((w, p, arg, d + 1) for w, p in kids)
        return None

    def symbol(self, expr, path: str) -> None:
        self.symbols.setdefault(str(expr), []).append(path)

    def text(self, s: str) -> str:
        """`[s26, 4]` -> `[batch axis of `x`, 4]`."""

        def sub(m):
            paths = self.symbols.get(m.group(0))
            return f"(batch axis of {', '.join(f'`{p}`' for p in paths)})" if paths else m.group(0)

        return re.sub(r"\bs\d+\b", sub, s)

    def tensor(self, t) -> str:
        shape = ", ".join(self.text(str(d)) for d in t.shape)
        aval = f"{str(t.dtype).removeprefix('torch.')}[{shape}]"
        name = self.inputs.get(id(t))
        return f"`{name}` {aval}" if name else aval


def _user_frames(tb):
    while tb is not None:
        fn = tb.tb_frame.f_code.co_filename
        if not _fx.in_framework(fn):
            yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _where(f, lineno) -> str:
    fn = f.f_code.co_filename
    return f"{os.path.relpath(fn) if not fn.startswith('<') else fn}:{lineno}"


def _name_of(t, e: BaseException) -> str | None:
    """The variable a real (non-argument) tensor was read from.

    A local, closure or global of the user's frames, or an attribute of one."""
    for f, _ in reversed(list(_user_frames(e.__traceback__))):
        for kind, scope in [("", f.f_locals), ("the global ", f.f_globals)]:
            for k, v in scope.items():
                if v is t:
                    return f"{kind}`{k}`"
                if isinstance(v, (dict, list, tuple)) and not k.startswith("__"):
                    for i, w in v.items() if isinstance(v, dict) else enumerate(v):
                        if w is t:
                            return f"{kind}`{k}[{i!r}]`"
        for k, v in f.f_locals.items():
            d = getattr(v, "__dict__", None)
            if isinstance(d, dict) and not isinstance(v, types.ModuleType):
                for a, w in d.items():
                    if w is t:
                        return f"`{k}.{a}`"
    return None


def raised_by_user(e: BaseException) -> bool:
    """Whether the function's own code raised `e`, not a torch call it made.

    A `raise` or a failing lookup in its own code counts."""
    if hasattr(e, "_fgraph_op"):
        return False
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and next(_user_frames(tb), None) is not None


def translate(fname: str, e: Exception, names: Names) -> TraceError:
    """An fgraph TraceError for an exception raised while tracing `fname` (raise it `from` fgraph._traceback.cause)."""
    op = getattr(e, "_fgraph_op", None)
    frames = list(_user_frames(e.__traceback__))
    line = op.line if op else (_where(*frames[-1]) if frames else "<unknown>")
    msg = names.text(str(e).strip().split("\n\nWhile executing")[0])
    first = msg.splitlines()[0] if msg else type(e).__name__
    if "Please convert all Tensors to FakeTensors" in msg or "allow_non_fake_inputs" in msg:
        real = [
            x
            for x in (pytree.tree_leaves((op.args, op.kwargs)) if op else [])
            if isinstance(x, torch.Tensor) and not isinstance(x, torch._subclasses.FakeTensor)
        ]
        who = (_name_of(real[0], e) if real else None) or "a tensor"
        shape = f" ({str(real[0].dtype).removeprefix('torch.')}{list(real[0].shape)})" if real else ""
        inside = names.inside_argument(real[0]) if real else None
        if inside is not None:
            path, arg = inside
            kind = type(names.args[arg]).__name__
            return TraceError(
                f"fgraph.jit({fname}): `{path}`{shape} at {line} is read by the function but is not one of its "
                f"inputs: argument `{arg}` is a {kind}, whose tensors fgraph sees into only when it is donated",
                f"donate it: fgraph.jit(..., donate=[{arg!r}]) (its tensors are then inputs, written in place; a "
                "transformers cache: docs/contract.md, Hugging Face)",
            )
        return TraceError(
            f"fgraph.jit({fname}): {who}{shape} at {line} is read by the function but is not one of its inputs "
            "(a captured graph would freeze its value and address)",
            f"pass {who if who != 'a tensor' else 'it'} as an argument (arguments are read in place, not copied); "
            "fgraph lifts the tensors held by closures, globals, modules, dicts and lists, not those inside other "
            "containers (tuples, objects)",
        )
    fakes = [
        x
        for x in (pytree.tree_leaves((op.args, op.kwargs)) if op else [])
        if isinstance(x, FakeTensor) and names.mode is not None and x.fake_mode is not names.mode
    ]
    if fakes or "Mixing fake modes" in msg:  # a value that escaped another trace, read where fgraph does not lift
        who = (_name_of(fakes[0], e) if fakes else None) or "a tensor"
        return EscapeError(
            f"fgraph.jit({fname}): {who} read at {line} is a fake tensor (no data): a value that escaped an earlier "
            "trace, stored outside the jitted function that made it",
            "return the value from the jitted function that made it and pass it in (jitted functions are pure, as "
            "under jax.jit)",
        )
    involved = ""
    if op:
        func = op.func
        ts = [x for x in pytree.tree_leaves((op.args, op.kwargs)) if isinstance(x, torch.Tensor)]
        fn_name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
        involved = f" in {fn_name}({', '.join(names.tensor(t) for t in ts)})"
    return TraceError(
        f"fgraph.jit({fname}): {type(e).__name__} at {line}{involved}: {first}",
        "the function fails at these shapes and dtypes as written; run it eagerly to debug "
        f"(`with fgraph.disable_jit(): {fname}(...)`); "
        + (
            "torch's error is chained as the cause"
            if not filtering()
            else "FGRAPH_TRACEBACK_FILTERING=off chains torch's own error and frames as the cause"
        ),
    )
