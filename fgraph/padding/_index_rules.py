"""The padding check's rules on indexing along a batch axis.

The rules of fgraph/padding/_mixing.py, over what fgraph/padding/_index_flow.py follows of index tensors: an index that
can be negative reads or writes from the end of the padded axis (a padded row); a scatter by an index whose padded rows
point at real rows writes padded rows' values into them (a pad of 0 writes row 0). A scatter is silent where every
padded index row is shown to land in a padded row: row numbers (an arange over the batch, shifted up), a fill of -1 (the
last row) into a tensor of the index's length, or ramp-padded offsets less one writing one value (the last-token flags
of a packed batch).
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from .. import _fx
from ._index_flow import INF, Flow

# ops that take a negative index as counting from the end (the others raise on one, eager and jitted alike)
_WRAP_READS = {"index", "_unsafe_index", "take"}
_WRAP_WRITES = {"index_put", "index_put_", "_unsafe_index_put", "index_fill", "index_fill_"}
_ADVANCED = {"index", "_unsafe_index", "index_put", "index_put_", "_unsafe_index_put"}  # one index per leading dim
_POSITIONAL = {"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"}
_UNFOLLOWED = "hold values the check does not follow: they may write real rows"


def _indices(node: fx.Node, name: str, ndim: int) -> list[tuple[int | None, fx.Node]]:
    """(dim of the indexed tensor, index tensor) per index an op takes; dim None: the tensor flattened (take).

    Boolean masks are left out (an index by a mask has a shape that depends on the data, refused by the trace)."""
    if name in _ADVANCED:
        idx = [i if isinstance(i, fx.Node) else None for i in node.args[1]]
        if any(i is not None and _fx.val(i).dtype in (torch.bool, torch.uint8) for i in idx):
            return []
        return [(d, i) for d, i in enumerate(idx) if i is not None]
    if name == "take":
        return [(None, node.args[1])]
    index = _fx.arg(node, "index")
    return [(_fx.arg(node, "dim") % max(ndim, 1), index)] if isinstance(index, fx.Node) else []


def index_finding(node: fx.Node, name: str, flow: Flow) -> tuple[set, str] | None:
    """Where an op indexing a tensor along its batch axis lets padding in, or None.

    An index that can be negative (it reads or writes from the end of the padded axis: a padded row), or a scatter
    whose padded index rows point at real rows: (the batch symbols involved, what it does)."""
    axes, target = flow.axes, _fx.val(node.args[0])
    tdims = axes.dims(target)
    if not tdims:
        return None  # (scatters into a tensor without the batch axis have a rule of their own)
    pairs = _indices(node, name, target.dim())
    if name in _WRAP_READS or name in _WRAP_WRITES:
        for d, i in pairs:
            low = flow.fact(i).low if d is None or d in tdims else 0
            if low < 0:
                syms = set().union(*(axes.syms_of(target.shape[q]) for q in (tdims if d is None else [d])))
                how = f"an index as low as {low:g}" if low > -INF else "an index computed here, not bounded below,"
                verb = "counts" if name in _WRAP_READS else "writes"
                where = "" if low > -INF else " where negative"
                return syms, f"{how} {verb} from the end of the padded batch axis{where} (a padded row)"
    batched = [(d, i, _fx.val(i)) for d, i in pairs if axes.dims(_fx.val(i))]
    if name in _WRAP_READS or not batched:
        return None
    syms = set().union(*(axes.syms_of(v.shape[q]) for _, _, v in batched for q in axes.dims(v)))
    sizes = {axes.canon(v.shape[q]) for _, _, v in batched for q in axes.dims(v)}
    reasons = [
        _lands(flow, d, i, v, target, _same_value(node, name, axes), name in _WRAP_WRITES, name in _POSITIONAL)
        if len(sizes) == 1
        else _UNFOLLOWED  # index rows padded to different batch sizes
        for d, i, v in batched
    ]
    if None in reasons:  # one index keeps every padded position among the padded rows
        return None
    return syms, f"scatters along the batch axis by an index whose padded rows {reasons[0]}"


def _lands(flow: Flow, d: int, index: fx.Node, v, target, same: bool, wraps: bool, positional: bool) -> str | None:
    """None if the padded rows of an index along `d` of `target` write only its padded rows, or why not."""
    axes, pad = flow.axes, flow.fact(index).pad
    if positional and d not in axes.dims(v):
        # scatter_(1, ids, w) over [N, k]: each index row writes its own row of the target, a padded one if the
        # target has the index's batch size there
        dims = axes.dims(v)
        if all(q < target.dim() and axes.canon(target.shape[q]) == axes.canon(v.shape[q]) for q in dims):
            return None
        return "write their own rows of a batch axis the trace does not tie to the target's: real rows there"
    if d not in axes.dims(target):
        return "write along a dim without the batch axis, into real rows"
    if pad is None or pad.dim not in axes.dims(v):
        return _UNFOLLOWED
    size, rows = axes.canon(target.shape[d]), axes.canon(v.shape[pad.dim])
    if pad.kind == "fill":
        if wraps and pad.shift == -1 and _const(size - rows) is not None:
            return None  # -1 writes the last row, a padded one whenever the index (of the same length) has any
        where = "a real row" if pad.shift >= 0 else "not a padded row in every call"
        return f"hold {pad.shift:g} (their pad): they write row {pad.shift:g} of the batch axis, {where}"
    if pad.kind == "rows":
        gap = _const(rows + pad.shift - size)
        if gap is not None and gap >= 0:
            return None  # row j (a padded one) writes row j + shift >= the call's rows of the target
        if gap is None:
            return "hold row numbers over a batch size the trace does not tie to the target's: they may write real rows"
        rows = "row" if gap == -1 else f"{-gap} rows"
        return f"hold row numbers that stop {-gap} short of the target's: they write its last real {rows}"
    # ramp offsets end at the call's rows of the axis they offset (Batched's contract) and climb to the bucket:
    # shifted by -1 a padded one points at a padded row, or, when the call fills the bucket, at the last real row
    # (as the last real offset does: harmless for one value written to every row)
    bucket = all(axes.at(sympy.sympify(size), b) == b for b in (7, 63))
    if not bucket:
        return "hold ramp-padded offsets, into a tensor not as long as the bucket: they may write real rows"
    if pad.first == 1 and (pad.shift >= 0 or (pad.shift == -1 and same)):
        return None
    if pad.first == 1 and pad.shift == -1:
        return (
            "hold ramp-padded offsets - 1: when the call fills the bucket they write its last real row, with values "
            "of their own"
        )
    if pad.first + pad.shift < 0:  # below the call's rows of the target
        return f"hold ramp-padded offsets {pad.shift:+g}: they write real rows of the batch axis"
    return (  # `offsets[:-1]`: from the last real offset up to the bucket itself, past the end of the axis
        "hold ramp-padded offsets up to the bucket: one points past the end of the batch axis (an index error eager "
        "does not raise)"
    )


def _same_value(node: fx.Node, name: str, axes) -> bool:
    """Whether a scatter writes one value at every index row, and overwrites.

    One value: a scalar, or values broadcast over the rows. Then two index rows pointing at one row write the same
    thing."""
    if name in ("index_fill", "index_fill_"):
        return True
    if name in ("index_put", "index_put_", "_unsafe_index_put"):
        return not _fx.arg(node, "accumulate", False) and not axes.dims(_fx.val(node.args[2]))
    return name in ("scatter", "scatter_") and node.target._overloadname == "value"


def _const(e) -> int | None:
    e = sympy.sympify(e)
    return int(e) if e.is_Integer else None
