"""fgraph.repeated: trace a function called many times alike (a decoder layer) once, and copy its ops for the rest.

make_fx dispatches every op of every layer through fake tensors and symbolic shapes; for a deep model that is most of a
trace, the same ops once per layer (docs/performance.md). Under tracing, the first call of a repeated function with a
given input signature (tree structure, non-tensor leaves, and each tensor's shape, stride, dtype, device and aliasing)
is traced as usual and its new FX nodes kept as a template; a later call with the same signature copies them, rewired to
its own inputs, and gets fresh fake outputs. What the copies skip is only tracing work: the graph is the one a full
trace would give (the guards too: the same ops on the same shapes). Outside tracing (eager, disable_jit, torch.compile)
the function is just called.

The rule that makes copying sound: the function reads tensors only through its arguments. A template op that
uses a tensor from outside (a closure over `params.layers[i]`) would be copied with layer 0's tensor, so it is
refused when the template is made. Sizes from outside are fine (a symbolic batch size is one value everywhere).
Python values from outside that differ per call (a per-layer scale read from a global or closure) cannot be told
from constants in the code, so they are copied from the first call: pass them as arguments (they are then part
of the template's key). Pinned in tests/test_footguns.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental import proxy_tensor as pt

from .._errors import FgraphError, TraceError
from .._pytree import tree_flatten
from .._signature import static_key
from ._compiling import dynamo_compiling
from ._errors import op_label

stats = {"traced": 0, "copied": 0}  # calls of repeated functions under tracing: traced as usual / copied
_SIZES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _dims(xs) -> tuple:
    """Sizes as expressions, with what the trace has learnt so far substituted.

    Such as a size symbol of an argument found equal to another's by an op's check."""
    return tuple(d.node.shape_env.replace(d.node.expr) if isinstance(d, torch.SymInt) else d for d in xs)


def _signature(leaves: list) -> tuple:
    """What must be equal for a call to reuse a template: each tensor's layout and identity pattern, the rest."""
    first: dict[int, int] = {}
    return tuple(
        (_dims(x.shape), _dims(x.stride()), x.dtype, x.device, first.setdefault(id(x), i))
        if isinstance(x, torch.Tensor)
        else static_key(x)  # by type and value, a float by its hex: 0.0 and -0.0 apart (copysign, 1 / x)
        for i, x in enumerate(leaves)
    )


class _Template:
    """What one traced call added to the graph.

    Its FX nodes, its inputs' and outputs' nodes (None / the value for non-tensors), and its
    outputs' fake tensors (the layout of every copy's outputs)."""

    def __init__(self, fn: Callable, inputs: list, nodes: list[fx.Node], outputs: list, out_spec, fakes: list):
        self.inputs, self.nodes, self.outputs, self.out_spec, self.fakes = inputs, nodes, outputs, out_spec, fakes
        own = set(nodes) | {n for n in inputs if n is not None}
        for node in nodes:  # refuse tensors read from outside the arguments (module docstring)
            for used in node.all_input_nodes:
                if used not in own and not isinstance(used.meta.get("val"), _SIZES):
                    raise TraceError(
                        f"fgraph.repeated({getattr(fn, '__qualname__', fn)}): {op_label(node)} at "
                        f"{node.meta.get('line')} reads a tensor from outside the function's arguments ("
                        + ("an input of the jitted function" if used.op == "placeholder" else op_label(used))
                        + ")"
                        "; copies would read the same tensor",
                        "pass every tensor the function reads as an argument",
                    )

    def copy(self, tracer, leaves: list):
        """The template's nodes again, on these inputs; the outputs (as tensors the trace follows)."""
        env = {t: pt.get_proxy_slot(x, tracer).proxy.node for t, x in zip(self.inputs, leaves) if t is not None}
        graph = tracer.graph
        for node in self.nodes:
            env[node] = graph.node_copy(node, lambda n: env.get(n, n))
        out = []
        for t, fake in zip(self.outputs, self.fakes):
            if not isinstance(t, fx.Node):
                out.append(t)  # a non-tensor output (a Python value of the signature)
            elif t in self.inputs:
                out.append(leaves[self.inputs.index(t)])  # an argument handed back: the same object
            else:
                with pt.disable_proxy_modes_tracing():  # a fresh fake tensor of the output's layout (no node)
                    new = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device)
                pt.track_tensor_tree(new, fx.Proxy(env[t], tracer), constant=None, tracer=tracer)
                out.append(new)
        return pytree.tree_unflatten(out, self.out_spec)


def repeated(fn: Callable) -> Callable:
    """`fn`, traced once per input signature under fgraph's tracing and copied for later calls (module docstring).

    For functions called many times with inputs of the same shapes, such as the layers of a model; `fn` must read
    tensors only through its arguments (checked) and return a pytree of tensors."""
    if not callable(fn):
        raise FgraphError(
            f"fgraph.repeated: expected a function, got {fn!r}", "decorate the layer function: @fgraph.repeated"
        )

    @functools.wraps(fn)
    def call(*args, **kwargs):
        mode = None if dynamo_compiling() else pt.get_proxy_mode()
        if mode is None:
            return fn(*args, **kwargs)
        tracer = mode.tracer
        templates = tracer.__dict__.setdefault("fgraph_templates", {})  # they live and die with this trace's graph
        leaves, spec = tree_flatten((args, kwargs))
        try:
            key = (fn, spec, _signature(leaves))
            tpl = templates.get(key)
        except TypeError:  # an unhashable non-tensor argument: no signature, so no copies
            return fn(*args, **kwargs)
        if tpl is not None:
            stats["copied"] += 1
            return tpl.copy(tracer, leaves)
        stats["traced"] += 1

        def node_of(x):  # the FX node of a tensor the trace follows; False for one it does not (a real constant)
            slot = pt.get_proxy_slot(x, tracer, None)
            return False if slot is None else slot.proxy.node

        inputs = [node_of(x) if isinstance(x, torch.Tensor) else None for x in leaves]
        if False in inputs:  # no template: its copies could not be rewired to such an argument
            return fn(*args, **kwargs)
        last = tracer.graph._root.prev  # the graph's last node before the call
        out = fn(*args, **kwargs)
        nodes, node = [], last.next
        while node is not tracer.graph._root:
            nodes.append(node)
            node = node.next
        flat, out_spec = tree_flatten(out)
        outputs = [node_of(x) if isinstance(x, torch.Tensor) else x for x in flat]
        if any(o is False for o in outputs):
            return out
        tpl = _Template(
            fn, inputs, nodes, outputs, out_spec, [x if isinstance(x, torch.Tensor) else None for x in flat]
        )
        templates[key] = templates[(fn, spec, _signature(leaves))] = tpl  # also as the next call will see it
        return out

    return call
