"""fgraph::norm_linear, a matmul (or fgraph::linear_glu) that reads an RMSNorm of a residual sum: off its kernel it is
the unfused torch ops bit for bit; a compiled piece's `rms_norm(x + r) @ w.T` is rewritten into it only where it may
serve (fgraph.config.small_m_norm), the sum handed to the add's other readers; on the GPU its kernel is as close to
the float32 result as the norm's launch and cuBLAS, inside a CUDA graph too."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fgraph
from examples.layers import gated_mlp, linear, rms_norm
from fgraph import kernels
from fgraph.compile import _small_m, compiler
from fgraph.kernels import _gemv

bf16 = torch.bfloat16
EPS = 1e-6


def rand(*shape, dtype=bf16, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def ops(gm, op) -> int:
    return sum(n.target is op for n in gm.graph.nodes)


def unfused(x, r, nw, w, b, glu):
    s = x if r is None else x + r
    y = linear(rms_norm(s, nw, EPS), w, b)
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, s


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("glu", [True, False])
def test_off_the_kernel_fgraph_norm_linear_is_the_unfused_ops_bit_for_bit(residual, glu):
    x, r, nw = rand(3, 40), rand(3, 40, seed=1), rand(40, seed=2)
    w, b = rand(48, 40, seed=3), (None if glu else rand(48, seed=4))
    y, s = kernels.norm_op(x, r if residual else None, nw, EPS, w, b, glu)
    want_y, want_s = unfused(x, r if residual else None, nw, w, b, glu)
    assert torch.equal(y, want_y)
    assert torch.equal(s, want_s) if residual else s.numel() == 0
    torch.library.opcheck(torch.ops.fgraph.norm_linear, (x, r if residual else None, nw, EPS, w, b, glu))


@pytest.mark.parametrize("glu", [True, False])
def test_off_its_kernel_the_normalised_rows_go_through_what_serves_the_matmul_alone(glu, monkeypatch):
    """The norm's launch, then fgraph::linear or linear_glu with their own tuned choice: where the kernel with the
    norm inside loses, the matmul's kernel without it may still serve (a lost comparison costs no launch)."""
    seen = []
    alone = _gemv.linear_glu if glu else _gemv.linear
    monkeypatch.setattr(_gemv, "linear_glu" if glu else "linear", lambda h, w, *b: seen.append(h) or alone(h, w, *b))
    x, r, nw = rand(3, 40), rand(3, 40, seed=1), rand(40, seed=2)
    w = rand(48, 40, seed=3)
    y, s = kernels.norm_op(x, r, nw, EPS, w, None, glu)
    (h,) = seen
    assert torch.equal(h, rms_norm(x + r, nw, EPS)) and torch.equal(y, unfused(x, r, nw, w, None, glu)[0])


def layer(x, r, n1, wqkv, bqkv, n2, w13, w2):
    """A decoder layer's matmuls around their norms: the qkv projection (bias) and the gated MLP, each reading the
    RMSNorm of a residual sum that a later add reads again."""
    s = x + r
    qkv = linear(rms_norm(s, n1, EPS), wqkv, bqkv)
    s2 = qkv[:, :16] + s  # (attention's place)
    return gated_mlp(rms_norm(s2, n2, EPS), w13, w2) + s2, qkv


def layer_args(m=2):
    return (rand(m, 16), rand(m, 16, seed=1), rand(16, seed=2), rand(24, 16, seed=3), rand(24, seed=4),
            rand(16, seed=5), rand(64, 16, seed=6), rand(16, 32, seed=7))  # fmt: skip


