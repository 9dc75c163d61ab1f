"""Break primitives: opaque ops that the trace keeps as single nodes.

A primitive is data (`Primitive`); what it does lives in tables keyed by primitive, autodidax-style:

    eager_rules[p]    the Python implementation (what torch.library runs)
    fake_rules[p]     the shape-only implementation used while tracing
    support_rules[p]  may it run inside a CUDA graph?  (non-tensor args) -> (Support, reason)
    plan_rules[p]     optional host-side hook run before every execution of a signature
    plan_filters[p]   optional (non-tensor args) -> bool: whether a call site needs the hook at all (decided
                      once per trace, so a backend that plans nothing costs nothing per call)

Breaks follow vLLM's `*_with_output` convention: they return nothing and write into a caller-allocated
`out` tensor, so the address the next piece reads is the same on every replay.
"""

from __future__ import annotations

import enum
import inspect
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from . import _fx
from ._errors import FgraphError
from ._signature import Aval, takes

NAMESPACE = "fgraph"


class Support(enum.IntEnum):
    """How much of a CUDA graph a primitive tolerates (ordered: the weakest break of a signature wins)."""

    NEVER = 0  # runs eagerly between pieces, always (host syncs, data-dependent sizes)
    UNIFORM_DECODE = 1  # may sit inside a full graph only for decode-routine signatures
    ALWAYS = 2  # may sit inside any full graph


@attrs.frozen
class Primitive:
    name: str  # "attention" -> torch.ops.fgraph.attention.default

    @property
    def op(self) -> torch._ops.OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    def __repr__(self):
        return f"{self.name}_p"


@attrs.frozen
class PlanCall:
    """What a plan hook sees before each execution, once per call site (primitive, constant args, inputs, avals).

    inputs: the break's tensor arguments that are per-call (batched) inputs of the jitted function, by
    argument name, *as the caller passed them after padding* (so host tensors stay on the host: a plan hook
    reading them causes no device sync). Arguments computed inside the function are absent.
    avals: every tensor argument's abstract value as traced, by name (symbolic dims None; made once per trace),
    for host state a hook makes per shape or dtype before the first run. Empty in a call made by hand.
    """

    primitive: Primitive
    args: Mapping[str, Any]  # the break's non-tensor arguments (backend name, scale, ...)
    inputs: Mapping[str, torch.Tensor]
    bucket: int  # padded token count of this call's signature
    n: int  # real token count
    statics: Mapping[str, Any]  # the signature's static arguments (routine=..., ...)
    capturing: bool  # True while fgraph warms up or captures this signature
    avals: Mapping[str, Aval] = attrs.field(factory=dict)  # (empty by default: calls made by hand)


eager_rules: dict[Primitive, Callable] = {}
fake_rules: dict[Primitive, Callable] = {}
support_rules: dict[Primitive, Callable[[Mapping[str, Any]], tuple[Support, str]]] = {}
plan_rules: dict[Primitive, Callable[[PlanCall], bool | None]] = {}
plan_filters: dict[Primitive, Callable[[Mapping[str, Any]], bool]] = {}
registry: dict[str, Primitive] = {}


class _Executing(threading.local):
    token = None  # the token of this thread's signature execution in progress (None outside fgraph.jit)


_executing = _Executing()  # per thread: one thread's execution never lends its token (and memo) to another's


def executing():
    """A token for the execution of a jitted signature in progress (None outside one).

    fgraph sets it before the plan hooks run and keeps it through the execution, so a break can tell whether host
    state its plan hook made belongs to this very execution or is left over from an earlier one (then it must not be
    trusted)."""
    return _executing.token


