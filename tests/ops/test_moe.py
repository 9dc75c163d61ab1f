"""The MoE break primitive on the CPU: numerics against a per-token float64 reference, every expert layout,
the three backends at world size 1, and the split rule (backend x mode x user break list)."""

import pytest
import torch

import fgraph
from fgraph import Batched, Mode, Support
from fgraph import _primitives as P
from fgraph.ops import moe as M
from tests import toys


def weights(E=8, dim=32, inter=16, shared=24, top_k=3, dtype=torch.float64, seed=0, **kw):
    return M.MoEWeights.random(
        E, dim, inter, shared, top_k=top_k, dtype=dtype, generator=torch.Generator().manual_seed(seed), **kw
    )


def tokens(n, dim=32, dtype=torch.float64, seed=1):
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize(
    "scoring, renormalize", [("softmax", False), ("softmax", True), ("sigmoid", True), ("sigmoid", False)]
)
@pytest.mark.parametrize("shared, gate", [(0, False), (24, True), (24, False)])
@pytest.mark.parametrize("backend", M.BACKENDS)
def test_op_matches_per_token_reference_float64(scoring, renormalize, shared, gate, backend):
    w = weights(shared=shared, shared_gate=gate, scoring=scoring, renormalize=renormalize)
    for n in (1, 5, 37):
        x = tokens(n)
        out = M.moe(x, w, backend)
        assert out.dtype == torch.float64 and out.shape == x.shape
        torch.testing.assert_close(out, M.moe_reference(x, w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", list(M.LAYOUTS))
@pytest.mark.parametrize("n", [1, 3, 40])
def test_every_layout_matches_reference_float32(layout, n):
    w = weights(E=16, top_k=4, shared=0, dtype=torch.float32, renormalize=True)
    x = tokens(n, dtype=torch.float32)
    rw, ids = M.route(x, w.router, w.top_k, w.scoring, w.renormalize)
    out = M.experts(x, ids, rw, w.w13, w.w2, layout=layout)
    torch.testing.assert_close(out.double(), M.moe_reference(x, w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", list(M.LAYOUTS))
def test_layouts_drop_pairs_routed_to_other_ranks(layout):
    # EP convention: local id El means "expert lives elsewhere" (weight 0); it must contribute exactly nothing,
    # even where the grouped kernel leaves rows past the last offset undefined.
    w = weights(E=4, top_k=2, shared=0, dtype=torch.float32)
    x = tokens(6, dtype=torch.float32)
    ids = torch.tensor([[0, 4], [4, 4], [1, 3], [4, 2], [3, 3], [0, 1]])
    rw = torch.rand(6, 2, generator=torch.Generator().manual_seed(2)).masked_fill(ids == 4, 0)
    out = M.experts(x, ids, rw, w.w13, w.w2, layout=layout)
    ref = M.experts(x, ids, rw, w.w13, w.w2, layout="loop")
    assert torch.equal(out[1], torch.zeros(32))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_bf16_grouped_close_to_reference():
    w = weights(E=16, top_k=2, dtype=torch.bfloat16)
    x = tokens(24, dtype=torch.bfloat16)
    assert M.choose_layout(x, torch.zeros(24, 2, dtype=torch.long), w.w13) == "grouped"
    torch.testing.assert_close(M.moe(x, w).double(), M.moe_reference(x, w), rtol=0.05, atol=0.02)


def test_layout_choice_by_dtype_and_size():
    w = weights(E=16, top_k=2)
    for n, want in [(1, "gather"), (4, "gather"), (5, "dense"), (64, "dense")]:  # float64: no grouped kernel
        assert M.choose_layout(tokens(n), torch.zeros(n, 2, dtype=torch.long), w.w13) == want
    assert M.choose_layout(tokens(1, dtype=torch.float32), torch.zeros(1, 2, dtype=torch.long), w.w13) == "grouped"


def test_padding_rows_are_safe():
    # capture runs an all-padding batch (zeros): routing ties and all, the op must stay finite
    w = weights()
    for backend in M.BACKENDS:
        assert torch.isfinite(M.moe(torch.zeros(8, 32, dtype=torch.float64), w, backend)).all()


def test_op_is_one_opaque_node_with_backend_support():
    w = weights(dtype=torch.float32)
    for backend, level in [("local", Support.ALWAYS), ("allgather", Support.ALWAYS), ("all2all", Support.NEVER)]:
        gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x: M.moe(x, w, backend))(tokens(4, dtype=torch.float32))
        (node,) = [n for n in gm.graph.nodes if P.primitive_of(n) is not None]
        assert node.target is torch.ops.fgraph.moe.default
        assert P.support_of(node)[0] is level
    assert "host" in P.support_rules[P.registry["moe"]]({"backend": "all2all"})[1]


@pytest.mark.parametrize(
    "bad, what",
    [
        (dict(backend="deepep"), "unknown backend 'deepep'"),
        (dict(shard=True), "router has 8 experts but this rank holds 4"),
        (dict(w=dict(scoring="relu")), "unknown scoring 'relu'"),
        (dict(w=dict(top_k=9)), "top_k=9 with 8 experts"),
    ],
)
def test_errors_say_what_and_fix(bad, what):
    w = weights(**bad.get("w", {}))
    if bad.get("shard"):
        w = w.shard(0, 2)
    with pytest.raises(fgraph.FgraphError, match="Fix:") as e:
        M.moe(tokens(3), w, bad.get("backend", "local"))
    assert what in str(e.value)


def test_shard_splits_experts_in_blocks():
    w = weights(E=8)
    s = w.shard(1, 4)
    assert torch.equal(s.w13, w.w13[2:4]) and torch.equal(s.w2, w.w2[2:4]) and s.router is w.router
    with pytest.raises(fgraph.FgraphError, match="do not split"):
        w.shard(0, 3)


# --------------------------------------------------------------------------------------------- split rule
def moe_step(params, x, routine="decode", backend="local"):
    """attention stand-in (toy_scale, ALWAYS) -> MoE -> dense: a decoder layer's shape of breaks."""
    h = x @ params["w"]
    a = torch.empty_like(h)
    toys.toy_scale(a, h, 0.5)
    h = h + a
    h = h + M.moe(h, params["moe"], backend)
    return torch.tanh(h @ params["w"])


def moe_params(dim=32):
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(dim, dim, generator=g) / dim**0.5, "moe": weights(dtype=torch.float32)}


G, B_ATT, B_MOE = "graph", "break toy_scale", "break moe"
ERR = "error"

# backend, requested mode, routine, user breaks -> effective mode, pieces (or ERR)
SPLIT_TABLE = [
    ("local", "FULL", "decode", None, Mode.FULL, [G, B_ATT, G, B_MOE, G]),
    ("local", "PIECEWISE", "decode", None, Mode.PIECEWISE, [G, B_ATT, G, B_MOE, G]),
    ("local", "FULL", "decode", ["toy_scale"], Mode.FULL, [G, B_ATT, G]),
    ("local", "PIECEWISE", "mixed", ["toy_scale"], Mode.PIECEWISE, [G, B_ATT, G]),
    ("local", "FULL", "decode", [], Mode.FULL, [G]),
    ("allgather", "FULL", "decode", None, Mode.FULL, [G, B_ATT, G, B_MOE, G]),
    ("allgather", "FULL", "decode", ["toy_scale"], Mode.FULL, [G, B_ATT, G]),
    ("all2all", "FULL", "decode", None, Mode.PIECEWISE, [G, B_ATT, G, B_MOE, G]),
    ("all2all", "FULL_AND_PIECEWISE", "decode", None, Mode.PIECEWISE, [G, B_ATT, G, B_MOE, G]),
    ("all2all", "FULL_AND_PIECEWISE", "mixed", None, Mode.PIECEWISE, [G, B_ATT, G, B_MOE, G]),
    ("all2all", "FULL_DECODE_ONLY", "decode", None, Mode.PIECEWISE, [G, B_ATT, G, B_MOE, G]),
    ("all2all", "FULL_DECODE_ONLY", "mixed", ["toy_scale"], Mode.NONE, [G, B_ATT, G]),
    ("all2all", "PIECEWISE", "decode", None, Mode.PIECEWISE, [G, B_ATT, G, B_MOE, G]),
    ("all2all", "NONE", "decode", None, Mode.NONE, [G, B_ATT, G, B_MOE, G]),
    ("all2all", "FULL", "decode", ["toy_scale", "moe"], Mode.PIECEWISE, [G, B_ATT, G, B_MOE, G]),
    ("all2all", "FULL", "decode", ["moe"], Mode.PIECEWISE, [G, B_MOE, G]),  # user list respected as given
    ("all2all", "NONE", "decode", ["toy_scale"], Mode.NONE, [G, B_ATT, G]),  # no graph: nothing to protect
    ("all2all", "FULL", "decode", ["toy_scale"], ERR, None),
    ("all2all", "PIECEWISE", "mixed", ["toy_scale"], ERR, None),
    ("all2all", "FULL", "decode", [], ERR, None),
]


def _pieces(entry):
    return [f"break {' '.join(p.ops)}" if p.is_break else G for p in entry.program.pieces]


@pytest.mark.parametrize("backend, mode, routine, breaks, want_mode, want_pieces", SPLIT_TABLE)
def test_split_rule_table(backend, mode, routine, breaks, want_mode, want_pieces):
    params = moe_params()
    x = tokens(5, dtype=torch.float32)
    f = fgraph.jit(
        moe_step, static=["routine", "backend"], batch={"x": Batched()}, mode=mode, breaks=breaks, buckets=[8]
    )
    if want_mode == ERR:
        with pytest.raises(fgraph.CaptureError) as e:
            f.capture(params, x, routine=routine, backend=backend, progress=False)
        msg = str(e.value)
        assert "'moe'" in msg and "all2all exchanges per-rank token counts through the host" in msg
        assert "Fix: add 'moe' to breaks=[...]" in msg
        with pytest.raises(fgraph.CaptureError):  # the call path refuses it the same way
            fgraph.jit(
                moe_step, static=["routine", "backend"], batch={"x": Batched()}, mode=mode, breaks=breaks, buckets=[8]
            )(params, x, routine=routine, backend=backend)
        return
    f.capture(params, x, routine=routine, backend=backend, progress=False)
    (entry,) = f.entries.values()
    assert entry.mode is want_mode
    assert _pieces(entry) == want_pieces
    if want_mode is Mode.PIECEWISE and Mode(mode).for_routine(routine == "decode") is Mode.FULL:
        assert "FULL requested -> PIECEWISE" in entry.reason and "all2all exchanges" in entry.reason
    graphs = {Mode.NONE: 0, Mode.FULL: 1, Mode.PIECEWISE: want_pieces.count(G)}[want_mode]
    assert f.stats()["total"]["captures"] == graphs
    out = f(params, x, routine=routine, backend=backend)
    with fgraph.disable_jit():
        ref = moe_step(params, x, routine, backend)
    torch.testing.assert_close(out, ref)


def test_full_request_resolved_piecewise_is_logged(caplog):
    f = fgraph.jit(moe_step, static=["routine", "backend"], batch={"x": Batched()}, mode="FULL", buckets=[8])
    with caplog.at_level("INFO", logger="fgraph"):
        f(moe_params(), tokens(5, dtype=torch.float32), routine="decode", backend="all2all")
    assert "FULL requested -> PIECEWISE" in caplog.text and "moe" in caplog.text


def test_explain_shows_moe_boundaries():
    f = fgraph.jit(moe_step, static=["routine", "backend"], batch={"x": Batched()}, mode="FULL", buckets=[8])
    params, x = moe_params(), tokens(5, dtype=torch.float32)
    text = str(fgraph.explain(f, params, x, routine="decode", backend="all2all"))
    assert "mode: PIECEWISE (FULL requested -> PIECEWISE (all2all exchanges per-rank token counts" in text
    assert "pieces: 5 (3 graph, 2 break)" in text
    assert "ends at break moe" in text
    assert "[3] break moe  support NEVER (all2all exchanges per-rank token counts through the host" in text
    text = str(fgraph.explain(f, params, x, routine="decode", backend="local"))
    assert "mode: FULL" in text and "[3] break moe  support ALWAYS" in text
