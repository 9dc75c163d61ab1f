"""One-query SDPA calls in a CUDA piece, rewritten into `fgraph::sdpa_decode` before Inductor compiles it.

`F.scaled_dot_product_attention` traces to the backend torch picked for the traced sizes: `_scaled_dot_product_
cudnn_attention`, `_efficient_attention` or `_flash_attention` on CUDA (`_flash_attention_for_cpu` on the CPU), its
boolean mask already an additive bias. A Hugging Face decode step under a trace takes transformers' compile path:
each KV head repeated to the query heads it serves (`repeat_kv`: unsqueeze, expand, clone, _unsafe_view, a copy of
the cache per step) and one query row given to a prefill kernel. A call is rewritten when its query has one row
(q [B, Hq, 1, D], the 1 static), no dropout, not causal, only its output read (not its log-sum-exp), and the kernel
serves its dtypes and sizes (`fgraph.kernels.sdpa_serves`); repeated keys and values are read at their KV heads (the
copies go) when no node writes in place between the copy and the call. Anything else stays as traced.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import kernels
from .._fx import WriteOrder, arguments, val

aten = torch.ops.aten
# the SDPA ops a trace may hold, by the name each gives its additive mask (None: it takes none)
_SDPA = {
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_flash_attention.default: None,
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
}
_VIEWS = {aten.view.default, aten._unsafe_view.default}


def _call(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _repeated(node) -> tuple | None:
    """(kv, the copy's nodes) where node is repeat_kv(kv): view(clone(expand(unsqueeze(kv, 2), [B, Hkv, G, S, D])),
    [B, Hkv * G, S, D]) (the clone optional), else None."""
    if not _call(node, _VIEWS):
        return None
    chain, x = [node], node.args[0]
    if _call(x, {aten.clone.default}):
        chain.append(x)
        x = x.args[0]
    if not _call(x, {aten.expand.default}) or not _call(x.args[0], {aten.unsqueeze.default}):
        return None
    u = x.args[0]
    kv, dim = u.args[0], u.args[1]
    v = val(kv)
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or dim != 2:
        return None
    out = val(node)
    if list(out.shape) != [v.shape[0], v.shape[1] * val(x).shape[2], *v.shape[2:]]:
        return None
    return kv, [*chain, x, u]


def _rewrite(gm: fx.GraphModule, node: fx.Node, device_type: str, order: WriteOrder) -> bool:
    bias_name = _SDPA[node.target]
    kw = arguments(node)
    q, k, v = kw["query"], kw["key"], kw["value"]
    bias = kw.get(bias_name) if bias_name else None
    if kw.get("dropout_p", 0.0) != 0.0 or kw.get("is_causal", False):
        return False
    qv, biasv = val(q), val(bias)
    if not isinstance(qv, torch.Tensor) or qv.device.type != device_type or not isinstance(qv.shape[2], int):
        return False
    if bias is not None and not (isinstance(biasv, torch.Tensor) and 2 <= biasv.dim() <= 4 and biasv.shape[-2] == 1):
        return False
    # only the output read: every user a getitem, of index 0 where it is read (the log-sum-exp and the rest unread)
    if any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in node.users):
        return False
    copies, reads = [], {}
    for name, t in (("k", k), ("v", v)):
        rep = _repeated(t)
        if rep is not None and len(t.users) == 1 and order.quiet((rep[1][-1], node)):
            reads[name] = rep[0]
            copies.append(rep[1])
        else:
            reads[name] = t
    if not kernels.sdpa_serves(qv, val(reads["k"]), val(reads["v"])):
        return False
    scale = kw.get("scale")
    scale = qv.shape[-1] ** -0.5 if scale is None else scale
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(kernels.sdpa_op, (q, reads["k"], reads["v"], bias, float(scale)))
    for u in list(node.users):
        if u.args[1] == 0:
            new.meta = dict(u.meta)
            u.replace_all_uses_with(new)
        gm.graph.erase_node(u)
    gm.graph.erase_node(node)
    for chain in copies:  # the repeat's view, clone, expand and unsqueeze, now unread (never the cache itself)
        for n in chain:
            if not n.users:
                gm.graph.erase_node(n)
    return True


def rewrite(gm: fx.GraphModule, device_type: str = "cuda") -> int:
    """Rewrite gm's eligible SDPA calls in place; the number rewritten."""
    order = WriteOrder(gm)
    made = sum(_rewrite(gm, n, device_type, order) for n in list(gm.graph.nodes) if _call(n, _SDPA))
    if made:
        gm.recompile()
    return made
