"""Helpers over fgraph's one IR, torch.fx graphs of aten ops.

Op names, arguments, write targets and the order of writes, views' bases, and where library code lives (a user's line
is the first frame outside it)."""

from __future__ import annotations

import bisect
import os
import sys
import sysconfig
import types
from typing import Any

import torch
import torch.fx as fx

_PATHS = sysconfig.get_paths()  # where the standard library and installed packages live (not sys.prefix itself)
# torch's and fgraph's own code: a frame in neither is the user's line in an error or a finding
FRAMEWORK_DIRS = (os.path.dirname(torch.__file__), os.path.join(os.path.dirname(__file__), ""))
# every library, the standard library and installed packages too: a function here is not user code to scan for
# the tensors it reads (fgraph.trace's lifting)
LIBRARY_DIRS = tuple(
    os.path.join(d, "")
    for d in {*FRAMEWORK_DIRS} | {_PATHS.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if d
)


def in_framework(filename: str) -> bool:
    """Whether a frame's file is torch's or fgraph's (or frozen importlib's) rather than the user's."""
    return filename.startswith(FRAMEWORK_DIRS) or "<frozen" in filename


def user_code(fn) -> bool:
    """A Python function of the user's (not torch's, fgraph's, the standard library's or an installed package's)."""
    code = getattr(fn, "__code__", None)
    return code is not None and not code.co_filename.startswith(LIBRARY_DIRS)


def user_module(m: types.ModuleType) -> bool:
    """A module of the user's: its file outside torch, fgraph, the standard library and installed packages, or none
    (made in code), built-in modules aside."""
    f = getattr(m, "__file__", None)
    return not f.startswith(LIBRARY_DIRS) if f is not None else m.__name__ not in sys.builtin_module_names


def op_name(node: fx.Node) -> str:
    """An op's short name.

    aten.mean.dim -> "mean", fgraph.attention.default -> "attention", operator.getitem -> "getitem"."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def arg(node: fx.Node, name: str, default=None):
    """An aten node's argument by its schema name, passed by position or keyword, else the schema's default."""
    schema = node.target._schema
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, a.default_value if a.has_default_value() else default)
    return default


def arguments(node: fx.Node) -> dict:
    """An op node's arguments by schema name, defaults filled in (tensors as fx Nodes)."""
    out = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not a.kwarg_only:
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def val(x):
    """The traced value of a node (of a multi-output op: its first tensor), else None."""
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return v[0] if isinstance(v, (tuple, list)) and v and isinstance(v[0], torch.Tensor) else v


def shape(v) -> tuple:
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _batch_norm_writes(node: fx.Node) -> list:
    # (input, weight, bias, running_mean, running_var, training, ...): the running stats, when training
    return [node.args[3], node.args[4]] if len(node.args) > 5 and node.args[5] else []


# ops that write arguments their schemas do not annotate as written (`Tensor? running_mean`, not `Tensor(a!)`):
# op -> the argument nodes a call writes. Without this, BatchNorm's running statistics in training were updated
# unseen: by the warm-up and the capture too, and with no donate= asked for.
_UNANNOTATED_WRITES = {
    op: _batch_norm_writes
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
    if (op := getattr(getattr(torch.ops.aten, name, None), "default", None)) is not None
}


def write_targets(node: fx.Node) -> list[fx.Node]:
    """The argument nodes an op writes in place (from its schema's alias annotations, and _UNANNOTATED_WRITES)."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return []
    rule = _UNANNOTATED_WRITES.get(t)
    out = [x for x in rule(node) if isinstance(x, fx.Node)] if rule is not None else []
    for i, a in enumerate(t._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            for x in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(x, fx.Node):
                    out.append(x)
    return out


def base_of(node: Any) -> Any:
    """Follow view ops back to the tensor they view (a placeholder, or the node that allocated it)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        rets = node.target._schema.returns
        if rets and rets[0].alias_info is not None and not rets[0].alias_info.is_write and node.args:
            node = node.args[0]
        else:
            break
    return node


class WriteOrder:
    """Each node's position in the graph before a rewrite, and the positions of the nodes that write in place: a
    rewrite that reads a value later than the graph did (a matmul's input at the activation, or at the group's first
    matmul for a later one's; the KV cache at SDPA rather than at its repeat's copy) must not move the read past a
    write."""

    def __init__(self, gm: fx.GraphModule):
        self.at = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.writes = [i for n, i in self.at.items() if write_targets(n)]

    def quiet(self, nodes) -> bool:
        """Whether no node writes in place strictly between the first and the last of `nodes`."""
        lo, hi = min(self.at[n] for n in nodes), max(self.at[n] for n in nodes)
        return bisect.bisect_right(self.writes, lo) == bisect.bisect_left(self.writes, hi)


def own_top_level(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a program's top level with its own submodule table that shares the generated code.

    Piece runners (a signature's, or a compiled piece's parts) are set per copy. fx.GraphModule(gm, graph) would
    generate and compile the top level's Python again for each, which would dominate capture time
    (docs/performance.md)."""
    m = object.__new__(type(gm))
    m.__dict__.update(gm.__dict__)
    m.__dict__["_modules"] = dict(gm._modules)
    return m


def _frozen(x):
    """x as a hashable key: Nodes as themselves, containers as tuples, and every other value with its type (so that
    0.0 and -0.0, or 1 and 1.0, stay apart)."""
    if isinstance(x, fx.Node):
        return x
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_frozen, x))
    if isinstance(x, dict):
        return ("dict", *((k, _frozen(v)) for k, v in sorted(x.items())))
    if isinstance(x, torch.Tensor):  # (a constant: by identity, as its repr elides its values)
        return ("tensor", id(x))
    return (type(x).__name__, repr(x))


def share_repeats(gm: fx.GraphModule) -> int:
    """Compute once what gm computes again: a call of the same op on the same arguments as an earlier node reads that
    node instead (a Hugging Face decode converts its one boolean mask to an additive bias at every layer's SDPA).
    Only where nothing can tell: no random op, no value that a node writes in place (itself, a view of it, or what
    it reads: so no op that writes either) on either side, and none that gm returns, itself or through a view (two
    outputs stay two tensors). A shared value is then made as early as its inputs allow, so that when gm is cut into
    parts, every part that reads it finds it made before the first (an MoE's index `arange` first made in layer 0's
    MLP, after the first cut, would make the part with it differ from every later layer's). In place; the number of
    nodes merged."""
    written = {base_of(x) for n in gm.graph.nodes for x in write_targets(n)}
    returned = {base_of(x) for n in gm.graph.nodes if n.op == "output" for x in n.all_input_nodes}
    first, shared, merged = {}, set(), 0
    for n in list(gm.graph.nodes):
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in t.tags or base_of(n) in written or base_of(n) in returned:
            continue
        if any(base_of(a) in written for a in n.all_input_nodes):
            continue
        key = (t, _frozen(n.args), _frozen(n.kwargs))
        if key in first:
            n.replace_all_uses_with(first[key])
            gm.graph.erase_node(n)
            shared.add(first[key])
            merged += 1
        else:
            first[key] = n
    inputs = [m for m in gm.graph.nodes if m.op == "placeholder"][-1:]
    for n in [n for n in gm.graph.nodes if n in shared]:  # (in order: a shared value's shared inputs moved first)
        at = {m: i for i, m in enumerate(gm.graph.nodes)}
        after = max((*n.all_input_nodes, *inputs), key=at.get, default=None)
        if after is not None and at[after] < at[n] - 1:  # (nothing it reads is written: it passes no write it sees)
            after.append(n)
    if merged:
        gm.recompile()
    return merged
