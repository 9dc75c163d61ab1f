"""Random draws in a trace: ops that read torch's random generator.

They carry torch.Tag.nondeterministic_seeded: rand, randn, dropout, bernoulli, multinomial, ... A jitted call draws
another stream than eager under the same seed: padded rows draw too (a [bucket, ...] draw, not [N, ...]), and warm-up
and capture runs draw before the first result. So each such op is logged once at trace time with its line and listed by
explain.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import _fx
from ._mixing import Finding


def random_draws(gm: fx.GraphModule) -> list[Finding]:
    """The trace's random ops, one per source line."""
    found: dict[str, Finding] = {}
    for node in gm.graph.nodes:
        op = node.target
        if node.op == "call_function" and isinstance(op, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in op.tags:
                line = node.meta.get("line", "<unknown>")
                found.setdefault(
                    line, Finding(f"aten.{_fx.op_name(node)}", line, "draws from torch's random generator")
                )
    return list(found.values())
