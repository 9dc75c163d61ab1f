"""The functions under test, cases and fixtures its specs share (test_X and test_X_*)."""

import contextlib

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from fgraph import kernels
from fgraph.compile import _small_m

bf16 = torch.bfloat16


def rand(*shape, dtype=bf16, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def linears(gm) -> int:
    return sum(n.target is kernels.op for n in gm.graph.nodes)


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


def symbolic_rows(fn, a):
    """fn traced as fgraph traces a piece: the first axis of the activations symbolic, the weights' sizes static."""
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t, rows):
        dims = [DimDynamic.DYNAMIC if i == 0 and rows else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    fakes = [fake(t, rows=i < 2) for i, t in enumerate(a)]  # model's x and x3
    with mode:  # tracing_mode as fgraph's: the Python dispatcher (torch 2.11/2.12's C++ matmul calls numel())
        return make_fx(fn, tracing_mode="symbolic")(*fakes)


@contextlib.contextmanager
def rewriting_on_cpu(monkeypatch):
    """Compiled pieces rewritten as CUDA ones are (the rewrite is for CUDA pieces; here its CPU path is checked)."""
    rewrite = _small_m.rewrite
    monkeypatch.setattr(_small_m, "rewrite", lambda gm, device_type="cuda", **kw: rewrite(gm, "cpu", **kw))
    yield


def mlp(params, x):
    h = F.linear(x, params["w1"], params["b1"]).relu()
    return F.linear(h, params["w2"]) + x


# -- fgraph::linears: matmuls over the same rows in one launch --------------------------------------------------
def groups(gm) -> int:
    return sum(n.target is kernels.group_op for n in gm.graph.nodes)


def hf_qkv(x, wq, bq, wk, bk, wv, bv):
    """transformers' Qwen2Attention's projections: three linears (with biases) of one 3-D x [B, S, H]."""
    return F.linear(x, wq, bq).transpose(0, 1), F.linear(x, wk, bk), F.linear(x, wv, bv)


def qkv_args(lead=(2, 1), bias=True):
    ws = [rand(n, 40, seed=i) for i, n in enumerate((24, 8, 8))]
    bs = [rand(n, seed=10 + i) if bias else None for i, n in enumerate((24, 8, 8))]
    return (rand(*lead, 40, seed=9), *(t for pair in zip(ws, bs) for t in pair))


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


# -- fgraph::linear_glu: a gated MLP's gate_up matmul and its activation -------------------------------------------
def gated(x, w13):
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.silu(gate) * up


def glus(gm) -> int:
    return sum(n.target is kernels.glu_op for n in gm.graph.nodes)


GATED = {
    "chunk": gated,
    "split": lambda x, w: (lambda g, u: F.silu(g) * u)(*F.linear(x, w).split(24, dim=1)),
    "split_with_sizes, up times silu": lambda x, w: (lambda g, u: u * F.silu(g))(*F.linear(x, w).split([24, 24], -1)),
}


def hf_mlp(x, wg, wu, wd):
    """transformers' LlamaMLP / Qwen2MLP: separate gate and up projections, over a 3-D x [B, S, H]."""
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


PAIRED = {
    "3-D, as transformers' MLP": (hf_mlp, (2, 1, 40)),
    "2-D": (hf_mlp, (3, 40)),
    "up times silu": (lambda x, wg, wu, wd: F.linear(F.linear(x, wu) * F.silu(F.linear(x, wg)), wd), (3, 40)),
}


# -- on the GPU ------------------------------------------------------------------------------------------------
# (rows, N, K, bias): decode shapes of the 0.5B (qkv with its bias, o, down) and 8B (o), and sizes off every block
GPU_SHAPES = [(1, 1152, 896, True), (8, 896, 4864, False), (16, 4096, 4096, False), (3, 1000, 777, True)]


def err(y, want) -> float:
    return (y.float() - want).abs().max().item()


# (rows, N, K) of fgraph::linear_glu: 0.5B's and 8B's gate_up at decode sizes, and sizes off every block
GLU_SHAPES = [(1, 4864, 896), (8, 4864, 896), (1, 14336, 4096), (3, 1000, 777)]


def gated_inputs(m, n, k):
    return rand(m, k, device="cuda"), rand(2 * n, k, device="cuda", seed=1) / k**0.5


# (rows, N of each weight, K, bias) of fgraph::linears: 0.5B's and 8B's q, k and v at decode sizes, and sizes off
# every block
GROUP_SHAPES = [(1, (896, 128, 128), 896, True), (8, (896, 128, 128), 896, True), (1, (4096, 1024, 1024), 4096, False),
                (3, (100, 36, 36), 777, True)]  # fmt: skip


def grouped_inputs(m, ns, k, bias):
    ws = [rand(n, k, device="cuda", seed=i) / k**0.5 for i, n in enumerate(ns)]
    bs = [rand(n, device="cuda", seed=9 + i) if bias else None for i, n in enumerate(ns)]
    return rand(m, k, device="cuda"), ws, bs
