"""A jitted call and autograd: its outputs carry no history (a backward through them is an error), and a torch.func
transform over it is refused (`check_transforms`); both raise fgraph errors naming the fix."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch._C import _functorch

from .._errors import FgraphError
from ._callable import Lifted


class _InferenceOnly(torch.autograd.Function):
    """An output of a jitted call whose function reads tensors that require grad, made with grad mode on.

    As in eager, it requires grad; unlike eager, a backward through it is refused: the call ran captured graphs
    over the parameters read as data, so there is no gradient to give them (torch would say only that "element 0 of
    tensors does not require grad")."""

    @staticmethod
    def forward(ctx, x, anchor, fname):  # anchor: a leaf that requires grad, so the output does too
        ctx.fname = fname
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise FgraphError(
            f"fgraph.jit({ctx.fname}): a backward through the output of a jitted call; a jitted call is inference "
            "only (its graphs read the parameters as data), so no gradient reaches them",
            "train with the plain function or module (fgraph.disable_jit(), or call the module itself), and call "
            "the jitted one for inference under torch.no_grad()",
        )


_ANCHOR = torch.zeros((), requires_grad=True, device="cpu")


def refuse_backward(fname: str, lifted: Lifted, out, keep: tuple = ()):
    """The call's outputs, each floating tensor marked so that a backward through it is an fgraph error, when grad
    mode is on and the function read tensors that require grad (`lifted.grads`); `keep`: objects handed back as
    they are (donated state the function returns)."""
    if not (lifted and lifted.grads and torch.is_grad_enabled()):
        return out
    kept = {id(k) for k in keep}
    return pytree.tree_map(
        lambda t: (
            _InferenceOnly.apply(t, _ANCHOR, fname) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        ),
        out,
        is_leaf=lambda x: id(x) in kept,
    )


def check_transforms(fname: str) -> None:
    """Refuse vmap / grad / jacrev (torch.func) over a jitted call.

    Its inputs would be functorch wrappers, which a captured graph cannot see through."""
    if _functorch.peek_interpreter_stack() is not None:  # (torch.compile never gets here: Jitted.__call__)
        raise FgraphError(
            f"fgraph.jit({fname}): called under a torch.func transform (vmap, grad, jacrev, ...); a jitted "
            "call replays captured graphs, which a transform cannot batch or differentiate",
            "jit the transformed plain function instead (fgraph.jit(torch.func.vmap(f)) for the f you jitted), or "
            "call the plain function under the transform",
        )
