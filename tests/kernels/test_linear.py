"""fgraph::linear, the few-row matmul compiled CUDA pieces call: it is torch.mm / torch.addmm wherever its kernel
does not run; a piece's matmuls of a weight's transpose are rewritten into it only where it may serve them; on the
GPU its kernel matches the float32 product as closely as cuBLAS does, inside a CUDA graph too, and a key first met
inside a capture runs cuBLAS."""

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import fgraph
from fgraph.compile import _small_m, compiler
from fgraph.kernels import _gemv

bf16 = torch.bfloat16


def rand(*shape, dtype=bf16, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def linears(gm) -> int:
    return sum(n.target is _gemv.op for n in gm.graph.nodes)


@pytest.mark.parametrize("dtype", [bf16, torch.float32])
def test_off_the_kernel_fgraph_linear_is_mm_and_addmm_bit_for_bit(dtype):
    x, w, b = rand(3, 40, dtype=dtype), rand(24, 40, dtype=dtype, seed=1), rand(24, dtype=dtype, seed=2)
    assert torch.equal(_gemv.op(x, w, b), torch.addmm(b, x, w.t()))
    assert torch.equal(_gemv.op(x, w, None), torch.mm(x, w.t()))
    torch.library.opcheck(torch.ops.fgraph.linear, (x, w, b))
    torch.library.opcheck(torch.ops.fgraph.linear, (x, w, None))


def model(x, x3, w, b, e):
    """Every spelling of a matmul with a weight's transpose the rewrite takes."""
    return F.linear(x, w, b), F.linear(x3, w), x @ w.T, x @ w.t(), torch.matmul(x3, e.transpose(0, 1))


def args(m=2, dtype=bf16):
    return (
        rand(m, 8, dtype=dtype),
        rand(m, 1, 8, dtype=dtype, seed=1),
        rand(4, 8, dtype=dtype, seed=2),
        rand(4, dtype=dtype, seed=3),
        rand(4, 8, dtype=dtype, seed=4),
    )


def rewritten(fn, a, device_type="cpu", **kw):
    """(the traced module, a rewritten copy, the number rewritten)."""
    gm, other = make_fx(fn)(*a), make_fx(fn)(*a)
    return gm, other, _small_m.rewrite(other, device_type, **kw)


def test_each_spelling_of_a_weight_transpose_matmul_is_rewritten_and_computes_the_same_bits():
    gm, other, n = rewritten(model, args(), group=False)  # (x's matmuls apart: fgraph::linears groups them)
    assert n == 5 and linears(other) == 5
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    assert not any(node.target in matmuls for node in other.graph.nodes)
    for want, got in zip(gm(*args()), other(*args())):
        assert torch.equal(want, got)


def symbolic_rows(fn, a):
    """fn traced as fgraph traces a piece: the first axis of the activations symbolic, the weights' sizes static."""
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t, rows):
        dims = [DimDynamic.DYNAMIC if i == 0 and rows else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    fakes = [fake(t, rows=i < 2) for i, t in enumerate(a)]  # model's x and x3
    with mode:
        return make_fx(fn)(*fakes)


def test_a_3d_input_matmul_does_not_fold_is_rewritten_as_its_rows_through_the_op():
    # a transposed attention output (HF's o_proj input) traces to bmm(view(expand(x)), view(expand(t(w))))
    def o_proj(x3, w):
        return F.linear(x3.transpose(0, 1), w)

    a = (rand(3, 4, 8), rand(6, 8, seed=1))
    gm, other, n = rewritten(o_proj, a)
    assert n == 1 and linears(other) == 1
    assert not any(node.target is torch.ops.aten.bmm.default for node in other.graph.nodes)
    assert torch.equal(gm(*a), other(*a))


def test_a_symbolic_row_count_is_rewritten_whatever_the_example_size():
    # a compiled piece serves every bucket of its trace: the op decides per call (M <= 16: the kernel)
    other = symbolic_rows(model, args(m=32))
    assert _small_m.rewrite(other, "cpu", group=False) == 5
    for want, got in zip(model(*args(m=5)), other(*args(m=5))):
        assert torch.equal(want, got)


def test_a_few_columns_over_a_long_k_are_rewritten_for_the_split_k_kernel():
    # 0.5B's down projection: 896 columns, K 4864 (8.7 MB, past SMALL_WEIGHT)
    _, other, n = rewritten(lambda x, w: F.linear(x, w), (rand(2, 4864), rand(896, 4864, seed=1)))
    assert n == 1 and linears(other) == 1


def test_what_the_op_cannot_serve_stays_as_traced():
    x, w = rand(2, 8), rand(4, 8, seed=1)
    cases = {
        "float32": (lambda x, w: F.linear(x, w), (x.float(), w.float())),
        "more rows than the kernel takes": (lambda x, w: F.linear(x, w), (rand(32, 8), w)),
        "not a transpose": (lambda x, w: x @ w, (x, rand(8, 4, seed=1))),
        "a weight whose rows are not contiguous": (lambda x, u: x @ u.t().T, (x, rand(8, 4, seed=1))),
        "addmm's scalars": (lambda x, w: torch.addmm(rand(4), x, w.t(), beta=2), (x, w)),
        "a 2-D addend": (lambda x, w: torch.addmm(rand(2, 4), x, w.t()), (x, w)),
        "a batched matmul of two activations": (lambda x, y: torch.bmm(x, y), (rand(2, 3, 8), rand(2, 8, 4, seed=1))),
        "a batch of weights": (lambda x, u: x @ u.transpose(1, 2), (rand(2, 3, 8), rand(2, 4, 8, seed=1))),
        "another device": (lambda x, w: F.linear(x, w), (x, w)),
        "a large weight (bandwidth-bound: cuBLAS's)": (lambda x, w: F.linear(x, w), (rand(2, 1024), rand(2049, 1024))),
        "a long K beyond the split weights": (lambda x, w: F.linear(x, w), (rand(2, 4200), rand(2048, 4200))),
    }
    for why, (fn, a) in cases.items():
        _, other, n = rewritten(fn, a, device_type="cuda" if why == "another device" else "cpu")
        assert n == 0 and linears(other) == 0, why


@contextlib.contextmanager
def rewriting_on_cpu(monkeypatch):
    """Compiled pieces rewritten as CUDA ones are (the rewrite is for CUDA pieces; here its CPU path is checked)."""
    rewrite = _small_m.rewrite
    monkeypatch.setattr(_small_m, "rewrite", lambda gm, device_type="cuda", **kw: rewrite(gm, "cpu", **kw))
    yield


def mlp(params, x):
    h = F.linear(x, params["w1"], params["b1"]).relu()
    return F.linear(h, params["w2"]) + x


@pytest.mark.parametrize("on", [True, False])
def test_compiled_pieces_call_fgraph_linear_when_the_switch_is_on_and_equal_eager(on, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "small_m_gemv", on)
    params = {"w1": rand(48, 16, seed=1), "b1": rand(48, seed=2), "w2": rand(16, 48, seed=3)}
    with rewriting_on_cpu(monkeypatch):
        before = compiler.counts["linear"]
        # (a lambda: its own jit state)
        f = fgraph.jit(lambda params, x: mlp(params, x), batch={"x": fgraph.Batched()}, buckets=[1, 4], compile=True)
        for m in (1, 3, 4):  # 3: padded into bucket 4
            x = rand(m, 16, seed=10 + m)
            torch.testing.assert_close(f(params, x), mlp(params, x))
    assert compiler.counts["linear"] - before == (2 * 2 if on else 0)  # two matmuls in each bucket's piece


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or _gemv.kernel() is None, reason="Triton's interpreter (CPU)"
)
def test_every_candidate_config_computes_the_product_in_the_interpreter():
    # (a K of 2100 is split 2, 4 and 8 ways, its last split short)
    shapes = [
        (1, (20, 40), True),
        (3, (64, 96), False),
        (5, (33, 513), True),
        (16, (64, 96), False),
        (2, (40, 2100), True),
    ]
    for m, (n, k), bias in shapes:
        x, w = rand(m, k, dtype=torch.float16), rand(n, k, dtype=torch.float16, seed=1)
        b = rand(n, dtype=torch.float16, seed=2) if bias else None
        want = x.float() @ w.float().t() + (b.float() if bias else 0)
        for cfg in _gemv.candidates(m, n, k):
            for _ in range(2):  # the second launch finds the counters the first put back
                y = torch.full((m, n), float("nan"), dtype=torch.float16)
                _gemv._launch(cfg, x, w, b, y)
                torch.testing.assert_close(y.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)
    assert {c[-1] for c in _gemv.candidates(2, 40, 2100)} == {1, 2, 4, 8}


