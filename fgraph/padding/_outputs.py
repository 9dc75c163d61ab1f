"""The outputs of a padded call, cut back to what the unpadded call returns.

Each output dim whose traced size is a batch size is cut (`x[:3]` of N rows: min(3, N)), sizes it returns are given
as the call's, and the outputs no cut can bring back are refused (a TraceError, at trace time where the size falls as
the batch grows, else at the call)."""

from __future__ import annotations

import re
from collections.abc import Callable

import sympy
import torch
import torch.fx as fx

from .._errors import GROWING_CACHE_FIX, TraceError, transformers_cache
from .._pytree import flatten_with_paths
from .._signature import path_str
from ._mixing import BatchAxes

_CAST = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def _sizer(axes: BatchAxes, size) -> Callable[[list], int | float | bool] | None:
    """A traced size, or a float or bool computed from one, as `leaves -> its value in a call`.

    `x.shape[0] / 2`, `x.shape[0] > 2`: the value is the unpadded call's, each leaf's symbol at that leaf's length as
    passed (leaves tied to one size agree: check_lengths); None for a static size."""
    cast = _CAST.get(type(size))
    e = size.node.expr if cast is not None else None
    if e is None or not e.free_symbols or not e.free_symbols <= set(axes.raw):
        return None
    at = {s: axes.raw[s] for s in e.free_symbols}
    if cast is not int:
        return lambda leaves: cast(e.xreplace({s: leaves[i].shape[ax] for s, (i, ax) in at.items()}))
    if len(at) == 1:  # the usual a * N + b (N, [N * heads] flattened, S + 1 offsets): no sympy per call
        ((s, (i, ax)),) = at.items()
        a, b = e.coeff(s), e.subs(s, 0)
        if a.is_Integer and b.is_Integer and sympy.expand(a * s + b - e) == 0:
            a, b = int(a), int(b)
            return lambda leaves: a * leaves[i].shape[ax] + b
    return lambda leaves: int(e.xreplace({s: leaves[i].shape[ax] for s, (i, ax) in at.items()}))


def output_rows(axes: BatchAxes, outs: list, skip: set[int]) -> list[tuple]:
    """Per output dim sized by the batch: (output, dim, size).

    size(leaves) its length in the unpadded call (x[:3] of N rows: min(3, N)). Static dims are never cut."""
    rows = []
    for j, v in enumerate(outs):
        if j in skip or not isinstance(v, torch.Tensor):
            continue
        for d in axes.dims(v):
            size = _sizer(axes, v.shape[d])
            if size is not None:
                rows.append((j, d, size))
    return rows


