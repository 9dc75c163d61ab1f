"""Modes: what a jitted function asks to capture, and how each signature's effective mode follows from it.

The modes are NONE, PIECEWISE, FULL, ...; a signature's effective mode is limited by the weakest capture support of the
signature's breaks."""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch.fx as fx

from . import _primitives as P
from ._errors import CaptureError


class Mode(enum.Enum):
    NONE = "NONE"  # no graphs
    PIECEWISE = "PIECEWISE"  # pieces captured, breaks eager between replays
    FULL = "FULL"  # the whole step one graph, breaks included
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"  # FULL for decode, NONE for mixed
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"  # FULL for decode, PIECEWISE for mixed

    def for_routine(self, decode: bool) -> Mode:
        """The runtime mode (NONE, PIECEWISE or FULL) asked for a routine."""
        if self is Mode.FULL_DECODE_ONLY:
            return Mode.FULL if decode else Mode.NONE
        if self is Mode.FULL_AND_PIECEWISE:
            return Mode.FULL if decode else Mode.PIECEWISE
        return self


class Weakest(NamedTuple):
    """The break with the weakest capture support seen so far: its level, why, and its primitive's name."""

    level: P.Support
    why: str
    primitive: str


def resolve_mode(fname: str, requested: Mode, routine, gm: fx.GraphModule, is_break) -> tuple[Mode, str]:
    """requested mode -> effective runtime mode for one signature, limited by the weakest break's support. routine:
    the call's routine static ("decode" is a decode routine), None where the function takes none (a mixed step).

    Full graphs need every break at ALWAYS (UNIFORM_DECODE suffices for decode signatures); otherwise the
    signature runs its piecewise program, which the full graph was wrapped around anyway. A primitive that is
    not a break sits inside a captured piece, so it must meet that bar in every graphed mode: else an error.
    """
    decode = routine == "decode"
    want = requested.for_routine(decode)
    need = P.Support.UNIFORM_DECODE if decode else P.Support.ALWAYS
    weakest = None
    for node in gm.graph.nodes:
        p = P.primitive_of(node)
        if p is None:
            continue
        level, why = P.support_of(node)
        if not is_break(node):
            if want is not Mode.NONE and level < need:
                raise CaptureError(
                    f"fgraph.jit({fname}): primitive {p.name!r} ({why}; support {level.name}) is not in "
                    f"breaks=, so it would run inside a {want.name} CUDA graph",
                    f"add {p.name!r} to breaks=[...] (or leave breaks=None), or use mode='NONE'",
                )
            continue
        if weakest is None or level < weakest.level:
            weakest = Weakest(level, why, p.name)
    if want is Mode.FULL and weakest is not None and weakest.level < need:
        w = weakest
        return Mode.PIECEWISE, f"FULL requested -> PIECEWISE ({w.why}; {w.primitive} supports {w.level.name})"
    if want is requested:
        return want, f"{requested.name} requested"
    if routine is None:
        return want, (
            f"{requested.name} requested -> {want.name}: a call without a routine static is a mixed step "
            "(mode='FULL' captures it whole)"
        )
    return want, f"{requested.name} requested -> {want.name} for the {'decode' if decode else 'mixed'} routine"
