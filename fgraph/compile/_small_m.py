"""Matmuls of a weight's transpose in a CUDA piece, rewritten into `fgraph::linear` before Inductor compiles it.

`F.linear(x, w, b)` traces to `addmm(b, x, t(w))` (`mm(x, t(w))` without a bias; `x @ w.T` to `mm(x, permute(w))`;
a 3-D x that torch's matmul does not fold, such as a transposed attention output, to `bmm(view(expand(x)),
view(expand(t(w))))`, one weight broadcast over the batch: that is rewritten into `fgraph::linear` of x's rows too).
Inductor would hand either to cuBLAS, which at decode sizes (M <= 16 rows) runs the small projections far below
copy bandwidth and splits long K into two kernels. `fgraph::linear` takes x and w as they are and, at run time, picks
the tuned no-split-K kernel for few rows or cuBLAS (`fgraph.kernels`). A rewrite needs: x 2-D of a half dtype on
the piece's device, w 2-D with contiguous rows and at most SMALL_WEIGHT bytes (or, with at most SPLIT_COLUMNS rows,
SPLIT_WEIGHT), a bias 1-D, rows that may be few (a symbolic M, or M <= 16), and addmm's scalars at their defaults.
Anything else stays as traced.

SMALL_WEIGHT: the unsplit kernel beats cuBLAS alone only on the small, latency-bound matrices (0.5B's qkv and o, 2 MB
and 1.6 MB, where cuBLAS reaches a small part of copy bandwidth); on the larger ones cuBLAS is close to the best config
or ahead, and a rewritten matmul that the tuner hands back to cuBLAS made the 8B step slower (docs/performance.md), so
those are not rewritten. SPLIT_WEIGHT / SPLIT_COLUMNS: a few output columns over a
long K (0.5B's down, 896 x 4864, 8.7 MB), where cuBLAS splits K into a GEMM and a reduction kernel and the kernel's
in-kernel split-K (`fgraph.kernels`) may serve it in one.

A gated MLP's `silu(gate) * up` over the two halves of one matmul (`linear(x, w13).chunk(2, -1)`: split, silu, mul)
becomes one `fgraph::linear_glu(x, w13)` whatever the weight's size: without its kernel the op runs the matmul and
the activation's one launch, what Inductor ran, so only a kernel that timed faster changes the step.

An HF MLP keeps gate_proj and up_proj apart: `silu(mm(x, t(wg))) * mm(x, t(wu))` over the same rows (each product
viewed back to x's leading axes alike, or neither) becomes `fgraph::linear_glu(x, wg, wu)`, the same kernel reading
the two weights. With `group` (fgraph.config.small_m_group), 2-3 matmuls of small weights over the same rows (an HF
attention's q, k and v; all with a bias or none) become one `fgraph::linears`, placed where the first of them was.
A rewrite that reads x later than a matmul did (at the activation, or at the group's first matmul) is made only where
no node writes in place in between.

With `norm` (fgraph.config.small_m_norm), a matmul or fgraph::linear_glu that reads an RMSNorm (the examples' and HF's
rms_norm: `w * (xf * rsqrt(mean(xf ** 2, -1) + eps)).to(dtype)`, xf = s in float32), itself read only there, becomes
`fgraph::norm_linear`, and so does the residual add before it (s = x + r), whose sum the op also returns for the
add's other readers: the Inductor kernel that added and normalised goes into the matmul's."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import kernels  # (fgraph::linear's family: the ops this pass writes)
from .._fx import WriteOrder

aten = torch.ops.aten
_TRANSPOSES = {aten.t.default, aten.permute.default, aten.transpose.int}
_VIEWS = {aten.view.default, aten._unsafe_view.default}
SMALL_WEIGHT = 4 << 20  # bytes
SPLIT_WEIGHT, SPLIT_COLUMNS = 16 << 20, 2048  # bytes, rows of w (output columns)


def _transposed(node) -> fx.Node | None:
    """w where `node` is w's 2-D transpose (t, permute [1, 0], transpose 0 1), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _TRANSPOSES:
        return None
    w = node.args[0]
    if node.target is aten.permute.default and list(node.args[1]) not in ([1, 0], [-1, -2], [1, -2], [-1, 0]):
        return None
    if node.target is aten.transpose.int and sorted(d % 2 for d in node.args[1:3]) != [0, 1]:
        return None
    return w if isinstance(w, fx.Node) else None


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _few_rows(m) -> bool:
    return isinstance(m, torch.SymInt) or m <= kernels.MAX_ROWS