# -- fgraph::linears: matmuls over the same rows in one launch --------------------------------------------------
def groups(gm) -> int:
    return sum(n.target is _gemv.group_op for n in gm.graph.nodes)


def hf_qkv(x, wq, bq, wk, bk, wv, bv):
    """transformers' Qwen2Attention's projections: three linears (with biases) of one 3-D x [B, S, H]."""
    return F.linear(x, wq, bq).transpose(0, 1), F.linear(x, wk, bk), F.linear(x, wv, bv)


def qkv_args(lead=(2, 1), bias=True):
    ws = [rand(n, 40, seed=i) for i, n in enumerate((24, 8, 8))]
    bs = [rand(n, seed=10 + i) if bias else None for i, n in enumerate((24, 8, 8))]
    return (rand(*lead, 40, seed=9), *(t for pair in zip(ws, bs) for t in pair))


def test_off_the_kernel_fgraph_linears_is_each_mm_or_addmm_bit_for_bit():
    x, wq, bq, wk, bk, wv, bv = qkv_args((3,))
    got = _gemv.group_op(x, [wq, wk, wv], [bq, bk, bv])
    assert all(torch.equal(g, torch.addmm(b, x, w.t())) for g, w, b in zip(got, (wq, wk, wv), (bq, bk, bv)))
    assert all(torch.equal(g, x @ w.t()) for g, w in zip(_gemv.group_op(x, [wq, wk], [None, None]), (wq, wk)))
    torch.library.opcheck(torch.ops.fgraph.linears, (x, [wq, wk, wv], [bq, bk, bv]))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(2, 1), (3,)], ids=["3-D, as transformers' attention", "2-D"])