def once_per_execution(key, compute: Callable[[], Any]):
    """compute() once per execution of a jitted signature and key, shared by the breaks of that execution.

    Every layer's attention derives the same tensor from the same metadata: one kernel a step, not one a layer.
    Outside an execution it is computed each time. Under CUDA graph capture it is computed again (the warm-up, which
    shares the capture's token, ran eagerly), so the graph holds its own computation at the first use."""
    token = _executing.token
    if token is None:
        return compute()
    memo = token.memo = token.memo or {}
    k = (key, torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    if k not in memo:
        memo[k] = compute()
    return memo[k]


class Token:
    """One execution of a jitted signature.

    in_graph: it is a replay (or the capture) of a graph that copies its per-call inputs in itself
    (fgraph.config.inputs_in_graph): a plan hook then stages host data for such a graph to copy at its start, and a
    break captures that copy, instead of each copying on its own (a copy and an event record per call, each costly
    on a busy GPU's host: docs/performance.md)."""

    __slots__ = ("in_graph", "memo")

    def __init__(self, in_graph: bool = False):
        self.in_graph, self.memo = in_graph, None  # memo: once_per_execution's values


class execution:
    """Context manager fgraph wraps each execution in (plan hooks, then replay or run)."""

    __slots__ = ("token", "prev", "in_graph")

    def __init__(self, in_graph: bool = False):
        self.in_graph = in_graph

    def __enter__(self):
        self.prev, self.token = _executing.token, Token(self.in_graph)
        _executing.token = self.token
        return self.token

    def __exit__(self, *exc):
        _executing.token = self.prev


def _as_support_rule(name: str, support) -> Callable[[Mapping[str, Any]], tuple[Support, str]]:
    if isinstance(support, Support):
        return lambda args: (support, f"declared {support.name}")

    def rule(args):
        res = support(args)
        level, why = res if isinstance(res, tuple) and len(res) == 2 else (res, None)
        try:
            level = Support(level) if not isinstance(level, bool) else None
        except ValueError:
            level = None
        if level is None or not isinstance(why, (str, type(None))):
            raise FgraphError(
                f"fgraph.primitive({name!r}): its support rule returned {res!r} for arguments {dict(args)}",
                "return a fgraph.Support (ALWAYS, UNIFORM_DECODE, NEVER), or a (Support, reason string) pair",
            )
        return level, why or f"declared {level.name}"

    return rule


def _check_hooks(name: str, support, plan, plan_needed) -> None:
    """primitive()'s rules and hooks, checked where they are given rather than when a trace first calls them."""
    where = f"fgraph.primitive({name!r})"
    if not isinstance(name, str):
        raise FgraphError(
            f"fgraph.primitive: the first argument is the primitive's name, got {name!r}",
            "decorate with @fgraph.primitive('name', support=...) (called, with a name)",
        )
    if not name.isidentifier():
        raise FgraphError(
            f"{where}: the name is not a Python identifier (the op becomes torch.ops.{NAMESPACE}.<name>)",
            "use letters, digits and underscores, not starting with a digit, e.g. 'my_op'",
        )
    if not isinstance(support, Support) and not (callable(support) and takes(support, 1)):
        raise FgraphError(
            f"{where}: support={support!r} is neither a fgraph.Support nor a rule of one argument",
            "pass fgraph.Support.ALWAYS, UNIFORM_DECODE or NEVER, or a rule (non-tensor args by name) -> Support or "
            "(Support, reason)",
        )
    for hook, fn in (("plan", plan), ("plan_needed", plan_needed)):
        if fn is not None and not (callable(fn) and takes(fn, 1)):
            raise FgraphError(
                f"{where}: {hook}={fn!r} is not a function of one argument",
                f"pass {hook}=None, or a function of one argument (see fgraph.primitive's docstring)",
            )


class BreakOp:
    """The callable a `@primitive` definition becomes: `toy(out, x)` runs `torch.ops.fgraph.toy(out, x)`."""

    def __init__(self, p: Primitive, custom_op):
        self.p, self._custom_op = p, custom_op
        self.__doc__ = eager_rules[p].__doc__

    def __call__(self, *args, **kwargs):
        return self.p.op(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        """Shape rule for a break that returns tensors (one that only writes `out` needs none)."""
        fake_rules[self.p] = fn
        self._custom_op.register_fake(fn)
        return fn

    def __repr__(self):
        return repr(self.p)


def primitive(
    name: str,
    *,
    mutates_args: tuple[str, ...] | list[str] = ("out",),
    support: Support | Callable = Support.ALWAYS,
    plan: Callable[[PlanCall], bool | None] | None = None,
    plan_needed: Callable[[Mapping[str, Any]], bool] | None = None,
) -> Callable[[Callable], BreakOp]:
    """Register a break primitive. The decorated function is its eager rule; its annotations are the schema.

        @fgraph.primitive("scale", support=fgraph.Support.ALWAYS)
        def scale(out: torch.Tensor, x: torch.Tensor, s: float) -> None:
            out.copy_(x * s)

    `support` is a level or a rule `(non-tensor args by name) -> Support | (Support, reason)`, so one op can
    declare different support per backend (`backend: str` argument). `plan` runs on the host before every
    execution of a signature containing the op (see `PlanCall`); `plan_needed(args)` may rule it out per call
    site (e.g. only one backend of the op plans). A plan that returns True says it made all the host state the
    break needs, so capturing that signature into a FULL graph needs no eager warm-up run first.
    """
    _check_hooks(name, support, plan, plan_needed)
    mutates = (mutates_args,) if isinstance(mutates_args, str) else tuple(mutates_args)

    def register(fn: Callable) -> BreakOp:
        if not inspect.isfunction(fn):
            raise FgraphError(
                f"fgraph.primitive({name!r}) decorates {fn!r}, which is not a Python function",
                "decorate a def whose annotations give the op's schema (out: torch.Tensor, ...) -> None",
            )
        if name in registry:  # (checked here, not in primitive(): two decorators of one name may be made first)
            raise FgraphError(
                f"fgraph.primitive({name!r}): a primitive of this name is already registered", "pick another name"
            )
        p = Primitive(name)
        try:
            custom = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates)(fn)
        except (ValueError, RuntimeError) as e:  # torch's schema inference: what the annotations do not give
            raise FgraphError(
                f"fgraph.primitive({name!r}): torch cannot make an op of {fn.__name__}{inspect.signature(fn)}: {e}",
                "annotate every parameter (out: torch.Tensor, x: torch.Tensor, s: float) and the return (-> None), "
                "and name in mutates_args= the tensors it writes",
            ) from None
        registry[name], eager_rules[p] = p, fn
        support_rules[p] = _as_support_rule(name, support)
        if plan is not None:
            plan_rules[p] = plan
        if plan_needed is not None:
            plan_filters[p] = plan_needed
        op = BreakOp(p, custom)
        if inspect.signature(fn).return_annotation in (None, "None"):
            fake_rules[p] = lambda *a, **k: None  # writes `out` only: shapes are the caller's
            custom.register_fake(fake_rules[p])
        else:  # until op.register_fake gives its shape rule, a trace says so (torch's error would blame the caller)

            def missing(*args, **kwargs):
                raise FgraphError(
                    f"fgraph.primitive({name!r}) returns tensors but has no shape rule, so it cannot be traced",
                    f"give it one: @{fn.__name__}.register_fake on a function of the same arguments returning empty "
                    "tensors of the outputs' shapes",
                )

            custom.register_fake(missing)
        return op

    return register


def primitive_of(node: torch.fx.Node) -> Primitive | None:
    """The break primitive an FX node calls, or None for ordinary aten ops."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != NAMESPACE:
        return None
    return registry.get(t._schema.name.split("::", 1)[1])


node_args = _fx.arguments  # all arguments of a break node by schema name (tensors appear as fx Nodes)


def constant_args(node: torch.fx.Node) -> dict[str, Any]:
    """The non-tensor arguments of a break node (what support and plan rules key on)."""
    return {
        k: v
        for k, v in node_args(node).items()
        if not isinstance(v, torch.fx.Node)
        and not (isinstance(v, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in v))
    }


def support_of(node: torch.fx.Node) -> tuple[Support, str]:
    return support_rules[primitive_of(node)](constant_args(node))
