"""Hugging Face MoE models jit as they are (issue #31): while fgraph traces, torch.compiler.is_compiling() is true,
as under torch.compile and torch.export, so transformers takes its traceable paths (its experts' grouped matmul,
whose fake kernel takes bfloat16 only, falls back to one matmul per expert in other dtypes). The flag is fgraph's
only while it traces: it is put back after, on errors too, and a jitted call inside torch.compile is still told
apart from fgraph's own trace."""

import copy

import pytest
import torch

import fgraph
from examples import hf_generate as G
from tests.test_semantics import MODES

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=64,
    max_position_embeddings=64,
    use_cache=False,  # (a DynamicCache is Python state that grows per call)
)
MODELS = {
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **TINY,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=24,
        )
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**TINY, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def moe(request):
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


# float32: what transformers builds by default (its configs name no dtype); bfloat16: its grouped_mm path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_hf_moe_models_jit_as_they_are_and_equal_eager(moe, dtype, mode):
    model = moe.to(dtype)
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(1))
    f = fgraph.jit(model, mode=mode)
    assert torch.equal(f(ids).logits, model(ids).logits)
    assert torch.equal(f(ids).logits, model(ids).logits)  # the second call replays
    assert f.stats()["total"]["traces"] == 1
    assert not torch.compiler.is_compiling()  # put back once the trace is done


def test_is_compiling_is_true_only_while_fgraph_traces_and_put_back_on_errors():
    seen = []

    def f(x):
        seen.append(torch.compiler.is_compiling())
        if x.shape[0] == 2:
            raise ValueError("two rows")
        return x + 1

    j = fgraph.jit(f)
    assert torch.equal(j(torch.ones(3)), torch.ones(3) + 1)
    assert seen == [True] and not torch.compiler.is_compiling()  # traced once, then replayed
    with pytest.raises(ValueError, match="two rows"):
        j(torch.ones(2))
    assert not torch.compiler.is_compiling()
    with fgraph.disable_jit():
        j(torch.ones(3))
    assert seen[-1] is False  # the plain function runs as plain Python


def test_repeated_layers_still_copy_their_traces_under_fgraphs_flag():
    calls = []

    @fgraph.repeated
    def layer(x):
        calls.append(1)
        return x * 2

    j = fgraph.jit(lambda x: layer(layer(layer(x))))
    assert torch.equal(j(torch.ones(3)), torch.full((3,), 8.0))
    assert len(calls) == 1  # traced once, copied twice: fgraph's trace is not taken for torch.compile's


# -- on CUDA: transformers' float32 experts read their row offsets on the host (fgraph/trace/_foreign.py) ----------
GPU_MODES = [(m, False) for m in MODES] + [("FULL_AND_PIECEWISE", True)]  # (mode, compile)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode, compile", GPU_MODES)
@torch.no_grad()
def test_hf_moe_models_on_cuda_equal_eager_in_every_mode(moe, dtype, mode, compile):
    model = copy.deepcopy(moe).to("cuda", dtype)
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(1)).cuda()
    want = model(ids).logits
    f = fgraph.jit(model, mode=mode, compile=compile)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for _ in range(2):  # the trace and capture, then a replay
        torch.testing.assert_close(f(ids).logits, want, **tol)
    assert f.stats()["total"]["traces"] == 1
    assert "grouped_mm_fallback" not in f.lower(ids).as_text()  # no host sync left in the program


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_hf_moe_static_cache_generate_on_cuda_gives_eagers_tokens(mode):
    model = G.tiny("qwen2_moe", "cuda")
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1)).cuda()
    want = G.generate(model, ids, 6)
    G.jit_forward(model, mode, compile=False)
    assert torch.equal(G.generate(model, ids, 6), want)
    assert torch.equal(G.generate(model, ids, 6), want)  # replays


# -- through fgraph's MoE primitive (examples/hf_moe.py) -------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_hf_qwen2_moe_through_fgraphs_moe_primitive_equals_transformers_own(device, mode):
    """The swapped blocks compute transformers' MoE (float32: equal to rounding), keep one copy of the shared
    expert's weights, and a jitted model runs the primitive as a break."""
    from examples.hf_moe import use_fgraph_moe

    theirs = G.tiny("qwen2_moe", device)
    mine = copy.deepcopy(theirs)
    params = sum(p.numel() for p in mine.parameters())
    assert use_fgraph_moe(mine) == 2 and use_fgraph_moe(mine) == 0  # every layer's block, once
    assert sum(p.numel() for p in mine.parameters()) == params
    ids = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(1)).to(device)
    want = theirs(ids, use_cache=False).logits
    torch.testing.assert_close(mine(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    f = fgraph.jit(mine, mode=mode)
    for _ in range(2):  # the trace (and capture), then a replay
        torch.testing.assert_close(f(ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
    assert "fgraph.moe" in f.lower(ids, use_cache=False).as_text()
    G.jit_forward(mine, mode, compile=False)  # and through static-cache generate: transformers' greedy tokens
    assert torch.equal(G.generate(mine, ids, 5), G.generate(theirs, ids, 5))