def test_matmuls_over_the_same_rows_become_one_fgraph_linears(lead, bias):
    a = qkv_args(lead, bias)
    fn = hf_qkv if bias else (lambda x, wq, _bq, wk, _bk, wv, _bv: hf_qkv(x, wq, None, wk, None, wv, None))
    gm, other, n = rewritten(fn, a)
    assert n == 1 and groups(other) == 1 and linears(other) == 0
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    assert not any(node.target in matmuls for node in other.graph.nodes)
    assert all(torch.equal(w, g) for w, g in zip(gm(*a), other(*a)))
    off = make_fx(fn)(*a)
    assert _small_m.rewrite(off, "cpu", group=False) == 3 and groups(off) == 0


def test_a_symbolic_row_count_is_grouped_whatever_the_example_size():
    def fn(x, x3, w, b, e):
        return F.linear(x, w, b), F.linear(x, e, b)

    other = symbolic_rows(fn, args(m=32))
    assert _small_m.rewrite(other, "cpu") == 1 and groups(other) == 1
    assert all(torch.equal(w, g) for w, g in zip(fn(*args(m=5)), other(*args(m=5))))


def test_what_fgraph_linears_cannot_group_stays_one_fgraph_linear_each():
    x, w1, w2, w3, w4 = rand(2, 8), *(rand(4, 8, seed=s) for s in range(1, 5))
    b = rand(4, seed=5)
    cases = {  # (fn, args, linears, groups)
        "a bias on one only": (lambda x, v, u: (F.linear(x, v, b), F.linear(x, u)), (x, w1, w2), 2, 0),
        "other rows": (lambda x, v, u: (F.linear(x, v), F.linear(x + 1, u)), (x, w1, w2), 2, 0),
        "a weight made from the first's output": (
            lambda x, v, u: (y := F.linear(x, v), F.linear(x, u + y.sum()))[::-1],
            (x, w1, w2),
            2,
            0,
        ),
        "four: three in one op, one alone": (
            lambda x, *ws: [F.linear(x, w) for w in ws],
            (x, w1, w2, w3, w4),
            1,
            1,
        ),
    }
    for why, (fn, a, n_linear, n_group) in cases.items():
        gm, other, _ = rewritten(fn, a)
        assert (linears(other), groups(other)) == (n_linear, n_group), why
        for want, got in zip(pytree.tree_leaves(gm(*a)), pytree.tree_leaves(other(*a))):
            assert torch.equal(want, got), why


def test_a_write_in_place_between_matmuls_keeps_them_apart():
    # one op reads v once, where the first matmul did: the second read it after the write into its base
    def grouped(x, w1, w2):
        v = x.view(2, 8)
        y1 = F.linear(v, w1)
        x.add_(1)
        return y1, F.linear(v, w2)

    def paired(x, wg, wu):
        v = x.view(2, 8)
        g = F.linear(v, wg)
        x.mul_(2)
        return F.silu(g) * F.linear(v, wu)

    for fn in (grouped, paired):
        a = (rand(2, 8), rand(4, 8, seed=1), rand(4, 8, seed=2))
        gm, other, _ = rewritten(fn, [t.clone() for t in a])
        assert groups(other) == glus(other) == 0 and linears(other) == 2, fn.__name__
        for want, got in zip(pytree.tree_leaves(gm(*[t.clone() for t in a])), pytree.tree_leaves(other(*a))):
            assert torch.equal(want, got), fn.__name__


# a random program of projections over rows of two inputs: x, x2, or views of x made up front (v, or 3-D: v3) or
# where read (x3), 2-D or 3-D, with or without a bias; gated pairs (their two matmuls over the rows each picks);
# writes in place into x between them (a view made up front sees them, as the same node). Its outputs: every
# projection it made
ROWS = st.sampled_from(["x", "x", "v", "v3", "x3", "x2"])
STATEMENT = st.one_of(
    st.tuples(st.just("linear"), ROWS, st.integers(0, 4), st.booleans()),  # rows, weight, bias
    st.tuples(st.just("glu"), ROWS, st.integers(0, 4), ROWS, st.integers(0, 4)),  # gate's rows and weight, up's
    st.tuples(st.just("write"), st.sampled_from(["add_", "mul_"])),
)


def program(statements):
    def fn(x, x2, ws, bs):
        m, k = x.shape
        made = {"v": x.view(m, k), "v3": x.view(m, 1, k)}
        rows = {"x": lambda: x, "x2": lambda: x2, "x3": lambda: x.view(m, 1, k), "v": made.get, "v3": made.get}
        at = lambda r: rows[r](r) if r in made else rows[r]()  # noqa: E731
        out = []
        for s in statements:
            if s[0] == "write":
                getattr(x, s[1])(1.5)
            elif s[0] == "linear":
                out.append(F.linear(at(s[1]), ws[s[2]], bs[s[2]] if s[3] else None))
            else:
                gate, up = F.linear(at(s[1]), ws[s[2]]), F.linear(at(s[3]), ws[s[4]])
                out.append(F.silu(gate) * (up if up.dim() == gate.dim() else up.view(gate.shape)))
        return out

    return fn


