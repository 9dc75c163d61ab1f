"""Sliding-window models (Mistral's `sliding_window`) under the static-cache recipe keep a static cache.

transformers' StaticCache gives sliding-window layers a Python int counting their tokens (`cumulative_length_int`),
which a captured graph cannot update: the recipe's `cache_implementation="static"` is refused at trace time, and the
fix keeps a cache: a static cache of full-length layers (examples/hf_generate.py: full_static_cache), in which the
model's sliding-window mask still limits each query to its window. Jitted, that gives eager's tokens (eager with
transformers' own sliding-window cache is the oracle) and logits to float rounding, one decode trace for every
step, whether the window is smaller than the generated length (8, 3) or larger than the cache (4096)."""

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

import fgraph  # noqa: E402
from examples import hf_generate as G  # noqa: E402

CACHE = G.cache_parameter(transformers.MistralForCausalLM)  # `cache`, or `past_key_values` before transformers 5.24

IDS = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
NEW = 12  # 5 + 12 positions: past a window of 8 or 3, within one of 4096


def greedy(model, **kw):
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, disable_compile=True, **kw)
    with torch.no_grad():
        out = model.generate(IDS, output_scores=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("window", [8, 4096])
def test_the_static_recipe_on_a_sliding_window_model_names_a_fix_that_keeps_a_cache(window):
    model = G.tiny("mistral", sliding_window=window)
    assert any(layer.is_sliding for layer in transformers.StaticCache(config=model.config, max_cache_len=16).layers)
    G.jit_forward(model)
    with pytest.raises(fgraph.TraceError) as e:
        G.generate(model, IDS, 3)
    assert f"changes `{CACHE}.layers[0].cumulative_length_int` of donated state from 5 to 6" in e.value.what
    assert "sliding-window cache layers count tokens in a Python int" in e.value.what
    fix = e.value.fix
    assert "transformers.Cache(layers=[transformers.StaticLayer(max_cache_len=L) for _ in range(2)])" in fix
    assert f"generate(..., {CACHE}=cache)" in fix and "use_cache=False" not in fix


@pytest.mark.parametrize("window", [3, 8, 4096])
@pytest.mark.parametrize("mode", ["NONE", "FULL"])
def test_a_static_cache_of_full_length_layers_gives_eager_tokens(window, mode):
    model = G.tiny("mistral", sliding_window=window)
    want, want_scores = greedy(model, cache_implementation="static")  # transformers' own sliding-window cache
    f = G.jit_forward(model, mode)
    for _ in range(2):  # a new cache per generate: the same decode signature
        got, scores = greedy(model, **{CACHE: G.full_static_cache(model, 5 + NEW)})
        assert torch.equal(got, want)
        torch.testing.assert_close(scores, want_scores, rtol=0, atol=1e-4)
    s = f.stats()
    assert s["total"]["traces"] == 1 and len(f.entries) == 1 and s["fallbacks"]["init"] == 2  # prefills: eager


@torch.no_grad()
def test_one_early_initialised_full_length_cache_serves_every_generate():
    """The server loop: one cache, initialised up front (the prefill is traced too), reset between generates."""
    model = G.tiny("mistral", sliding_window=4)
    want = [greedy(model, cache_implementation="static")[0] for _ in range(2)]
    f = G.jit_forward(model, "FULL")
    cache = G.full_static_cache(model, 5 + NEW)
    cfg = model.config
    cache.early_initialization(2, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    for w in want:
        cache.reset()
        assert torch.equal(greedy(model, **{CACHE: cache})[0], w)
    s = f.stats()
    assert s["fallbacks"]["init"] == 0 and s["total"]["traces"] == 2  # the prefill and the decode step
