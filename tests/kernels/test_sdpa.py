"""fgraph::sdpa_decode's kernels at work (tests/compile/test_sdpa.py has its rewrite): one query row per sequence
against eager's math in float64, as close as torch's own SDPA at every dtype, with and without splits, any mask
(float, boolean, none, a row that sees no key), in CUDA graphs; and a compiled Hugging Face decode step that calls
it and gives eager's tokens."""

import pytest
import torch
import torch.nn.functional as F

import fgraph
from fgraph.compile import compiler
from fgraph.kernels import _sdpa


def case(b, hq, hkv, s, d, dtype, mask="float", device="cuda", seed=0):
    """(q, k, v, bias) of a decode step: b sequences, hq query heads over hkv KV heads, s cached positions, ~60 % of
    them visible (the first always)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, 1), (hkv, s), (hkv, s)))
    m = torch.rand(b, 1, 1, s, generator=g) > 0.4
    m[..., 0] = True
    bias = {"float": torch.where(m, 0.0, float("-inf")), "bool": m, None: None}[mask]
    if bias is not None and mask == "float":
        bias = bias.to(dtype)
    return [t.to(device, dtype) for t in (q, k, v)] + [None if bias is None else bias.to(device)]


def exact(q, k, v, bias, scale):
    """Eager's math in float64."""
    g = q.shape[1] // k.shape[1]
    if bias is not None:
        bias = torch.where(bias, 0.0, float("-inf")) if bias.dtype == torch.bool else bias
        bias = bias.double()
    k, v = (t.double().repeat_interleave(g, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=bias, scale=scale)


def err(a, b) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def check(q, k, v, bias, scale=0.125, run=_sdpa.sdpa_decode):
    """The kernel's (`run`'s) largest error against float64 is within twice torch's own SDPA's at this dtype (plus
    float32 rounding): as close as eager."""
    want = exact(q, k, v, bias, scale)
    got = run(q, k, v, bias, scale)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch_err = err(_sdpa.reference(q, k, v, bias, scale), want)
    assert err(got, want) <= 2 * torch_err + 1e-5, (err(got, want), torch_err)


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, None])
def test_the_kernel_computes_eagers_math_in_the_interpreter(splits, monkeypatch):
    if splits == 1:
        monkeypatch.setattr(_sdpa, "splits_for", lambda *a, **k: 1)
    for b, hq, hkv, s, d, mask in [(1, 14, 2, 300, 64, "float"), (3, 6, 2, 130, 16, "bool"), (2, 4, 4, 70, 80, None)]:
        check(*case(b, hq, hkv, s, d, torch.float32, mask, device="cpu"), run=_sdpa.launch)
    q, k, v, bias = case(3, 6, 2, 130, 16, torch.float32, "bool", device="cpu")
    bias[1] = False  # a row that sees no key: 0, as torch's SDPA (its safe softmax), in every split and merged
    torch.testing.assert_close(_sdpa.launch(q, k, v, bias, 0.125), _sdpa.reference(q, k, v, bias, 0.125))
    check(q, k, v, bias, run=_sdpa.launch)


SHAPES = [  # (B, Hq, Hkv, S, D): the 0.5B's heads at decode sizes, Llama-8B's, MHA, a head dim not a power of two
    (1, 14, 2, 1088, 64),
    (3, 14, 2, 1088, 64),
    (64, 14, 2, 1088, 64),
    (248, 14, 2, 200, 64),
    (512, 14, 2, 64, 64),
    (8, 32, 8, 1030, 128),
    (2, 8, 8, 77, 128),
    (3, 12, 4, 500, 80),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernel_is_as_close_as_torchs_sdpa(shape, dtype):
    check(*case(*shape, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["bool", None])
def test_a_boolean_mask_or_none(mask):
    check(*case(3, 14, 2, 1088, 64, torch.bfloat16, mask))


@pytest.mark.gpu
def test_a_row_that_sees_no_key_is_zero_as_torchs_sdpa_gives_and_leaves_the_others_alone():
    q, k, v, bias = case(4, 14, 2, 1088, 64, torch.float32, "bool")
    bias[2] = False
    got = _sdpa.sdpa_decode(q, k, v, bias, 0.125)
    assert got[2].eq(0).all()  # SDPA's safe softmax: 0, where a plain softmax of only -inf is NaN
    torch.testing.assert_close(got, _sdpa.reference(q, k, v, bias, 0.125))  # eager's, that row included
    keep = [0, 1, 3]
    torch.testing.assert_close(got[keep], exact(q, k, v, bias, 0.125)[keep].float())


@pytest.mark.gpu
def test_a_captured_call_reads_each_replays_mask_and_cache():
    """Splits are a function of the shapes only: one graph serves any mask and any cache contents."""
    q, k, v, bias = case(8, 14, 2, 1088, 64, torch.bfloat16)
    torch.cuda.synchronize()
    _sdpa.sdpa_decode(q, k, v, bias, 0.125)  # (Triton compiles outside the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _sdpa.sdpa_decode(q, k, v, bias, 0.125)
    for seed in (1, 2):
        nq, nk, nv, nb = case(8, 14, 2, 1088, 64, torch.bfloat16, seed=seed)
        for t, n in ((q, nq), (k, nk), (v, nv), (bias, nb)):
            t.copy_(n)
        g.replay()
        torch.testing.assert_close(out, _sdpa.sdpa_decode(q, k, v, bias, 0.125), rtol=0, atol=0)


@pytest.mark.gpu
def test_the_op_passes_opcheck_on_cuda():
    q, k, v, bias = case(3, 14, 2, 200, 64, torch.bfloat16)
    torch.library.opcheck(torch.ops.fgraph.sdpa_decode, (q, k, v, bias, 0.125))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_hf_decode_step_calls_the_kernel_and_gives_eagers_tokens(dtype, monkeypatch):
    from examples import hf_generate as G

    monkeypatch.setattr(fgraph.config, "sdpa_decode", True)

    model = G.tiny("qwen2", "cuda", dtype)
    model.set_attn_implementation("sdpa")  # (G.tiny's is eager attention: matmuls and a softmax, no SDPA call)
    ids = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(0)).cuda()
    want = G.generate(model, ids, 8)
    before = compiler.counts["sdpa"]
    f = G.jit_forward(model, "FULL_AND_PIECEWISE", compile=True)
    got = G.generate(model, ids, 8)
    assert compiler.counts["sdpa"] - before >= 2  # the decode piece's two layers
    assert f.stats()["total"]["replays"] >= 6
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # bf16: a different summation order may flip a near-tie; the first tokens agree
        assert torch.equal(got[:, : ids.shape[1] + 2], want[:, : ids.shape[1] + 2])