def test_a_layers_norms_go_into_the_matmuls_that_read_them_and_their_sums_to_the_adds_other_readers():
    a = layer_args()
    gm, other = make_fx(layer)(*a), make_fx(layer)(*a)
    assert _small_m.rewrite(other, "cpu", norm=True) == 3  # qkv and gate_up (with norms), down (fgraph::linear)
    assert ops(other, kernels.norm_op) == 2 and ops(other, kernels.glu_op) == 0 and ops(other, kernels.op) == 1
    gone = (torch.ops.aten.rsqrt.default, torch.ops.aten.mean.dim, torch.ops.aten.mm.default)
    assert not any(n.target in gone for n in other.graph.nodes)
    # the one add left is the layer's last (down + s2), reading the second op's sum
    assert sum(n.target is torch.ops.aten.add.Tensor for n in other.graph.nodes) == 1
    for want, got in zip(gm(*a), other(*a)):
        assert torch.equal(want, got)


def test_the_norm_rewrite_is_off_by_default_and_leaves_the_layer_as_before():
    a = layer_args()
    other = make_fx(layer)(*a)
    assert not fgraph.config.small_m_norm
    _small_m.rewrite(other, "cpu")
    assert ops(other, kernels.norm_op) == 0 and ops(other, kernels.glu_op) == 1


def test_a_norm_without_a_residual_add_is_rewritten_alone():
    def head(x, nw, w):  # the first layer's norm of the embedding, or a model's last before its head
        return linear(rms_norm(x, nw, EPS), w)

    a = (rand(2, 16), rand(16, seed=1), rand(24, 16, seed=2))
    gm, other = make_fx(head)(*a), make_fx(head)(*a)
    assert _small_m.rewrite(other, "cpu", norm=True) == 1 and ops(other, kernels.norm_op) == 1
    (node,) = (n for n in other.graph.nodes if n.target is kernels.norm_op)
    assert node.args[1] is None
    assert torch.equal(gm(*a), other(*a))


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 20),
    k=st.sampled_from([8, 24, 40]),
    n=st.sampled_from([8, 12, 32]),
    residual=st.booleans(),
    glu=st.booleans(),
    bias=st.booleans(),
)
def test_any_norm_before_a_matmul_is_rewritten_at_few_rows_and_computes_the_traced_bits(m, k, n, residual, glu, bias):
    def fn(x, r, nw, w, b):
        s = x + r if residual else x
        y = linear(rms_norm(s, nw, EPS), w, b if bias and not glu else None)
        if glu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return (y, s * 2) if residual else y  # (the sum read again after the matmul)

    w_rows = 2 * n if glu else n
    a = (rand(m, k), rand(m, k, seed=1), rand(k, seed=2), rand(w_rows, k, seed=3), rand(w_rows, seed=4))
    gm, other = make_fx(fn)(*a), make_fx(fn)(*a)
    _small_m.rewrite(other, "cpu", norm=True)
    assert ops(other, kernels.norm_op) == (m <= _gemv.MAX_ROWS)
    for want, got in zip(pytree.tree_leaves(gm(*a)), pytree.tree_leaves(other(*a))):
        assert torch.equal(want, got)


def test_what_fgraph_norm_linear_cannot_serve_stays_as_traced():
    x, nw, w = rand(2, 16), rand(16, seed=1), rand(24, 16, seed=2)

    def read_by_three(x, nw, w):  # HF's attention: q, k and v each read the norm
        h = rms_norm(x, nw, EPS)
        return linear(h, w), linear(h, w[:8]), linear(h, w[8:])

    def mean_over_rows(x, nw, w):
        xf = x.float()
        return linear(nw * (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + EPS)).to(x.dtype), w)

    def fourth_power(x, nw, w):
        xf = x.float()
        return linear(nw * (xf * torch.rsqrt(xf.pow(4).mean(-1, keepdim=True) + EPS)).to(x.dtype), w)

    cases = {
        "a norm read by three matmuls": (read_by_three, (x, nw, w)),
        "a mean over the rows": (mean_over_rows, (x, nw, w)),
        "another power": (fourth_power, (x, nw, w)),
        "float32": (lambda x, nw, w: linear(rms_norm(x, nw, EPS), w), (x.float(), nw.float(), w.float())),
        "more rows than the kernel takes": (lambda x, nw, w: linear(rms_norm(x, nw, EPS), w), (rand(32, 16), nw, w)),
    }
    for why, (fn, a) in cases.items():
        gm, other = make_fx(fn)(*a), make_fx(fn)(*a)
        _small_m.rewrite(other, "cpu", norm=True)
        assert ops(other, kernels.norm_op) == 0, why
        for want, got in zip(pytree.tree_leaves(gm(*a)), pytree.tree_leaves(other(*a))):
            assert torch.equal(want, got), why