def refuse_shrinking_outputs(fname: str, gm: fx.GraphModule, axes: BatchAxes, skip: set[int]) -> None:
    """Refuse an output dim whose traced size falls as a batch size grows.

    Such a dim (`w[x.shape[0]:]`) is shorter, padded to a bucket, than in the unpadded call, and holds other rows: no
    cut can give the call's answer. A TraceError."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for j, o in enumerate(out_node.args[0]):
        v = o.meta.get("val") if isinstance(o, fx.Node) and j not in skip else None
        for d in axes.dims(v):
            if axes.falls(v.shape[d]):
                raise TraceError(
                    f"fgraph.jit({fname}): output {j} at {o.meta.get('line')} has {axes.name(v.shape[d])} rows along "
                    f"dim {d}, fewer as the batch grows: padded to a bucket it is shorter than in the call, and holds "
                    "other rows",
                    "take its rows from a start that does not depend on the batch size, or do not mark that input "
                    "Batched",
                )


def cut_error(entry, j: int, d: int):
    """The error for a call whose output size no cut of the padded graph's output gives.

    Raised when a call's size of output j along d lies outside what the padded graph returned (`x.split(2)[-1]`:
    chunk sizes computed from the bucket's N): no cut gives the call's answer."""
    raise TraceError(
        f"fgraph.jit({entry.traced.fname}): output {j}'s size along dim {d} in this call is not within the rows the "
        f"graph padded to bucket {entry.sig.bucket} returned: the output's shape depends on the batch size in a way "
        "padding changes (the log's 'padding is visible' lines name where)",
        "make the output's shape follow the batch size row for row (no split/chunk sizes computed from it), or "
        "call with a batch size equal to a bucket",
    )


def output_sizes(axes: BatchAxes, outs: list) -> list[tuple]:
    """Outputs that are sizes computed from the batch: (output, size).

    `x.shape[0]`, `n + 1`, `n / 2`, `n > 2`: size(leaves) is their value in the unpadded call (the graph returns the
    bucket's)."""
    return [(j, size) for j, v in enumerate(outs) if type(v) in _CAST and (size := _sizer(axes, v))]


def _tensors_in(v, depth: int = 3) -> bool:
    """Whether an object fgraph cannot see into holds tensors.

    It looks among its items (a dict or sequence of a class pytrees do not know, an OrderedDict subclass say) or
    attributes, down to `depth` levels (transformers' DynamicCache: layers, then their keys)?"""
    if isinstance(v, torch.Tensor):
        return True
    if depth == 0 or isinstance(v, (str, bytes, int, float, bool, type(None), type)):
        return False
    attrs = getattr(v, "__dict__", None)
    if not isinstance(attrs, dict):
        attrs = {k: getattr(v, k, None) for k in getattr(type(v), "__slots__", ())}
    items = list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple)) else []
    return any(_tensors_in(x, depth - 1) for x in [*items, *attrs.values()])


def _output_at(out, i: int) -> str:
    """The i-th output leaf, by its key path, for an error."""
    p = flatten_with_paths(out)[0][i][0]
    return f"output {path_str(p)}" if p else "the output"


def refuse_opaque_outputs(fname: str, out, leaves: list) -> None:
    """Refuse an output leaf of a class pytrees do not know that holds tensors.

    It would come back as traced (fake tensors that no replay updates): a TraceError naming its key path instead."""
    for i, v in enumerate(leaves):
        if not isinstance(v, torch.Tensor) and _tensors_in(v):
            where = _output_at(out, i)
            if transformers_cache(v):  # (use_cache's default): a class of transformers' the user cannot change
                raise TraceError(
                    f"fgraph.jit({fname}): {where} is transformers' {type(v).__qualname__} (use_cache=True, the "
                    "default): a cache made or grown per call, which no fixed-size graph can return",
                    GROWING_CACHE_FIX,
                )
            raise TraceError(
                f"fgraph.jit({fname}): {where} is a {type(v).__qualname__} holding tensors, which fgraph "
                "cannot see into (a captured graph would hand back the traced tensors)",
                f"return its tensors in a dict, tuple or NamedTuple, make {type(v).__qualname__} a dataclass or attrs "
                "class, or register it with fgraph.register / torch.utils._pytree.register_pytree_node",
            )


def refuse_formatted_sizes(fname: str, out, leaves: list) -> None:
    """Refuse a string output that spells a batch size as the trace saw it (`f"{x.shape[0]}"` is "s26" there).

    A string is handed back as traced on every call, so it would hold the symbol's name, never the call's size: a
    TraceError naming its key path instead."""
    env = getattr(torch._guards.detect_fake_mode(), "shape_env", None)
    new = hasattr(env, "backed_var_to_val")  # (torch 2.13's name; var_to_val before, deprecated there)
    vals = getattr(env, "backed_var_to_val", None) if new else getattr(env, "var_to_val", None)
    names = sorted(str(s) for s in vals or ())
    if not names:
        return
    symbol = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    for i, v in enumerate(leaves):
        if isinstance(v, str) and symbol.search(v):
            where = _output_at(out, i)
            raise TraceError(
                f"fgraph.jit({fname}): {where} is a string made from a batch size ({v!r}): the size is a symbol while "
                "fgraph traces, and a string is handed back as traced on every call, never with the call's size",
                "return the size itself (x.shape[0]: each call's), and format it outside the jitted function",
            )
