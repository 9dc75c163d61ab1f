"""Split a trace at its break nodes into pieces: the program that PIECEWISE captures piece by piece.

The split keeps the original node order (mutations make reordering unsafe, as vLLM notes) and keeps
consecutive breaks, and the getitems of a break's results, together with that break.
"""

from __future__ import annotations

import collections
import operator
from typing import NamedTuple

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from .. import _primitives as P
from .._fx import op_name


class Piece(NamedTuple):
    index: int
    name: str  # the submodule's name in the program ("submod_1")
    is_break: bool
    module: fx.GraphModule
    ops: tuple[str, ...]  # op names, in order
    inputs: tuple[str, ...]  # key paths of function inputs, or %names of values made by earlier pieces
    outputs: tuple[str, ...]
    support: tuple[P.Support, str] | None  # for a break piece: its weakest primitive's support and why


class Program(NamedTuple):
    module: fx.GraphModule  # top level calls the pieces in order: the one interpreter is its forward
    pieces: tuple[Piece, ...]


def split(gm: fx.GraphModule, is_break, input_names: dict[str, str]) -> Program:
    """Cut `gm` before and after every run of break nodes. input_names: placeholder name -> key path."""
    part, pid, prev_break, break_parts = {}, 0, False, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        brk = node.op == "call_function" and is_break(node)
        follows_break = (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and part.get(node.args[0]) in break_parts
        )
        if follows_break:
            part[node] = part[node.args[0]]
            continue
        if brk != prev_break and part:
            pid += 1
        part[node], prev_break = pid, brk
        if brk:
            break_parts.add(pid)
    if not part:  # a function of no ops still gets one (empty) piece
        return Program(gm, ())
    split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    exported = collections.defaultdict(list)  # partition -> its tensors used by later pieces or the output
    shape_math = {n.name for n in gm.graph.nodes if _is_shape_math(n)}  # symbolic sizes passed between pieces
    for n, k in part.items():
        if n.name not in shape_math and any(u.op == "output" or part.get(u) != k for u in n.users):
            exported[k].append(n)
    pieces = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split_gm, node.target)
        calls = [
            n
            for n in sub.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem and not _is_shape_math(n)
        ]
        is_brk = int(node.target.rsplit("_", 1)[1]) in break_parts
        support = (  # (None for a cut at an op that is no primitive: compiled pieces' parts, fgraph.compile)
            min((P.support_of(n) for n in calls if P.primitive_of(n)), key=lambda s: s[0], default=None)
            if is_brk
            else None
        )
        ins = tuple(
            input_names.get(n.name, f"%{n.name}")
            for n in sub.graph.nodes
            if n.op == "placeholder" and n.name not in shape_math
        )
        outs = tuple(f"%{n.name}" for n in exported.get(int(node.target.rsplit("_", 1)[1]), ()))
        pieces.append(
            Piece(len(pieces), node.target, is_brk, sub, tuple(op_name(n) for n in calls), ins, outs, support)
        )
    return Program(split_gm, tuple(pieces))


def _is_shape_math(node: fx.Node) -> bool:
    """Size bookkeeping of a symbolic trace (sym_size, arithmetic on sizes), not work on the device."""
    return isinstance(node.meta.get("val"), (torch.SymInt, int)) and node.op != "placeholder"


def breaks_filter(breaks: list[str] | None):
    """Which nodes cut the graph: every registered primitive, or only those the user named."""

    def is_break(node):
        p = P.primitive_of(node)
        return p is not None and (breaks is None or p.name in breaks)

    return is_break


def op_summary(ops: tuple[str, ...], k: int = 4) -> str:
    c = collections.Counter(ops)
    return ", ".join(f"{n} x{m}" if m > 1 else n for n, m in c.most_common(k)) + (", ..." if len(c) > k else "")
