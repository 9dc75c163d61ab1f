"""Inductor: the graph pieces between breaks compiled before capture, and the jit(compile=...) options.

Inductor: the graph pieces between breaks compiled before capture (norms, RoPE, activations and residual adds fused;
breaks untouched), and the jit(compile=...) options that configure it."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from .._errors import SignatureError


def inductor_options(fname: str, compile) -> dict | None:
    """jit(compile=...) -> None (no Inductor) or the Inductor config options to compile the pieces under."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise SignatureError(
            f"fgraph.jit({fname}): compile={compile!r} is neither a bool nor a dict of Inductor options",
            "pass compile=True, or e.g. compile={'coordinate_descent_tuning': True}",
        )
    from torch._inductor import config as inductor_config

    unknown = [k for k in compile if not isinstance(k, str) or not hasattr(inductor_config, k)]
    if unknown:
        raise SignatureError(
            f"fgraph.jit({fname}): compile= names {unknown}, which are not Inductor config "
            "options (torch._inductor.config)",
            "check the spelling against torch._inductor.list_options()",
        )
    # Inductor's config takes any value at patch time: a string for a bool option would only fail (or, truthy, be
    # read as True) inside a capture on the GPU. Options whose default is None or a container are not checked.
    for k, v in compile.items():
        kind = type(getattr(inductor_config, k))
        if kind in (bool, int, float, str) and not _of_kind(v, kind):
            raise SignatureError(
                f"fgraph.jit({fname}): compile={{{k!r}: {v!r}}}: Inductor's {k} takes a {kind.__name__}",
                f"pass a {kind.__name__}, e.g. compile={{{k!r}: {getattr(inductor_config, k)!r}}}",
            )
    return dict(compile)


def _of_kind(v, kind) -> bool:
    if kind is bool or isinstance(v, bool):  # (a bool is an int, but not a count)
        return kind is bool and isinstance(v, bool)
    return isinstance(v, (int, float)) if kind is float else isinstance(v, kind)


class Compiled(torch.nn.Module):
    """A graph piece compiled by Inductor on its first call (for the shapes of that call: one signature)."""

    def __init__(self, module: fx.GraphModule, options: dict):
        super().__init__()
        self.module, self.options, self.fn = module, options, None
        # a piece that returns one bare tensor (split_module's single output): compiled code returns a 1-list, which
        # the program would hand on as the output itself (a list, never sliced back to N)
        out = next(n for n in reversed(module.graph.nodes) if n.op == "output")
        self.single = not isinstance(out.args[0], (tuple, list))

    def forward(self, *args):
        if self.fn is None:
            from torch._inductor import config
            from torch._inductor.compile_fx import compile_fx

            # compile_fx rewrites the module it is given (its graph made to return a list, post-grad passes): give
            # it a copy, since the piece belongs to a trace that other signatures compile after this one
            module = fx.GraphModule(self.module, copy.deepcopy(self.module.graph))
            with config.patch({**self.options, "post_grad_custom_post_pass": _residual_adds_out_of_gemms()}):
                self.fn = compile_fx(module, list(args))
        out = self.fn(*args)
        return out[0] if self.single and isinstance(out, (tuple, list)) else out


def _residual_adds_out_of_gemms():
    """An Inductor post-grad pass for the pieces.

    Inductor folds `x + a @ b` into addmm(x, a, b) when the sum has a non-pointwise user, and a piece's residual
    stream always has one: the piece's output (the next piece's input, across a break). cuBLAS's addmm then first
    copies x into its output: a device copy per residual add, 2 per layer (a measurable share of a decode step:
    docs/performance.md), which torch.compile of the whole step, having no boundary there, does not make. Undone
    here for full-size addends (biases keep their GEMM epilogue): a plain mm, and the add as a pointwise op Inductor
    fuses into the neighbouring norm kernel."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    aten = torch.ops.aten

    class ResidualAddsOutOfGemms(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for node in list(graph.nodes):
                if node.op != "call_function" or node.target is not aten.addmm.default or len(node.args) != 3:
                    continue
                inp, a, b = node.args
                val = node.meta.get("val")
                if (
                    node.kwargs.get("beta", 1) != 1
                    or node.kwargs.get("alpha", 1) != 1
                    or val is None
                    or not isinstance(inp, fx.Node)
                    or getattr(inp.meta.get("val"), "shape", None) != val.shape
                ):
                    continue
                with graph.inserting_before(node):
                    mm = graph.call_function(aten.mm.default, (a, b))
                    add = graph.call_function(aten.add.Tensor, (inp, mm))
                mm.meta.update(node.meta)
                add.meta.update(node.meta)
                node.replace_all_uses_with(add)
                graph.erase_node(node)

        def uuid(self):
            return "fgraph.residual_adds_out_of_gemms.v1"

    return ResidualAddsOutOfGemms()