@settings(max_examples=60, deadline=None)
@given(st.lists(STATEMENT, min_size=1, max_size=7), st.integers(1, 4), st.sampled_from([4, 8]))
def test_the_rewrites_of_any_program_of_projections_compute_its_bits(statements, m, n):
    # off the kernel every fgraph op is torch's ops bit for bit: the rewritten program equals the traced one wherever
    # its matmuls are grouped, paired or left alone, and each matmul is in exactly one fgraph op
    ws, bs = [rand(n, 16, seed=s) for s in range(5)], [rand(n, seed=10 + s) for s in range(5)]
    a = (rand(m, 16), rand(m, 16, seed=20), ws, bs)
    fn = program(statements)
    gm = make_fx(fn)(*pytree.tree_map(torch.clone, a))
    other = make_fx(fn)(*pytree.tree_map(torch.clone, a))
    _small_m.rewrite(other, "cpu")
    ops = _small_m.ops_made(other)
    matmuls = sum(1 if s[0] == "linear" else 2 for s in statements if s[0] != "write")
    made = ops["fgraph::linear"] + 2 * ops["fgraph::linear_glu"]
    grouped = sum(len(n.args[1]) for n in other.graph.nodes if n.target is _gemv.group_op)
    assert made + grouped == matmuls
    want, got = gm(*pytree.tree_map(torch.clone, a)), other(*pytree.tree_map(torch.clone, a))
    assert len(want) == len(got) and all(map(torch.equal, want, got))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or _gemv.kernel() is None, reason="Triton's interpreter (CPU)"
)
def test_every_group_config_computes_each_product_in_the_interpreter():
    for m, ns, k, bias in [(1, (24, 8, 8), 40, True), (3, (64, 16), 96, False), (5, (33, 17, 9), 513, True)]:
        x = rand(m, k, dtype=torch.float16)
        ws = [rand(n, k, dtype=torch.float16, seed=i) for i, n in enumerate(ns)]
        bs = [rand(n, dtype=torch.float16, seed=10 + i) if bias else None for i, n in enumerate(ns)]
        for cfg in [c for c in _gemv.candidates(m, max(ns), k) if c[-1] == 1]:
            ys = [torch.full((m, n), float("nan"), dtype=torch.float16) for n in ns]
            _gemv._launch_group(cfg, x, ws, bs, ys)
            for y, w, b in zip(ys, ws, bs):
                want = x.float() @ w.float().t() + (0 if b is None else b.float())
                torch.testing.assert_close(y.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)


# -- fgraph::linear_glu: a gated MLP's gate_up matmul and its activation -------------------------------------------
def gated(x, w13):
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.silu(gate) * up


def glus(gm) -> int:
    return sum(n.target is _gemv.glu_op for n in gm.graph.nodes)


def test_off_the_kernel_fgraph_linear_glu_is_the_unfused_ops_bit_for_bit():
    x, w = rand(3, 40), rand(48, 40, seed=1)
    assert torch.equal(_gemv.glu_op(x, w), gated(x, w))
    torch.library.opcheck(torch.ops.fgraph.linear_glu, (x, w))


GATED = {
    "chunk": gated,
    "split": lambda x, w: (lambda g, u: F.silu(g) * u)(*F.linear(x, w).split(24, dim=1)),
    "split_with_sizes, up times silu": lambda x, w: (lambda g, u: u * F.silu(g))(*F.linear(x, w).split([24, 24], -1)),
}


@pytest.mark.parametrize("spelling", GATED)
def test_silu_of_a_matmuls_first_half_times_its_second_becomes_one_fgraph_linear_glu(spelling):
    a = (rand(3, 40), rand(48, 40, seed=1))
    gm, other, n = rewritten(GATED[spelling], a)
    assert n == 1 and glus(other) == 1 and linears(other) == 0
    gone = (torch.ops.aten.mm.default, torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor)
    assert not any(node.target in gone for node in other.graph.nodes)
    assert torch.equal(gm(*a), other(*a))


def test_a_gated_mlp_becomes_glu_then_linear_at_any_weight_size_unless_switched_off():
    # an 8B's gate_up weight is 235 MB: without its kernel the op runs the matmul and the activation's one launch,
    # what Inductor ran, so no size is excluded (fgraph::linear's are: here the down projection's 8.6 MB is not)
    from examples.layers import gated_mlp

    a = (rand(2, 2100), rand(2 * 2100, 2100, seed=1), rand(2100, 2100, seed=2))
    gm, other, n = rewritten(gated_mlp, a)
    assert n == 1 and glus(other) == 1 and linears(other) == 0 and torch.equal(gm(*a), other(*a))
    off = make_fx(gated_mlp)(*a)
    assert _small_m.rewrite(off, "cpu", glu=False) == 0 and glus(off) == 0