def _small(w) -> bool:
    nbytes = w.numel() * w.element_size()
    return nbytes <= SMALL_WEIGHT or (nbytes <= SPLIT_WEIGHT and w.shape[0] <= SPLIT_COLUMNS)


def _fits(x, w, b, device_type: str, any_size: bool = False) -> bool:
    """Whether the op may serve x @ w.T (+ b), given their traced values (b None: no bias); any_size: a weight of
    any size (fgraph::linear_glu, whose fallback is what ran before)."""
    return (
        isinstance(x, torch.Tensor)
        and isinstance(w, torch.Tensor)
        and x.device.type == device_type
        and x.dim() == 2
        and w.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == x.dtype
        and w.stride()[1] == 1
        and isinstance(w.numel(), int)
        and (any_size or _small(w))
        and _few_rows(x.shape[0])
        and (b is None or (isinstance(b, torch.Tensor) and b.dim() == 1 and b.dtype == x.dtype))
    )


def _peel(node, targets) -> fx.Node | None:
    """node's first argument where node is a call of one of `targets`, else None."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets:
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    return None


def _broadcast_weight(r) -> fx.Node | None:
    """w where r is [b, k, n] = view(expand(w's transpose, [b, k, n])) (bmm's right side of x @ w.T), else None."""
    e = _peel(r, _VIEWS)
    wt = _peel(e, {aten.expand.default})
    w = _transposed(wt)
    return w if w is not None and _val(wt).dim() == 2 else None


def _rewrite_bmm(gm: fx.GraphModule, node, device_type: str) -> None:
    """bmm(l [b, m, k], one weight's transpose broadcast) -> view(fgraph::linear(reshape(l, [-1, k]), w), [b, m, n])."""
    left, right = node.args[:2]
    w = _broadcast_weight(right)
    if w is None or _peel(left, _VIEWS) is None or _val(left) is None or _val(left).dim() != 3:
        return
    sizes, (n, k) = list(left.args[1]), _val(w).shape
    rows = _val(left).reshape(-1, k)
    if not _fits(rows, _val(w), None, device_type):
        return
    with gm.graph.inserting_before(node):
        x = gm.graph.call_function(aten.reshape.default, (left, [-1, k]))
        x.meta["val"] = rows
        y = gm.graph.call_function(kernels.op, (x, w, None))
        y.meta["val"] = _val(node).reshape(-1, n)
        out = gm.graph.call_function(aten.view.default, (y, [sizes[0], sizes[1], n]))
    out.meta = dict(node.meta)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    _erase_unused(right)  # the broadcast weight's view, expand and transpose


_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


def _halves(node) -> fx.Node | None:
    """y where `node` splits y [M, 2N] along its last axis into two halves of N, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _SPLITS:
        return None
    y, size = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    shape = getattr(_val(y), "shape", None)
    if shape is None or len(shape) != 2 or dim not in (1, -1):
        return None
    n = shape[1] // 2
    halves = [n, n] if node.target is aten.split_with_sizes.default else size
    return y if isinstance(y, fx.Node) and shape[1] == 2 * n and halves in (n, [n, n]) else None


def _item(node, index: int):
    """The split node whose item `index` `node` is (its only user being what reads it), else None."""
    if isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == index and len(node.users) == 1:
        return node.args[0]
    return None


def _rewrite_glu(gm: fx.GraphModule, node, device_type: str, order: WriteOrder) -> bool:
    """mul(silu(split(mm(x, t(w)))[0]), split(...)[1]) -> fgraph::linear_glu(x, w), each node used only there."""
    for act, up in (node.args[:2], node.args[1::-1]):
        gate = _peel(act, {aten.silu.default})
        split = _item(gate, 0)
        if split is None or len(act.users) != 1 or _item(up, 1) is not split or len(split.users) != 2:
            continue
        mm = _halves(split)
        got = _matmul(mm) if mm is not None and len(mm.users) == 1 else None
        if got is None or got[2] is not None:  # (mm(x, t(w)): no bias)
            continue
        x, w, _, wt = got
        if not _fits(_val(x), _val(w), None, device_type, any_size=True) or not order.quiet((mm, node)):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(kernels.glu_op, (x, w))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        for dead in (node, act, up, gate, split, mm):
            gm.graph.erase_node(dead)
        _erase_unused(wt)
        return True
    return False


def _rows_of(node) -> tuple:
    """(the 2-D matmul node, the view node over it or None) where node is mm's output or a view of it."""
    if _call(node, aten.mm.default, 1):
        return node, None
    mm = _peel(node, _VIEWS | {aten.reshape.default})
    return (mm, node) if _call(mm, aten.mm.default, 1) else (None, None)


def _rewrite_glu_pair(gm: fx.GraphModule, node, device_type: str, order: WriteOrder) -> bool:
    """mul(silu(mm(x, t(wg))), mm(x, t(wu))) -> fgraph::linear_glu(x, wg, wu): an HF MLP's gate_proj and up_proj, two
    weights of one shape over the same rows (each matmul's output viewed back to x's leading axes alike, or not at
    all), each node read only there."""
    for act, up in (node.args[:2], node.args[1::-1]):
        gate = _peel(act, {aten.silu.default})
        if gate is None or len(act.users) != 1 or not isinstance(up, fx.Node) or len(up.users) != 1:
            continue
        (mg, vg), (mu, vu) = _rows_of(gate), _rows_of(up)
        if mg is None or mu is None or (vg is None) != (vu is None) or len(gate.users) != 1:
            continue
        if vg is not None and (vg.target is not vu.target or vg.args[1:] != vu.args[1:]):
            continue
        got = _matmul(mg), _matmul(mu)
        if None in got or _rows_key(got[0][0]) != _rows_key(got[1][0]):
            continue
        (xg, wg, _, tg), (xu, wu, _, tu) = got
        if not all(_fits(_val(xg), _val(w), None, device_type, any_size=True) for w in (wg, wu)):
            continue
        if _val(wg).shape != _val(wu).shape or not order.quiet((mg, mu, node)):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(kernels.glu_op, (xg, wg, wu))
            new.meta["val"] = _val(mg)
            out = new if vg is None else gm.graph.call_function(vg.target, (new, *vg.args[1:]))
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        for dead in dict.fromkeys((node, act, gate, up, mg, mu)):  # (gate is mg without a view)
            gm.graph.erase_node(dead)
        for dead in (tg, tu, xu):
            _erase_unused(dead)
        return True
    return False


def _erase_unused(node) -> None:
    """node and the chain of single-input producers below it that the rewrite left without users."""
    while isinstance(node, fx.Node) and node.op == "call_function" and not node.users:
        below = node.args[0]
        node.graph.erase_node(node)
        node = below


def _matmul(node) -> tuple | None:
    """(x, w, b, w's transpose node) where node is mm(x, t(w)) or addmm(b, x, t(w)) at addmm's default scalars."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
        return None
    if node.target is aten.mm.default:
        b, (x, wt) = None, node.args[:2]
    elif node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 3:
        b, x, wt = node.args
    else:
        return None
    w = _transposed(wt)
    return None if w is None else (x, w, b, wt)


def _call(node, target, users: int | None = 1) -> bool:
    """Whether node calls target and (users not None) has that many users."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is target
        and (users is None or len(node.users) == users)
    )


def _rms_norm(h) -> tuple | None:
    """(s, nw, eps, its nodes) where h = nw * (xf * rsqrt(mean(xf ** 2, -1, keepdim) + eps)).to(s's dtype) and
    xf = s.to(float32) (the examples' and HF's rms_norm; either operand order of each mul), every node but s read
    only inside it; else None."""
    if not _call(h, aten.mul.Tensor):
        return None
    for nw, n in (h.args[:2], h.args[1::-1]):
        m = n.args[0] if _call(n, aten._to_copy.default) and set(n.kwargs) == {"dtype"} else None
        if not _call(m, aten.mul.Tensor):
            continue
        for xf, rs in (m.args[:2], m.args[1::-1]):
            add = rs.args[0] if _call(rs, aten.rsqrt.default) else None
            mean = add.args[0] if _call(add, aten.add.Tensor) and isinstance(add.args[1], float) else None
            if not _call(mean, aten.mean.dim) or list(mean.args[1]) not in ([-1], [1]):
                continue
            pw = mean.args[0]
            keep = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
            if not (keep and _call(pw, aten.pow.Tensor_Scalar) and pw.args[1] == 2 and pw.args[0] is xf):
                continue
            if not _call(xf, aten._to_copy.default, 2) or xf.kwargs != {"dtype": torch.float32}:
                continue
            s, sv, nv = xf.args[0], _val(xf.args[0]), _val(nw)
            if isinstance(sv, torch.Tensor) and isinstance(nv, torch.Tensor) and n.kwargs["dtype"] == sv.dtype:
                if sv.dim() == 2 and nv.shape == (sv.shape[1],) and nv.dtype == sv.dtype:
                    return s, nw, add.args[1], [h, n, m, rs, add, mean, pw, xf]
    return None


def _residual(s) -> tuple:
    """(x, r) where s = x + r of two tensors of s's shape and dtype (add.Tensor, alpha 1); else (s, None)."""
    if _call(s, aten.add.Tensor, None) and len(s.args) == 2 and not s.kwargs:
        x, r = (_val(a) for a in s.args)
        sv = _val(s)
        if all(isinstance(t, torch.Tensor) and t.shape == sv.shape and t.dtype == sv.dtype for t in (x, r)):
            return s.args
    return s, None


def _rewrite_norm(gm: fx.GraphModule, node, device_type: str, order: dict) -> None:
    """A matmul or fgraph::linear_glu of rms_norm(x (+ r)) -> fgraph::norm_linear(x, r, nw, eps, w, b, glu): its
    output 0 the product, its output 1 the sum x + r for the sum's other readers."""
    if node.target is kernels.glu_op:
        if len(node.args) > 2 and node.args[2] is not None:  # (two weights: not fused with the norm)
            return
        (h, w), b, wt, glu = node.args[:2], None, None, True
    else:
        got = _matmul(node)
        if got is None:
            return
        (h, w, b, wt), glu = got, False
    norm = _rms_norm(h)
    if norm is None:
        return
    s, nw, eps, dead = norm
    x, r = _residual(s)
    if not _fits(_val(x), _val(w), None if b is None else _val(b), device_type, any_size=True):
        return
    readers = [u for u in s.users if u is not dead[-1]] if r is not None else []
    at = min([node, *readers], key=order.__getitem__)  # the op goes before the first that reads it
    inputs = [a for a in (x, r, nw, w, b) if isinstance(a, fx.Node)]
    if any(order[a] >= order[at] for a in inputs):
        return
    with gm.graph.inserting_before(at):
        new = gm.graph.call_function(kernels.norm_op, (x, r, nw, eps, w, b, glu))
        y = gm.graph.call_function(operator.getitem, (new, 0))
        total = gm.graph.call_function(operator.getitem, (new, 1))
    order.update(dict.fromkeys((new, y, total), order[at] - 0.5))  # (after every node before `at`)
    y.meta = dict(node.meta)
    total.meta = dict(s.meta) if r is not None else {"val": _val(x).new_empty(0)}
    new.meta = {"val": (y.meta["val"], total.meta["val"])}
    node.replace_all_uses_with(y)
    gm.graph.erase_node(node)
    for d in dead:
        gm.graph.erase_node(d)
    if r is not None:
        s.replace_all_uses_with(total)
        gm.graph.erase_node(s)
    _erase_unused(wt)


def _rows_key(x):
    """What identifies x's rows among matmul inputs: x, or for a view of a node, that node, the view and its shape."""
    if _peel(x, _VIEWS | {aten.reshape.default}) is None:
        return x
    try:
        key = (x.args[0], x.target, tuple(tuple(a) if isinstance(a, list) else a for a in x.args[1:]))
        hash(key)
    except TypeError:
        return x
    return key


def _rewrite_groups(gm: fx.GraphModule, device_type: str, order: WriteOrder) -> None:
    """Matmuls of small weights over the same rows (an HF attention's q, k and v projections), 2-3 at a time of one
    dtype, all with a bias or none -> one fgraph::linears, before the first of them, its outputs read in their
    place; a matmul whose inputs are made after the first is left out."""
    at = order.at
    groups: dict = {}
    for node in gm.graph.nodes:
        got = _matmul(node) if node.op == "call_function" else None
        if got is None:
            continue
        x, w, b, _ = got
        if _fits(_val(x), _val(w), None if b is None else _val(b), device_type):
            groups.setdefault((_rows_key(x), _val(x).dtype, b is None), []).append((node, got))
    for members in groups.values():
        first = members[0][0]
        members = [(n, g) for n, g in members if all(at[a] < at[first] for a in g[1:3] if a is not None)]
        members = [(n, g) for n, g in members if order.quiet((first, n))]
        while len(members) >= 2:
            _group(gm, members[: kernels.GROUP])
            members = members[kernels.GROUP :]


def _group(gm: fx.GraphModule, members: list) -> None:
    x = members[0][1][0]
    with gm.graph.inserting_before(members[0][0]):
        new = gm.graph.call_function(kernels.group_op, (x, [g[1] for _, g in members], [g[2] for _, g in members]))
        new.meta["val"] = [_val(node) for node, _ in members]
        for i, (node, _) in enumerate(members):
            y = gm.graph.call_function(operator.getitem, (new, i))
            y.meta = dict(node.meta)
            node.replace_all_uses_with(y)
    for node, (xi, _, _, wt) in members:
        gm.graph.erase_node(node)
        _erase_unused(wt)
        if xi is not x:
            _erase_unused(xi)


def rewrite(
    gm: fx.GraphModule, device_type: str = "cuda", glu: bool = True, norm: bool = False, group: bool = True
) -> int:
    """Rewrite `gm`'s eligible matmuls in place (glu: gated activations too; norm: the RMSNorm they read; group:
    those over the same rows, 2-3 in one op); the number of ops made (gm holds none before)."""
    order = WriteOrder(gm)
    for node in list(gm.graph.nodes):  # (first: the activation's matmul would be rewritten into fgraph::linear)
        if glu and node.op == "call_function" and node.target is aten.mul.Tensor:
            _rewrite_glu(gm, node, device_type, order) or _rewrite_glu_pair(gm, node, device_type, order)
    if norm:
        positions = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in (aten.mm.default, aten.addmm.default, kernels.glu_op):
                _rewrite_norm(gm, node, device_type, positions)
    if group:
        _rewrite_groups(gm, device_type, order)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.bmm.default:
            _rewrite_bmm(gm, node, device_type)
            continue
        got = _matmul(node)
        if got is None:
            continue
        x, w, b, wt = got
        if not _fits(_val(x), _val(w), None if b is None else _val(b), device_type):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(kernels.op, (x, w, b))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        _erase_unused(wt)
    made = sum(ops_made(gm).values())
    if made:
        gm.recompile()
    return made


def ops_made(gm: fx.GraphModule) -> dict[str, int]:
    """How many of each fgraph op gm calls, by name: what a rewrite made in it."""
    return {name: sum(node.target is op for node in gm.graph.nodes) for name, op in _OPS.items()}


def kernels_made(gm: fx.GraphModule) -> str:
    """The fgraph ops a rewrite made in gm, counted by name ("" if none): for explain."""
    return ", ".join(f"{name} x{c}" for name, c in ops_made(gm).items() if c)


_OPS = {
    "fgraph::linear": kernels.op,
    "fgraph::linears": kernels.group_op,
    "fgraph::linear_glu": kernels.glu_op,
    "fgraph::norm_linear": kernels.norm_op,
    "fgraph::sdpa_decode": kernels.sdpa_op,  # (made by _sdpa's rewrite, after this one's)
}
