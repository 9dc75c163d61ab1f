"""Index bounds at a bucket: an index op whose padded index rows point past the tensor it indexes.

Padded rows run through every kernel, warm-up and capture included. An index tensor whose padded rows hold the padded
batch axis's row numbers (an arange over it, as an attention mask is read row by row beside padded input ids) or a
fill value (a Batched pad, or what the function computes from it) indexes out of bounds wherever that value is not a
row of the tensor it indexes: on CUDA a device-side assert, which ends the process's CUDA context, on the CPU an
IndexError. Such an index is found on the trace, at the bucket it serves, before the program runs anywhere; a trace
serves only the buckets where every index it follows stays in bounds (Traced.fits), so a larger bucket is traced,
and refused, on its own.

What the padded rows hold is fgraph/padding/_index_flow.py's `pad`: values from the caller are not followed.
"""

from __future__ import annotations

from typing import NamedTuple

import sympy
import torch
import torch.fx as fx

from .. import _fx
from .._errors import SignatureError, TraceError
from ._index_flow import _MOVES, _RESHAPES, _SAME, Flow

# ops reading or writing along one dim of their first operand by an index tensor: (dim argument or a fixed dim, the
# index argument's name); `index` and friends take one index per leading dim
_BY_DIM = {"index_select": "index", "gather": "index", "index_copy": "index", "index_copy_": "index"}
_BY_DIM |= {"index_add": "index", "index_add_": "index", "index_fill": "index", "index_fill_": "index"}
_BY_DIM |= {"scatter": "index", "scatter_": "index", "scatter_add": "index", "scatter_add_": "index"}
_BY_DIM |= {"scatter_reduce": "index", "scatter_reduce_": "index", "take_along_dim": "indices"}
_ADVANCED = {"index", "_unsafe_index", "index_put", "index_put_", "_unsafe_index_put"}
_WRAPS = _ADVANCED | {"take"}  # -k counts from the end
_DEVICE = "on CUDA a device-side assert, which ends the process's CUDA context; found on the trace, before anything ran"


class Bound(NamedTuple):
    """One index op's index whose padded rows are followed: they must be rows of the dim it indexes."""

    node: fx.Node
    index: fx.Node
    dim: int | None  # the indexed dim of the op's first operand (None: `take`, the tensor flattened)


def declare_fix(path: str, axis: int) -> str:
    """The fix for an input of per-row data left out of batch=: declare it Batched along `axis`."""
    top = path.split(".")[0].split("[")[0]
    return (
        f"declare it Batched(axis={axis}): batch={{..., {top!r}: fgraph.Batched(axis={axis})}}"
        + ("" if top == path else f" (or a prefix tree whose leaf at {path} is Batched(axis={axis}))")
        + "; its padded rows then hold the pad value (0 by default)"
    )