def test_what_fgraph_linear_glu_cannot_serve_stays_as_traced():
    x, w, b = rand(2, 8), rand(12, 8, seed=1), rand(12, seed=2)

    def gate_read_twice(x, w):
        gate, up = F.linear(x, w).chunk(2, -1)
        return F.silu(gate) * up, gate

    cases = {
        "the gate read elsewhere too": (gate_read_twice, (x, w)),
        "a split in three": (lambda x, w: (lambda g, u, _: F.silu(g) * u)(*F.linear(x, w).split(4, -1)), (x, w)),
        "a split along the rows": (lambda x, w: (lambda g, u: F.silu(g) * u)(*F.linear(x, w).chunk(2, 0)), (x, w)),
        "another activation": (lambda x, w: (lambda g, u: F.gelu(g) * u)(*F.linear(x, w).chunk(2, -1)), (x, w)),
        "a bias": (lambda x, w: (lambda g, u: F.silu(g) * u)(*F.linear(x, w, b).chunk(2, -1)), (x, w)),
        "float32": (gated, (x.float(), w.float())),
        "more rows than the kernel takes": (gated, (rand(32, 8), w)),
        "another device": (gated, (x, w)),
    }
    for why, (fn, a) in cases.items():
        gm, other, _ = rewritten(fn, a, device_type="cuda" if why == "another device" else "cpu")
        assert glus(other) == 0, why
        for want, got in zip(pytree.tree_leaves(gm(*a)), pytree.tree_leaves(other(*a))):
            assert torch.equal(want, got), why


def hf_mlp(x, wg, wu, wd):
    """transformers' LlamaMLP / Qwen2MLP: separate gate and up projections, over a 3-D x [B, S, H]."""
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def test_off_the_kernel_fgraph_linear_glu_of_two_weights_is_the_unfused_ops_bit_for_bit():
    x, wg, wu = rand(3, 40), rand(24, 40, seed=1), rand(24, 40, seed=2)
    assert torch.equal(_gemv.glu_op(x, wg, wu), F.silu(F.linear(x, wg)) * F.linear(x, wu))
    assert torch.equal(_gemv.glu_op(x, torch.cat([wg, wu])), _gemv.glu_op(x, wg, wu))  # one weight's two halves
    torch.library.opcheck(torch.ops.fgraph.linear_glu, (x, wg, wu))


PAIRED = {
    "3-D, as transformers' MLP": (hf_mlp, (2, 1, 40)),
    "2-D": (hf_mlp, (3, 40)),
    "up times silu": (lambda x, wg, wu, wd: F.linear(F.linear(x, wu) * F.silu(F.linear(x, wg)), wd), (3, 40)),
}


@pytest.mark.parametrize("spelling", PAIRED)
def test_silu_of_one_matmul_times_another_of_the_same_rows_becomes_one_fgraph_linear_glu(spelling):
    fn, xshape = PAIRED[spelling]
    a = (rand(*xshape), rand(24, 40, seed=1), rand(24, 40, seed=2), rand(40, 24, seed=3))
    gm, other, n = rewritten(fn, a)
    assert n == 2 and glus(other) == 1 and linears(other) == 1  # the down projection: fgraph::linear
    gone = (torch.ops.aten.mm.default, torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor)
    assert not any(node.target in gone for node in other.graph.nodes)
    assert torch.equal(gm(*a), other(*a))


def test_what_fgraph_linear_glu_of_two_weights_cannot_serve_stays_as_traced():
    x, wg, wu, wd = rand(2, 8), rand(12, 8, seed=1), rand(12, 8, seed=2), rand(8, 12, seed=3)

    def gate_read_twice(x, wg, wu):
        g = F.linear(x, wg)
        return F.silu(g) * F.linear(x, wu), g

    cases = {
        "the gate read elsewhere too": (gate_read_twice, (x, wg, wu)),
        "other rows": (lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x + 1, wu), (x, wg, wu)),
        "weights of two shapes": (lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu), (x, wg, wu[:1])),
        "another activation": (lambda x, wg, wu: F.gelu(F.linear(x, wg)) * F.linear(x, wu), (x, wg, wu)),
        "a bias": (lambda x, wg, wu: F.silu(F.linear(x, wg, wg[:, 0])) * F.linear(x, wu), (x, wg, wu)),
        "float32": (lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu), (x.float(), wg.float(), wu.float())),
        "more rows than the kernel takes": (hf_mlp, (rand(32, 8), wg, wu, wd)),
    }
    for why, (fn, a) in cases.items():
        gm, other, _ = rewritten(fn, a)
        assert glus(other) == 0, why
        for want, got in zip(pytree.tree_leaves(gm(*a)), pytree.tree_leaves(other(*a))):
            assert torch.equal(want, got), why


