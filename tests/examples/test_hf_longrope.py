"""A longrope model (Phi-3 128k, Phi-3.5, Phi-4-mini) under the static-cache recipe: transformers makes its rotary
embedding's `long_inv_freq` lazily, on the first forward, and copies the chosen frequencies into `inv_freq` in place
each call. A trace's fake `long_inv_freq` never stays on the model; the recipe names one fix (donate `self`), which
gives eager's tokens. Before transformers 5.21 longrope chose its frequencies with an `if` on the positions, and a
dynamic-RoPE Llama still does: that host sync, in transformers' own code, names a configuration to choose."""

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402

import fgraph  # noqa: E402
from examples import hf_generate as G  # noqa: E402
from tests.hf import NO_SPECIAL_TOKENS  # noqa: E402

# before 5.21 transformers chose longrope's frequencies with an `if` on the positions: a host sync under a trace
HOST_LONGROPE = Version(transformers.__version__) < Version("5.21")
on_device_longrope = pytest.mark.skipif(
    HOST_LONGROPE, reason="this transformers chooses longrope's frequencies on the host"
)
IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))


def tiny(arch: str, rope: dict):
    """A random 2-layer `arch` ("Phi3", "Llama") with these RoPE parameters, weights as the other HF tests' (~0.15)."""
    cfg = getattr(transformers, f"{arch}Config")(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
        rope_parameters=dict(rope_theta=10000.0, original_max_position_embeddings=10, **rope),
        **NO_SPECIAL_TOKENS,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.generation_config.update(**NO_SPECIAL_TOKENS)
    return model.eval()


def tiny_longrope():
    short, long = [1.0, 1.1, 1.2, 1.5, 2, 3, 4, 5], [1.0, 2, 4, 8, 16, 32, 64, 128]
    return tiny("Phi3", dict(rope_type="longrope", short_factor=short, long_factor=long))


@on_device_longrope
def test_the_recipe_names_one_fix_and_leaves_the_model_working():
    model = tiny_longrope()
    want = G.generate(tiny_longrope(), IDS, 6)  # 7 + 6 positions: past original_max_position_embeddings
    G.jit_forward(model)
    with pytest.raises(fgraph.TraceError, match=r"writes in place into self\.model\.rotary_emb\.inv_freq") as e:
        G.generate(model, IDS, 6)
    assert "add 'self' to donate" in e.value.fix
    assert not isinstance(model.model.rotary_emb.long_inv_freq, torch._subclasses.FakeTensor)
    with fgraph.disable_jit():
        assert torch.equal(G.generate(model, IDS, 6), want)


@on_device_longrope
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_donating_self_gives_eager_tokens(mode):
    model = tiny_longrope()
    want = G.generate(tiny_longrope(), IDS, 6)
    model.forward = fgraph.jit(model.forward, donate=[G.cache_parameter(model), "self"], mode=mode)
    for _ in range(2):
        assert torch.equal(G.generate(model, IDS, 6), want)


@on_device_longrope
def test_a_fake_left_on_a_module_is_put_back():
    model = tiny_longrope()
    f = fgraph.jit(model, mode="FULL")
    with torch.no_grad(), pytest.raises(fgraph.EscapeError, match="put back") as e:
        f(IDS, use_cache=False)
    assert "call it once before jitting it" in e.value.fix
    assert not hasattr(model.model.rotary_emb, "long_inv_freq")
    with torch.no_grad(), fgraph.disable_jit():
        assert torch.equal(f(IDS, use_cache=False).logits, tiny_longrope()(IDS, use_cache=False).logits)


@pytest.mark.skipif(not HOST_LONGROPE, reason="this transformers keeps longrope's choice on the device")
def test_a_longrope_that_chooses_on_the_host_names_the_configuration_and_leaves_the_model_working():
    model = tiny_longrope()
    want = G.generate(tiny_longrope(), IDS, 6)
    G.jit_forward(model)
    with pytest.raises(fgraph.TraceError, match=r"modeling_rope_utils\.py:\d+ needs the tensor's") as e:
        G.generate(model, IDS, 6)
    assert "installed package `transformers`'s, not yours" in e.value.fix and "'longrope' before" in e.value.fix
    assert not hasattr(model.model.rotary_emb, "long_inv_freq")
    with fgraph.disable_jit():
        assert torch.equal(G.generate(model, IDS, 6), want)


def test_a_host_sync_in_an_installed_package_says_so_and_names_a_configuration():
    """Llama with dynamic RoPE recomputes its frequencies under `if seq_len > cached` (transformers'
    modeling_rope_utils): not the user's line to change, so the fix names the configuration instead."""
    model = tiny("Llama", dict(rope_type="dynamic", factor=4.0))
    f = fgraph.jit(model, mode="FULL")
    with (
        torch.no_grad(),
        pytest.raises(fgraph.TraceError, match=r"modeling_rope_utils\.py:\d+ needs the tensor's") as e,
    ):
        f(IDS, use_cache=False)
    assert "installed package `transformers`'s, not yours" in e.value.fix and "not 'dynamic'" in e.value.fix