def index_bounds(gm: fx.GraphModule, flow: Flow) -> list[Bound]:
    """The index ops of a symbolic trace whose index tensors' padded rows the flow follows (row numbers, fills)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = _fx.op_name(node)
        for d, i in _indices(node, name):
            v = _fx.val(i)
            if not isinstance(v, torch.Tensor) or v.dtype in (torch.bool, torch.uint8) or v.is_floating_point():
                continue
            pad = flow.fact(i).pad
            if pad is not None and pad.kind in ("rows", "fill") and pad.dim in flow.axes.dims(v):
                found.append(Bound(node, i, d))
    return found


def _indices(node: fx.Node, name: str) -> list[tuple[int | None, fx.Node]]:
    if name in _ADVANCED and len(node.args) > 1 and isinstance(node.args[1], (list, tuple)):
        return [(d, i) for d, i in enumerate(node.args[1]) if isinstance(i, fx.Node)]
    if name == "embedding":
        return [(0, node.args[1])] if isinstance(node.args[1], fx.Node) else []
    if name == "take":
        return [(None, node.args[1])]
    if name in _BY_DIM:
        index = _fx.arg(node, _BY_DIM[name])
        ndim = max(_fx.val(node.args[0]).dim(), 1)
        return [(_fx.arg(node, "dim") % ndim, index)] if isinstance(index, fx.Node) else []
    return []


def _at(axes, size, bucket: int):
    """A traced size (int or SymInt) at `bucket`, as a number (None if the trace leaves it open)."""
    e = axes.at(size, bucket) if isinstance(size, torch.SymInt) else size
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else None


def _out_of_bounds(b: Bound, flow: Flow, bucket: int) -> tuple | None:
    """(the index the padded rows hold that is out of bounds, the indexed dim's size) at `bucket`, or None."""
    target, pad = _fx.val(b.node.args[0]), flow.fact(b.index).pad
    size = _at(flow.axes, target.numel() if b.dim is None else target.shape[b.dim], bucket)
    if size is None:
        return None
    if pad.kind == "rows":  # padded row j holds j + shift: the last one the most
        rows = _at(flow.axes, _fx.val(b.index).shape[pad.dim], bucket)
        high = None if rows is None else rows - 1 + pad.shift
        return (int(high), size) if high is not None and high >= size else None
    v = pad.shift
    return (v, size) if not (_lowest(b, size) <= v < size) else None


def _lowest(b: Bound, size: int) -> int:
    """The lowest valid index of a dim of `size` rows: ops that count -k from the end take down to -size."""
    return -size if _fx.op_name(b.node) in _WRAPS else 0


def holds(bounds: list[Bound], flow: Flow, bucket: int) -> bool:
    """Every followed index stays in bounds at `bucket` (a trace serves only such buckets)."""
    return all(_out_of_bounds(b, flow, bucket) is None for b in bounds)


def check_bounds(
    fname: str, bounds: list[Bound], flow: Flow, call: tuple[int, int | None], paths: dict, lifted: set
) -> None:
    """Refuse the first followed index out of bounds at the bucket traced, naming the input and the fix.

    call: (the bucket, the call's N: None or 0 where unknown, a capture's all-padding call); paths: placeholder ->
    key path; lifted: the key paths of tensors the function reads without taking them. An argument not declared
    Batched is named as per-row data left out of batch= where its indexed dim has the call's N rows (a table that
    is merely shorter than the bucket is not: its fix is the index's or the buckets')."""
    bucket, n = call
    for b in bounds:
        bad = _out_of_bounds(b, flow, bucket)
        if bad is None:
            continue
        value, size = bad
        pad = flow.fact(b.index).pad
        op, line = f"aten.{_fx.op_name(b.node)}", b.node.meta.get("line", "<unknown>")
        root, rdim = _root(b.node.args[0], b.dim)
        path = paths.get(root)
        dim = "the flattened" if b.dim is None else f"dim {b.dim} of the"
        what_t = f"{path} {list(_fx.val(root).shape)}" if path is not None else "a tensor the function makes"
        oob = f"out of bounds ({_DEVICE})"
        per_row = path is not None and path not in lifted and rdim is not None and (not n or size == n)
        if pad.kind == "rows" and per_row:
            raise SignatureError(
                f"fgraph.jit({fname}): {what_t} is not declared Batched, but its dim {rdim} has {size} rows while the "
                f"batched inputs are padded to the bucket {bucket}, and {op} at {line} indexes it by row numbers of "
                f"the padded batch axis: the padded rows read row {value}, {oob}",
                declare_fix(path, rdim),
            )
        if pad.kind == "rows":
            raise TraceError(
                f"fgraph.jit({fname}): {op} at {line} indexes {dim} {what_t} ({size} rows) by row numbers of the "
                f"padded batch axis: at the bucket {bucket} the padded rows read row {value}, {oob}",
                f"index only rows that exist for padded rows too (clamp the index to {size - 1}), or keep buckets "
                f"within {size} rows"
                + (f"; if its rows are the batch's, declare {path} Batched" if path and path not in lifted else ""),
            )
        rows = f"{op} at {line} uses as indices into {dim} {what_t} ({size} rows)"
        valid = f"[{_lowest(b, size)}, {size})"
        if pad.src is None:
            raise TraceError(
                f"fgraph.jit({fname}): the function fills the padded rows of an index with {value:g}, which {rows}: "
                f"{oob}",
                f"fill them with a valid index, in {valid}",
            )
        given = _leaf_pad(flow, pad.src)
        turned = "" if given == value else f" the function turns that pad into the index {value:g}, and"
        raise SignatureError(
            f"fgraph.jit({fname}): the padded rows of {pad.src} hold its pad {given:g};{turned} {rows}: {oob}",
            f"pad {pad.src} with a value that is a valid index there, in {valid}"
            + ("" if not turned else " after the function's arithmetic (the index it computes from the pad)")
            + f": Batched(pad=...) in batch= for {pad.src}",
        )


def _leaf_pad(flow: Flow, path: str):
    return next((s.pad for ph, s in flow.specs.items() if flow.paths.get(ph) == path), None)


def _root(node, dim: int | None) -> tuple[fx.Node, int | None]:
    """The tensor a value reads, through copies, casts and views, and the dim of it of the indexed dim's size."""
    size = _fx.val(node).shape[dim] if dim is not None else None
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        name = _fx.op_name(node) if isinstance(node.target, torch._ops.OpOverload) else ""
        if name not in _SAME | _MOVES | _RESHAPES | {"slice", "select"} or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    v = _fx.val(node)
    if size is None or not isinstance(size, int) or not isinstance(v, torch.Tensor):
        return node, None
    same = [d for d, s in enumerate(v.shape) if s == size]
    return node, (dim if dim in same else same[0] if same else None)