@pytest.mark.parametrize("on", [True, False])
def test_compiled_pieces_call_fgraph_linear_glu_when_its_switch_is_on_and_equal_eager(on, tmp_path, monkeypatch):
    from examples.layers import gated_mlp

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "small_m_glu", on)
    params = {"w13": rand(96, 16, seed=1), "w2": rand(16, 48, seed=3)}
    mlp_ = lambda params, x: gated_mlp(x, params["w13"], params["w2"])  # noqa: E731 (its own jit state)
    with rewriting_on_cpu(monkeypatch):
        before = dict(compiler.counts)
        f = fgraph.jit(mlp_, batch={"x": fgraph.Batched()}, buckets=[1, 4], compile=True)
        for m in (1, 3, 4):  # 3: padded into bucket 4
            x = rand(m, 16, seed=10 + m)
            want = mlp_(params, x)
            # (off, Inductor's fused activation rounds once where eager rounds silu's result first)
            torch.testing.assert_close(f(params, x), want, atol=2e-2 * want.abs().max().item(), rtol=0)
    assert compiler.counts["linear"] - before["linear"] == 2 * 2  # gate_up (with or without its activation), down
    assert compiler.counts["glu"] - before["glu"] == (2 if on else 0)
    said = str(fgraph.explain(f))  # each compiled piece names fgraph's kernels in it
    assert ("fgraph kernels: fgraph::linear x1, fgraph::linear_glu x1" in said) == on
    assert ("fgraph kernels: fgraph::linear x2" in said) == (not on)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or _gemv.kernel() is None, reason="Triton's interpreter (CPU)"
)
def test_every_glu_config_and_the_activation_kernel_compute_the_unfused_result_in_the_interpreter():
    for m, (n, k) in [(1, (20, 40)), (3, (64, 96)), (5, (33, 513)), (16, (64, 96))]:
        x, w = rand(m, k, dtype=torch.float16), rand(2 * n, k, dtype=torch.float16, seed=1)
        y = x.float() @ w.float().t()
        want = F.silu(y[:, :n]) * y[:, n:]
        assert _gemv.candidates(m, n, k, glu=True)
        wg, wu = w[:n].clone(), w[n:].clone()  # two weights
        for cfg in _gemv.candidates(m, n, k, glu=True):
            out = torch.full((m, n), float("nan"), dtype=torch.float16)
            _gemv._launch(cfg, x, w, None, out, glu=True)
            torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)
            pair = torch.full((m, n), float("nan"), dtype=torch.float16)
            _gemv._launch(cfg, x, wg, None, pair, glu=True, u=wu)
            assert torch.equal(pair, out), cfg
        yh, out = x @ w.t(), torch.full((m, n), float("nan"), dtype=torch.float16)
        _gemv._launch_glu(yh[:, :n], yh[:, n:], out, block=16)  # (a last block past the row)
        assert torch.equal(out, gated(x, w))
    assert all(c[-1] == 1 for c in _gemv.candidates(2, 40, 2100, glu=True))  # K is not split


# -- on the GPU ------------------------------------------------------------------------------------------------
# (rows, N, K, bias): decode shapes of the 0.5B (qkv with its bias, o, down) and 8B (o), and sizes off every block
GPU_SHAPES = [(1, 1152, 896, True), (8, 896, 4864, False), (16, 4096, 4096, False), (3, 1000, 777, True)]


