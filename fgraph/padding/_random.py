"""Random draws in a trace: ops that read torch's random generator.

They carry torch.Tag.nondeterministic_seeded: rand, randn, dropout, bernoulli, multinomial, ... A jitted call draws
another stream than eager under the same seed: padded rows draw too (a [bucket, ...] draw, not [N, ...]), and warm-up
and capture runs draw before the first result. So each such op is logged once at trace time with its line and listed by
explain. An op whose arguments turn its randomness off (dropout with p=0 or train=False, attention with dropout_p=0:
nanoGPT in eval) draws nothing: `OFF` says when, per op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from .. import _fx
from ._mixing import Finding


def _no_dropout(a: dict) -> bool:  # dropout's composites return the input itself then, without a draw
    return a.get("p") == 0 or a.get("train") is False


def _not_training(a: dict) -> bool:  # a train flag off: native_dropout returns its input, rrelu the mean slope
    return a.get("train", a.get("training")) is False


def _no_attention_dropout(a: dict) -> bool:  # the fused attention kernels take a seed only when dropout_p > 0
    return a.get("dropout_p") == 0


def _no_rnn_dropout(a: dict) -> bool:  # dropout between an RNN's layers
    return a.get("dropout") == 0 or a.get("train") is False


_aten = torch.ops.aten
# op (its overload packet) -> when its arguments turn its randomness off. native_dropout(p=0, train=True) still
# advances the generator, as bernoulli(p=0) does: those stay draws
OFF: dict[object, Callable[[dict], bool]] = {
    **dict.fromkeys(
        [_aten.dropout, _aten.alpha_dropout, _aten.feature_dropout, _aten.feature_alpha_dropout], _no_dropout
    ),
    **dict.fromkeys([_aten.native_dropout, _aten.rrelu_with_noise, _aten.rrelu_with_noise_], _not_training),
    **dict.fromkeys(
        [
            getattr(_aten, name)
            for name in (
                "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_fused_attention_overrideable",
                "_scaled_dot_product_attention_math_for_mps",
                "_flash_attention_forward",
                "_efficient_attention_forward",
            )
            if hasattr(_aten, name)
        ],
        _no_attention_dropout,
    ),
    **dict.fromkeys(
        [_aten.lstm, _aten.gru, _aten.rnn_tanh, _aten.rnn_relu, _aten._cudnn_rnn, _aten.miopen_rnn], _no_rnn_dropout
    ),
}
if hasattr(_aten, "rrelu_with_noise_functional"):
    OFF[_aten.rrelu_with_noise_functional] = _not_training


def draws(node: fx.Node) -> bool:
    """Whether the node reads torch's random generator: a seeded op whose arguments leave its randomness on."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    off = OFF.get(op.overloadpacket)
    return off is None or not off(_fx.arguments(node))


def random_draws(gm: fx.GraphModule) -> list[Finding]:
    """The trace's random ops, one per source line."""
    found: dict[str, Finding] = {}
    for node in gm.graph.nodes:
        if draws(node):
            line = node.meta.get("line", "<unknown>")
            found.setdefault(line, Finding(f"aten.{_fx.op_name(node)}", line, "draws from torch's random generator"))
    return list(found.values())
