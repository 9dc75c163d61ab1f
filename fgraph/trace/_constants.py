"""Host constants made part of a device program, as jax.jit embeds the constants a function creates.

A function on CUDA may make a tensor on the host and move it over: `torch.tensor([1.0, 2.0]).to(x.device)`,
`torch.arange(4)` used as an index, `x + torch.tensor(2.0)` (eager CUDA ops take CPU 0-dim tensors as they are). Eager
copies it to the device on every call. In a captured graph a host tensor would be read once, at capture, or the
copy would not capture at all (pageable memory). Its values come from the function's source, not from its inputs,
so fgraph makes it on the device once, at trace time, and the program reads it there."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

_LIFT = torch.ops.aten.lift_fresh_copy.default


def _on_device(val: FakeTensor, device: torch.device) -> FakeTensor:
    """A traced (fake) tensor's twin on `device`: its shape, strides and dtype."""
    meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    return FakeTensor(val.fake_mode, meta, device)


def _is_aten(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten"


def _constant(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A get_attr of a real host tensor whose values the source fixes.

    `torch.tensor(data)` traces as a constant the program only copies (lift_fresh_copy): made anew by every call, so
    its values are the source's. A 0-dim one is taken as it is (a scalar). Another tensor the function reaches and
    make_fx keeps as a constant is the caller's, and may change between calls: it is not embedded."""
    value = getattr(gm, node.target, None)
    if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
        return False
    return value.dim() == 0 or all(u.target is _LIFT for u in node.users)


def _host_ops(gm: fx.GraphModule) -> list[fx.Node]:
    """The host constants and the host ops on them alone (factories too), in program order."""
    host: list[fx.Node] = []
    on_host: set[fx.Node] = set()
    for node in gm.graph.nodes:
        val, op = node.meta.get("val"), node.target
        if not (isinstance(val, FakeTensor) and val.device.type == "cpu"):
            continue
        if node.op == "get_attr" and _constant(gm, node):
            host.append(node)
        elif (
            node.op == "call_function"
            and isinstance(op, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in op.tags
            and all(n in on_host for n in node.all_input_nodes)
        ):
            host.append(node)
        else:
            continue
        on_host.add(node)
    return host


def _movable(host: list[fx.Node]) -> list[fx.Node]:
    """The host nodes that may move: not one that a use outside them needs on the host (the output; a primitive,
    which may read it on the host), nor any host node such a one is made from (`check` then refuses those)."""
    on_host = set(host)
    stays = {n for n in host if any(u not in on_host and not _is_aten(u) for u in n.users)}
    for node in reversed(host):  # (program order: a node's host inputs come before it)
        if node in stays:
            stays.update(i for i in node.all_input_nodes if i in on_host)
    return [n for n in host if n not in stays]


def embed_host_constants(gm: fx.GraphModule, device: str) -> None:
    """Make the host constants a `device` program creates, and the host ops on them alone, device ops.

    A constant's values move to the device once, here; a factory (torch.arange(4), torch.full((), 1.5)) is made there;
    an op on such tensors alone runs there. Tensors take part in type promotion alike wherever they live, and ops
    that take host tensors beside device ones (0-dim operands, index tensors) take device ones too, so the results are
    eager's. Left alone (refused by `check` as before): host tensors computed from inputs, random draws, a host
    tensor the function returns (eager returns it on the host) or passes to a primitive (which may read it on the
    host), and the caller's tensors (see _constant)."""
    if device == "cpu":
        return
    host = _movable(_host_ops(gm))
    if not host:
        return
    dev = torch.device(device)
    for node in host:
        value = getattr(gm, node.target) if node.op == "get_attr" else None
        if value is not None and value.dim() == 0:  # a scalar: a fill of its value, no tensor kept
            with gm.graph.inserting_before(node):
                made = gm.graph.call_function(
                    torch.ops.aten.full.default, ([], value.item()), {"dtype": value.dtype, "device": dev}
                )
            made.meta.update(node.meta)
            made.meta["val"] = _on_device(node.meta["val"], dev)
            node.replace_all_uses_with(made)
            gm.graph.erase_node(node)
            continue
        if value is not None and value.device != dev:  # (one attribute may back several get_attr nodes)
            setattr(gm, node.target, value.to(dev))
        elif "device" in node.kwargs:  # a factory: torch.arange(4), torch.zeros(()), .to("cpu")
            node.kwargs = {**node.kwargs, "device": dev}
        node.meta["val"] = _on_device(node.meta["val"], dev)
    kept = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in {n.target for n in host if n.op == "get_attr"} - kept:  # (scalars now made by a fill)
        delattr(gm, name)
    gm.recompile()