def test_compiled_pieces_call_fgraph_norm_linear_when_switched_on_and_equal_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "small_m_norm", True)
    rewrite = _small_m.rewrite
    monkeypatch.setattr(_small_m, "rewrite", lambda gm, device_type="cuda", **kw: rewrite(gm, "cpu", **kw))
    params = layer_args()[2:]
    fn = lambda x, r, params: layer(x, r, *params)  # noqa: E731 (its own jit state)
    before = dict(compiler.counts)
    f = fgraph.jit(fn, batch={"x": fgraph.Batched(), "r": fgraph.Batched()}, buckets=[1, 4], compile=True)
    for m in (1, 3, 4):  # 3: padded into bucket 4
        x, r = rand(m, 16, seed=10 + m), rand(m, 16, seed=20 + m)
        for want, got in zip(fn(x, r, params), f(x, r, params)):
            torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=0)
    assert compiler.counts["norm"] - before["norm"] == 2 * 2  # two norms in each bucket's piece
    assert "fgraph kernels: fgraph::linear x1, fgraph::norm_linear x2" in str(fgraph.explain(f))


@pytest.mark.interpreter
def test_every_norm_config_and_the_norm_kernel_compute_the_unfused_result_in_the_interpreter():
    h = torch.float16
    for m, (n, k) in [(1, (20, 40)), (3, (64, 96)), (5, (33, 513)), (16, (64, 96))]:
        for residual in (True, False):
            for glu in (True, False):
                x, r, nw = rand(m, k, dtype=h), rand(m, k, dtype=h, seed=3), rand(k, dtype=h, seed=4)
                w = rand(2 * n if glu else n, k, dtype=h, seed=1) / k**0.5
                y, s = unfused(x.float(), (r.float() if residual else None), nw.float(), w.float(), None, glu)
                want_s = x + r if residual else x
                assert _gemv.candidates(m, n, k, glu, True)
                for cfg in _gemv.candidates(m, n, k, glu, True):
                    out = torch.full((m, n), float("nan"), dtype=h)
                    total = torch.full((m, k), float("nan"), dtype=h)
                    _gemv._launch(cfg, x, w, None, out, glu, (r if residual else None, nw, EPS, total))
                    torch.testing.assert_close(out.float(), y, atol=3e-2 * y.abs().max().item(), rtol=0)
                    assert not residual or torch.equal(total, want_s)
            got_s, got_h = torch.empty_like(x), torch.full((m, k), float("nan"), dtype=h)
            _gemv.kernel().add_rms_norm[(m,)](x, r if residual else x, nw, got_s, got_h, k, k, k, EPS,
                                              HAS_RES=residual, BLOCK=_gemv._pow2(k), PDL=False)  # fmt: skip
            torch.testing.assert_close(got_h, rms_norm(want_s, nw, EPS), atol=0, rtol=2e-3)
            assert not residual or torch.equal(got_s, want_s)
    assert all(c[-1] == 1 for c in _gemv.candidates(2, 40, 2100, norm=True))  # K is not split


# -- on the GPU ------------------------------------------------------------------------------------------------
# (rows, N, K, glu, bias): 0.5B's qkv (bias) and gate_up, 8B's qkv and gate_up, sizes off every block
GPU_SHAPES = [(1, 1152, 896, False, True), (8, 4864, 896, True, False), (1, 6144, 4096, False, False),
              (4, 14336, 4096, True, False), (3, 1000, 777, False, True)]  # fmt: skip