def err(y, want) -> float:
    return (y.float() - want).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [bf16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_every_candidate_kernel_is_as_close_to_the_float32_product_as_cublas(shape, dtype):
    m, n, k, bias = shape
    x, w = rand(m, k, dtype=dtype, device="cuda"), rand(n, k, dtype=dtype, device="cuda", seed=1) / k**0.5
    b = rand(n, dtype=dtype, device="cuda", seed=2) if bias else None
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    floor = err(_gemv._cublas(x, w, b), want)
    for cfg in _gemv.candidates(m, n, k):
        y = torch.empty(m, n, dtype=dtype, device="cuda")
        _gemv._launch(cfg, x, w, b, y)
        assert err(y, want) <= 2 * floor + 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_the_tuned_choice_replays_in_a_cuda_graph_as_it_runs_eagerly(shape):
    m, n, k, bias = shape
    x, w = rand(m, k, device="cuda"), rand(n, k, device="cuda", seed=1) / k**0.5
    b = rand(n, device="cuda", seed=2) if bias else None
    _gemv.op(x, w, b)  # tunes the key outside the capture, as fgraph's warm-up does
    assert (m, n, k, bf16, bias, False, 0, x.device.index) in _gemv._choice
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _gemv.op(x, w, b)
    for seed in (5, 6):  # new rows in the same memory, as a decode step's inputs
        x.copy_(rand(m, k, device="cuda", seed=seed))
        g.replay()
        assert torch.equal(y, _gemv.op(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_every_split_k_config_sums_its_partials_once_in_order_replay_after_replay(m):
    # 0.5B's down projection: the last program of a column block to arrive sums the partials the others stored; a
    # sum started early, or counters left dirty, would show as a replay that differs from the first launch
    n, k = 896, 4864
    x, w = rand(m, k, device="cuda"), rand(n, k, device="cuda", seed=1) / k**0.5
    split = [c for c in _gemv.candidates(m, n, k) if c[-1] > 1]
    assert split
    for cfg in split:
        want = torch.empty(m, n, dtype=bf16, device="cuda")
        _gemv._launch(cfg, x, w, None, want)
        g, y = torch.cuda.CUDAGraph(), torch.empty_like(want)
        with torch.cuda.graph(g):
            _gemv._launch(cfg, x, w, None, y)
        for _ in range(20):
            y.fill_(float("nan"))
            g.replay()
            assert torch.equal(y, want), cfg


@pytest.mark.gpu
def test_a_new_key_compiles_every_candidate_side_by_side_before_timing_any_and_keeps_no_memory(monkeypatch):
    m, n, k = 3, 776, 768
    x, w = rand(m, k, device="cuda"), rand(n, k, device="cuda", seed=1) / k**0.5
    warm, real = [], _gemv._launch

    def spy(*args, **kwargs):
        warm.append(kwargs.get("warm", args[8] if len(args) > 8 else False))
        return real(*args, **kwargs)

    monkeypatch.setattr(_gemv, "_launch", spy)
    monkeypatch.setattr(fgraph.config, "tune_cache", False)
    before, n_cands = dict(_gemv.counts), len(_gemv.candidates(m, n, k))
    torch.mm(x, w.t())  # (cuBLAS's workspace of this stream, made before the count)
    allocated = torch.cuda.memory_allocated()
    y = _gemv.op(x, w, None)
    # (the timings ran on side streams: cuBLAS's workspace of each, 32 MiB on Hopper, is not kept)
    assert torch.cuda.memory_allocated() - allocated < 4 << 20
    assert _gemv.counts["tuned"] == before["tuned"] + 1
    assert _gemv.counts["compiled"] == before["compiled"] + n_cands
    assert warm[:n_cands] == [True] * n_cands and not any(warm[n_cands:])
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_key_first_met_inside_a_capture_runs_cublas_and_is_counted():
    x, w = rand(2, 512, device="cuda"), rand(520, 512, device="cuda", seed=1)
    assert (2, 520, 512, bf16, False, False, 0, x.device.index) not in _gemv._choice
    before = dict(_gemv.counts)
    torch.mm(x, w.t())  # (cuBLAS's own set-up, outside the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _gemv.op(x, w, None)
    g.replay()
    assert _gemv.counts["untuned"] == before["untuned"] + 1 and _gemv.counts["tuned"] == before["tuned"]
    assert torch.equal(y, torch.mm(x, w.t()))


@pytest.mark.gpu
def test_a_compiled_cuda_step_calls_fgraph_linear_and_equals_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    params = {
        "w1": rand(256, 128, device="cuda", seed=1),
        "b1": rand(256, device="cuda", seed=2),
        "w2": rand(128, 256, device="cuda", seed=3) / 16,
    }
    before = compiler.counts["linear"]
    batch = {"x": fgraph.Batched()}
    f = fgraph.jit(lambda params, x: mlp(params, x), batch=batch, buckets=[1, 8], mode="FULL", compile=True)
    for m in (1, 5, 8):
        x = rand(m, 128, device="cuda", seed=10 + m)
        torch.testing.assert_close(f(params, x), mlp(params, x))
    assert compiler.counts["linear"] - before == 2 * 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_hf_models_compiled_decode_runs_every_projection_through_the_op_and_equals_eager(
    device, tmp_path, monkeypatch
):
    # HF's o_proj input is the transposed attention output: its matmul traces to a bmm, rewritten too
    from benchmarks import hf_bench
    from examples import hf_generate

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    base = hf_bench.make_model(True, device, bf16, layers=2)
    model = hf_bench.make_model(True, device, bf16, layers=2)
    model.load_state_dict(base.state_dict())
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
    before = dict(compiler.counts)
    kw = dict(output_logits=True, return_dict_in_generate=True)
    with rewriting_on_cpu(monkeypatch) if device == "cpu" else contextlib.nullcontext():
        hf_generate.jit_forward(model, "FULL", buckets=[1], compile=True)
        want, got = hf_generate.generate(base, ids, 3, **kw), hf_generate.generate(model, ids, 3, **kw)
    # each piece compiled, per layer: q, k and v in one fgraph::linears, o, gate and up in one fgraph::linear_glu,
    # down; and the head
    made = {k: compiler.counts[k] - before[k] for k in ("linear", "group", "glu")}
    assert made["linear"] > 0 and made["linear"] % (4 * 2 + 1) == 0
    assert made["group"] * 9 == made["glu"] * 9 == made["linear"] * 2
    assert torch.equal(got.sequences[:, : ids.shape[1] + 1], want.sequences[:, : ids.shape[1] + 1])  # the prefill
    scale = want.logits[1].abs().max().item()
    torch.testing.assert_close(got.logits[1], want.logits[1], atol=3e-2 * scale, rtol=0)  # the first decode step


# (rows, N, K) of fgraph::linear_glu: 0.5B's and 8B's gate_up at decode sizes, and sizes off every block
GLU_SHAPES = [(1, 4864, 896), (8, 4864, 896), (1, 14336, 4096), (3, 1000, 777)]


def gated_inputs(m, n, k):
    return rand(m, k, device="cuda"), rand(2 * n, k, device="cuda", seed=1) / k**0.5


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GLU_SHAPES)
def test_every_glu_kernel_is_as_close_to_the_float32_result_as_cublas_and_the_activation_launch(shape):
    m, n, k = shape
    x, w = gated_inputs(m, n, k)
    y = x.float() @ w.float().t()
    want = F.silu(y[:, :n]) * y[:, n:]
    unfused = _gemv.silu_mul(_gemv._cublas(x, w, None))
    # the activation's launch is eager's two ops on the same matmul output, to one rounding of its exp
    torch.testing.assert_close(unfused, gated(x, w))
    pair = _gemv.silu_mul(_gemv._cublas(x, w[:n], None), _gemv._cublas(x, w[n:], None))
    torch.testing.assert_close(pair, gated(x, w))  # two matmuls and the launch of the activation of both
    wg, wu = w[:n].clone(), w[n:].clone()
    for cfg in _gemv.candidates(m, n, k, glu=True):
        out = torch.full((m, n), float("nan"), dtype=bf16, device="cuda")
        _gemv._launch(cfg, x, w, None, out, glu=True)
        assert err(out, want) <= 2 * err(unfused, want) + 1e-2, cfg
        two = torch.full((m, n), float("nan"), dtype=bf16, device="cuda")
        _gemv._launch(cfg, x, wg, None, two, glu=True, u=wu)
        assert torch.equal(two, out), cfg  # two weights: the same arithmetic


@pytest.mark.gpu
@pytest.mark.parametrize("two", [False, True], ids=["one weight", "two weights"])
@pytest.mark.parametrize("shape", GLU_SHAPES)
def test_the_tuned_glu_choice_replays_in_a_cuda_graph_as_it_runs_eagerly(shape, two):
    m, n, k = shape
    x, w = gated_inputs(m, n, k)
    ws = (w[:n].clone(), w[n:].clone()) if two else (w,)
    _gemv.glu_op(x, *ws)  # tunes the key outside the capture, as fgraph's warm-up does
    assert (m, ws[0].shape[0], k, bf16, False, "pair" if two else True, 0, x.device.index) in _gemv._choice
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _gemv.glu_op(x, *ws)
    for seed in (5, 6):
        x.copy_(rand(m, k, device="cuda", seed=seed))
        g.replay()
        assert torch.equal(y, _gemv.glu_op(x, *ws))


@pytest.mark.gpu
def test_a_compiled_cuda_gated_mlp_calls_fgraph_linear_glu_and_equals_eager(tmp_path, monkeypatch):
    from examples.layers import gated_mlp

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    params = {"w13": rand(2 * 512, 256, device="cuda", seed=1) / 16, "w2": rand(256, 512, device="cuda", seed=3) / 22}
    mlp_ = lambda params, x: gated_mlp(x, params["w13"], params["w2"])  # noqa: E731 (its own jit state)
    before = compiler.counts["glu"]
    f = fgraph.jit(mlp_, batch={"x": fgraph.Batched()}, buckets=[1, 8], mode="FULL", compile=True)
    for m in (1, 5, 8):
        x = rand(m, 256, device="cuda", seed=10 + m)
        want = mlp_(params, x)
        torch.testing.assert_close(f(params, x), want, atol=2e-2 * want.abs().max().item(), rtol=0)
    assert compiler.counts["glu"] - before == 2


# (rows, N of each weight, K, bias) of fgraph::linears: 0.5B's and 8B's q, k and v at decode sizes, and sizes off
# every block
GROUP_SHAPES = [(1, (896, 128, 128), 896, True), (8, (896, 128, 128), 896, True), (1, (4096, 1024, 1024), 4096, False),
                (3, (100, 36, 36), 777, True)]  # fmt: skip


def grouped_inputs(m, ns, k, bias):
    ws = [rand(n, k, device="cuda", seed=i) / k**0.5 for i, n in enumerate(ns)]
    bs = [rand(n, device="cuda", seed=9 + i) if bias else None for i, n in enumerate(ns)]
    return rand(m, k, device="cuda"), ws, bs


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GROUP_SHAPES)
def test_every_group_kernel_is_as_close_to_each_float32_product_as_cublas(shape):
    m, ns, k, bias = shape
    x, ws, bs = grouped_inputs(m, ns, k, bias)
    for cfg in [c for c in _gemv.candidates(m, max(ns), k) if c[-1] == 1]:
        ys = [torch.full((m, n), float("nan"), dtype=bf16, device="cuda") for n in ns]
        _gemv._launch_group(cfg, x, ws, bs, ys)
        for y, w, b in zip(ys, ws, bs):
            want = x.float() @ w.float().t() + (0 if b is None else b.float())
            assert err(y, want) <= 2 * err(_gemv._cublas(x, w, b), want) + 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GROUP_SHAPES)
def test_the_tuned_group_choice_replays_in_a_cuda_graph_as_it_runs_eagerly(shape):
    m, ns, k, bias = shape
    x, ws, bs = grouped_inputs(m, ns, k, bias)
    _gemv.group_op(x, ws, bs)  # tunes the key outside the capture, as fgraph's warm-up does
    assert (m, ns, k, bf16, bias, "group", x.device.index) in _gemv._choice
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ys = _gemv.group_op(x, ws, bs)
    for seed in (5, 6):
        x.copy_(rand(m, k, device="cuda", seed=seed))
        g.replay()
        assert all(map(torch.equal, ys, _gemv.group_op(x, ws, bs)))