def err(y, want) -> float:
    return (y.float() - want).abs().max().item()


def gpu_inputs(m, n, k, glu, bias):
    x, r = rand(m, k, device="cuda"), rand(m, k, device="cuda", seed=1)
    nw = 1 + rand(k, device="cuda", seed=2) / 8
    w = rand(2 * n if glu else n, k, device="cuda", seed=3) / k**0.5
    return x, r, nw, w, (rand(n, device="cuda", seed=4) if bias else None)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_every_norm_kernel_is_as_close_to_the_float32_result_as_the_norms_launch_and_cublas(shape):
    m, n, k, glu, bias = shape
    x, r, nw, w, b = gpu_inputs(m, n, k, glu, bias)
    want, want_s = unfused(x.float(), r.float(), nw.float(), w.float(), None if b is None else b.float(), glu)
    y, s = _gemv._unfused(x, w, b, glu, (r, nw, EPS))
    assert torch.equal(s, x + r)
    torch.testing.assert_close(_gemv.add_rms_norm(x, r, nw, EPS)[1], rms_norm(x + r, nw, EPS))
    strided = torch.cat([x, x], dim=1)[:, :k]  # rows of another stride (a slice of a wider output): torch's ops
    got_s, got_h = _gemv.add_rms_norm(strided, r, nw, EPS)
    assert torch.equal(got_s, x + r) and torch.equal(got_h, rms_norm(x + r, nw, EPS))
    for cfg in _gemv.candidates(m, n, k, glu, True):
        out, total = torch.empty_like(y), torch.empty_like(x)
        _gemv._launch(cfg, x, w, b, out, glu, (r, nw, EPS, total))
        assert err(out, want) <= 2 * err(y, want) + 1e-2, cfg
        assert torch.equal(total, x + r), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_the_tuned_norm_choice_replays_in_a_cuda_graph_as_it_runs_eagerly(shape):
    m, n, k, glu, bias = shape
    x, r, nw, w, b = gpu_inputs(m, n, k, glu, bias)
    untuned = _gemv.counts["untuned"]
    kernels.norm_op(x, r, nw, EPS, w, b, glu)  # tunes the key outside the capture, as fgraph's warm-up does
    assert (m, w.shape[0], k, bf16, bias, glu, 2, x.device.index) in _gemv._choice
    # and the matmul alone first, which its fallback calls: timed in a capture, it could not have tuned there
    assert (m, w.shape[0], k, bf16, bias, glu, 0, x.device.index) in _gemv._choice
    assert _gemv.counts["untuned"] == untuned
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, s = kernels.norm_op(x, r, nw, EPS, w, b, glu)
    for seed in (5, 6):
        x.copy_(rand(m, k, device="cuda", seed=seed))
        g.replay()
        want_y, want_s = kernels.norm_op(x, r, nw, EPS, w, b, glu)
        assert torch.equal(y, want_y) and torch.equal(s, want_s)


@pytest.mark.gpu
def test_a_compiled_cuda_layer_calls_fgraph_norm_linear_and_equals_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "small_m_norm", True)
    params = [t.cuda() for t in layer_args()[2:]]
    fn = lambda x, r, params: layer(x, r, *params)  # noqa: E731 (its own jit state)
    before = compiler.counts["norm"]
    batch = {"x": fgraph.Batched(), "r": fgraph.Batched()}
    f = fgraph.jit(fn, batch=batch, buckets=[1, 8], mode="FULL", compile=True)
    for m in (1, 5, 8):
        x, r = rand(m, 16, device="cuda", seed=10 + m), rand(m, 16, device="cuda", seed=20 + m)
        for want, got in zip(fn(x, r, params), f(x, r, params)):
            torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=0)
    assert compiler.counts["norm"] - before == 2 * 2
