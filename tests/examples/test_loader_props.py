"""The loader's promise as a property: a checkpoint loads into a model that computes what transformers computes
for it, or it is refused with a one-line CheckpointError; never another exception, never a silent mismatch.

Each example draws a tiny config of one architecture (every one the examples load, plus ones they refuse) and
varies what real checkpoints vary: tied head, biases, an explicit head_dim, kv heads, eps, theta, every RoPE type
transformers has for these models, sliding windows, the MoE keys, the dtype, the config.json format (transformers
5's `rope_parameters` or the legacy `rope_theta` + `rope_scaling`) and keys left out. transformers saves the model
and reads the edited directory back; that reading is the oracle of what the checkpoint means. Then:
- transformers cannot load or run it: ours must refuse it;
- it uses a feature the examples do not implement (`unsupported`, read off transformers' own config): ours must
  refuse it, naming the key;
- otherwise ours must load it, and the logits of a batched prefill and of decode steps must match at float32.
"""

import json
import os
import re
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from hypothesis import HealthCheck, given, reject, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from examples import checkpoint, llama, qwen2_moe  # noqa: E402
from tests.examples.test_models import assert_steps_match_hf  # noqa: E402
from tests.hf import NO_SPECIAL_TOKENS, save_tiny  # noqa: E402

# architecture -> (transformers model class, its config class)
MODELS = {
    "LlamaForCausalLM": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
    "Qwen2ForCausalLM": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    "MistralForCausalLM": (transformers.MistralForCausalLM, transformers.MistralConfig),
    "Qwen2MoeForCausalLM": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig),
    "MixtralForCausalLM": (transformers.MixtralForCausalLM, transformers.MixtralConfig),
}
ACCEPTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"}
IMPLEMENTED_ROPE = ("default", "linear", "llama3")
# Keys a config.json may leave out (transformers then takes its class default; so must we)
OPTIONAL = (
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "hidden_act",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "attention_bias",
    "mlp_bias",
    "qkv_bias",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
    "dtype",
)
VOCAB = 128  # assert_steps_match_hf's prompts are ids < 128
STEPS = 5  # its longest sequence reaches 11 + 5 = 16 tokens: max_position_embeddings >= 16


def maybe(strategy):
    """A key's value, or None for a key left out of the config (transformers' default)."""
    return st.one_of(st.none(), strategy)


@st.composite
def rope(draw, head_dim: int, max_pos: int) -> dict:
    """rope_parameters of one type transformers supports for these models, with parameters that make it matter at
    the tested positions (short original contexts, small thetas)."""
    kind = draw(st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional"]))
    p = {"rope_type": kind, "rope_theta": draw(st.sampled_from([100.0, 1e4, 1e6]))}
    if kind in ("linear", "dynamic", "yarn"):
        p["factor"] = draw(st.sampled_from([2.0, 4.0]))
    if kind == "yarn":
        p["original_max_position_embeddings"] = max_pos // 2
    if kind == "llama3":
        p.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        p["original_max_position_embeddings"] = draw(st.sampled_from([4, 8, max_pos // 2]))
    if kind == "longrope":
        p.update(short_factor=[1.0] * (head_dim // 2), long_factor=[3.0] * (head_dim // 2), factor=2.0)
        p["original_max_position_embeddings"] = max_pos // 2
    if kind == "proportional" or draw(st.integers(0, 9)) == 0:
        p["partial_rotary_factor"] = 0.5
    return p


@st.composite
def checkpoints(draw) -> dict:
    """{"arch", "config" (kwargs of transformers' config class), "edit" (what to change in config.json)}."""
    arch = draw(st.sampled_from(list(MODELS)))
    qwen, moe = arch.startswith("Qwen2"), arch in ("Qwen2MoeForCausalLM", "MixtralForCausalLM")
    heads = draw(st.sampled_from([2, 4]))
    hidden = draw(st.sampled_from([32, 64]))
    head_dim = draw(st.sampled_from([None, 8, 24]))  # 24: differs from hidden / heads for every draw
    max_pos = draw(st.sampled_from([16, 32]))
    n_layers = draw(st.integers(1, 3))
    c = dict(
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0])),
        intermediate_size=draw(st.sampled_from([32, 48])),
        vocab_size=VOCAB,
        max_position_embeddings=max_pos,
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        tie_word_embeddings=draw(st.booleans()),
        hidden_act=draw(st.sampled_from(["silu"] * 8 + ["swish", "gelu"])),
        rope_parameters=draw(rope(head_dim or hidden // heads, max_pos)),
        **NO_SPECIAL_TOKENS,
    )
    if head_dim is not None:
        c["head_dim"] = head_dim
    for key in ("attention_bias", "mlp_bias"):  # read by Llama; other architectures ignore them
        if (v := draw(maybe(st.sampled_from([False, False, True])))) is not None:
            c[key] = v
    if qwen:
        c.update(use_sliding_window=draw(st.booleans()), max_window_layers=draw(st.sampled_from([0, 1, n_layers])))
    c["sliding_window"] = draw(st.sampled_from([None, 4, 12, max_pos, 4 * max_pos]))
    if arch == "Qwen2MoeForCausalLM":
        experts = draw(st.sampled_from([2, 4]))
        c.update(
            num_experts=experts,
            num_experts_per_tok=draw(st.integers(1, experts)),
            moe_intermediate_size=draw(st.sampled_from([16, 32])),
            shared_expert_intermediate_size=draw(st.sampled_from([16, 32])),
            norm_topk_prob=draw(st.booleans()),
            decoder_sparse_step=draw(st.sampled_from([1, 1, 2])),
            mlp_only_layers=draw(st.lists(st.integers(0, n_layers - 1), unique=True, max_size=2)),
            qkv_bias=draw(st.sampled_from([True, True, False])),
        )
    elif moe:
        experts = draw(st.sampled_from([2, 4]))
        c.update(num_local_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)))
    edit = dict(
        legacy_rope=draw(st.booleans()),  # rope_theta + rope_scaling, as transformers 4 wrote them
        both_ropes=draw(st.integers(0, 4)) == 0,  # legacy keys beside an equal rope_parameters
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        dtype_key=draw(st.sampled_from(["dtype", "torch_dtype", None])),
        drop=draw(st.lists(st.sampled_from(OPTIONAL), unique=True, max_size=2)),
        rename=draw(st.sampled_from([None] * 12 + ["Qwen3ForCausalLM", "GemmaForCausalLM"])),
        # keys set by hand: null kv heads (= the heads), a top-level theta beside the rope dicts (transformers 4's
        # place for it, stale here), every layer a sliding-window one
        set=draw(
            st.sampled_from(
                [{}] * 6
                + [
                    {"num_key_value_heads": None},
                    {"rope_theta": 5e5},
                    {"layer_types": ["sliding_attention"] * n_layers},
                ]
            )
        ),
    )
    return dict(arch=arch, config=c, edit=edit)


def write_config(path: str, edit: dict) -> None:
    """config.json as another exporter (or a person) would have written it."""
    f = os.path.join(path, "config.json")
    c = json.load(open(f))
    c.pop("dtype", None)
    if edit["dtype_key"]:
        c[edit["dtype_key"]] = edit["dtype"]
    if edit["legacy_rope"] and c.get("rope_parameters"):
        params = dict(c["rope_parameters"])
        c["rope_theta"] = params.pop("rope_theta")
        if params.get("rope_type") != "default" or len(params) > 1:
            c["rope_scaling"] = dict(params, type=params.pop("rope_type"))
        if not edit["both_ropes"]:
            del c["rope_parameters"]
    for key in edit["drop"]:
        c.pop(key, None)
    c.update(edit["set"])
    if edit["rename"]:
        c["architectures"] = [edit["rename"]]
    json.dump(c, open(f, "w"))


def transformers_model(arch: str, path: str):
    """What transformers makes of the directory, with its logits for one prompt as long as the tested sequences,
    or (None, None) when it cannot load it whole or run it."""
    try:
        hf, info = MODELS[arch][0].from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")):
            return None, None
        with torch.no_grad():
            out = hf.eval()(torch.arange(STEPS + 11)[None] % VOCAB).logits
        return (hf, out) if bool(torch.isfinite(out).all()) else (None, None)
    except Exception:  # any failure of transformers itself: there is nothing to match
        return None, None


def two_ropes_disagree(arch: str, path: str, logits: torch.Tensor) -> bool:
    """Whether config.json holds both rope dicts and transformers computes another model from `rope_parameters`
    alone than from both (it reads `rope_scaling` first): a checkpoint whose meaning is unclear."""
    f = os.path.join(path, "config.json")
    text = open(f).read()
    c = json.loads(text)
    if not (c.get("rope_scaling") and c.get("rope_parameters")):
        return False
    json.dump({k: v for k, v in c.items() if k != "rope_scaling"}, open(f, "w"))
    try:
        _, other = transformers_model(arch, path)
    finally:
        open(f, "w").write(text)
    return other is None or not torch.allclose(other, logits, atol=1e-5, rtol=1e-5)


def unsupported(arch: str, c) -> list[str]:
    """What, in transformers' reading of the config, the examples do not implement: words one of which their
    refusal must name (empty when they implement all of it)."""
    if arch not in ACCEPTED:
        return [arch]
    why = []
    if c.hidden_act not in ("silu", "swish"):  # transformers' "swish" is SiLU too
        why.append("hidden_act")
    if arch == "LlamaForCausalLM":  # the other architectures here have fixed biases, whatever the config says
        why += [key for key in ("attention_bias", "mlp_bias") if getattr(c, key)]
    rope = c.rope_parameters
    if rope["rope_type"] not in IMPLEMENTED_ROPE:
        why.append(rope["rope_type"])
    # the layers `layer_types` names get a KV cache that keeps only the window (transformers' cached decode then
    # differs from its full forward, which is what the steps here are compared with), in every architecture
    windowed = "sliding_attention" in (getattr(c, "layer_types", None) or [])
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):  # their mask has the window on every layer
        windowed = windowed or c.sliding_window is not None
    # a window no shorter than the longest sequence the model serves (the engine's cap) never hides a key
    if windowed and not (getattr(c, "sliding_window", None) or 0) >= c.max_position_embeddings:
        why.append("sliding_window")
    return why


def load(path: str):
    """(config, params, step maker) through the loader examples.generate would pick for the directory."""
    if checkpoint.architecture(path) in qwen2_moe.ARCHITECTURES:
        return *qwen2_moe.load(path, dtype="float32"), qwen2_moe.make_step
    return *checkpoint.load(path, dtype="float32"), llama.make_step


def check(case: dict) -> tuple[str, str]:
    """One checkpoint, end to end: ("match", "") or ("refused", the CheckpointError's message)."""
    arch = case["arch"]
    with tempfile.TemporaryDirectory() as path:
        try:
            save_tiny(MODELS[arch][0], MODELS[arch][1](**case["config"]), path)
        except Exception:  # a config transformers cannot build a model of (its validation, its init): no checkpoint
            reject()
        write_config(path, case["edit"])
        hf, logits = transformers_model(arch, path)
        why = unsupported(case["edit"]["rename"] or arch, hf.config) if hf is not None else ["transformers fails"]
        if hf is not None and two_ropes_disagree(arch, path, logits):
            why.append("disagree")
        try:
            cfg, params, make_step = load(path)
        except checkpoint.CheckpointError as e:
            assert "\n" not in e.what, f"a CheckpointError of more than one line: {e.what!r}"
            assert why, f"refused a checkpoint transformers runs and the examples implement: {e.what}"
            assert hf is None or any(w in e.what for w in why), f"the refusal does not name one of {why}: {e.what}"
            return "refused", e.what
        assert not why, f"loaded a checkpoint the examples do not implement ({why}): {hf and hf.config}"
        assert_steps_match_hf(make_step(cfg), cfg, hf, params, n_steps=STEPS)
        auto = MODELS[arch][1].from_pretrained(path).dtype or torch.float32  # else the weights' (saved in float32)
        assert checkpoint.dtype_of(None, path) == auto, "the checkpoint's own dtype is not transformers' dtype='auto'"
        return "match", ""


@pytest.fixture(autouse=True, scope="module")
def tiny_models_settings():
    """One intra-op thread: on a busy 2-core host a [16, 64] matmul took 3 ms with two threads (their barrier
    waits for a core), 18 us with one. And transformers' warnings about drawn configs (rope keys it does not
    expect, ...) stay unformatted."""
    threads, level = torch.get_num_threads(), transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(level)


@settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(checkpoints())
def test_a_checkpoint_loads_as_transformers_reads_it_or_is_refused(case):
    check(case)


# ------------------------------------------------------------------------------------- what the property found
BASE = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=32,
    vocab_size=VOCAB,
    max_position_embeddings=32,
    **NO_SPECIAL_TOKENS,
)
MOE = {
    "Qwen2MoeForCausalLM": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
}
EDIT = dict(legacy_rope=False, both_ropes=False, dtype="float32", dtype_key="dtype", drop=[], rename=None, set={})
LLAMA3 = dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)


def case(arch: str, edit: dict | None = None, **config) -> dict:
    return dict(arch=arch, config={**BASE, **MOE.get(arch, {}), **config}, edit={**EDIT, **(edit or {})})


# name: (checkpoint, None: it loads and matches transformers | a regex its refusal must match). Each of these
# failed the property before its fix; the comment says what the loader did then.
FOUND = {
    # refused, though transformers' "swish" is SiLU
    "swish": (case("Qwen2ForCausalLM", hidden_act="swish"), None),
    # refused: Qwen2 and Mixtral have fixed biases and never read these keys
    "qwen2-ignores-bias-keys": (case("Qwen2ForCausalLM", attention_bias=True, mlp_bias=True), None),
    "mixtral-ignores-bias-keys": (case("MixtralForCausalLM", attention_bias=True), None),
    # loaded with the whole head rotated; transformers rotates part of it (and then fails in these models)
    "linear-rope-partial-rotary": (
        case("LlamaForCausalLM", rope_parameters=dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.5)),
        r"partial_rotary_factor=0\.5 with rope type 'linear' is not supported",
    ),
    # refused: a window as long as the model's context hides nothing
    "mixtral-window-covers-the-context": (case("MixtralForCausalLM", sliding_window=32), None),
    "qwen2-window-on-but-no-sliding-layer": (
        case("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=4, max_window_layers=2),
        None,
    ),
    # (refused before too, naming use_sliding_window; now the layers it applies to)
    "qwen2-window-on-layer-1": (
        case("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=4, max_window_layers=1),
        r"sliding_window=4 is not supported on layers \[1\]",
    ),
    # loaded; transformers fails at the first step (a sliding layer without a window)
    "qwen2-sliding-layer-types-without-a-window": (
        case("Qwen2ForCausalLM", edit=dict(set={"layer_types": ["full_attention", "sliding_attention"]})),
        r"sliding_window=None is not supported on layers \[1\]",
    ),
    # loaded as 4 kv heads; transformers reads its class's default (Qwen2 32, Mixtral 8) and cannot load them
    "qwen2-kv-heads-left-out": (
        case("Qwen2ForCausalLM", num_key_value_heads=4, edit=dict(drop=["num_key_value_heads"])),
        r"num_key_value_heads=32",
    ),
    "mixtral-kv-heads-left-out": (
        case("MixtralForCausalLM", num_key_value_heads=4, edit=dict(drop=["num_key_value_heads"])),
        r"num_key_value_heads=8",
    ),
    # loaded; transformers fails: a null window beside use_sliding_window (Qwen2-MoE builds the sliding mask for
    # every model), sliding layer_types without a window (its KV cache is sliding there), null kv heads where its
    # config class does not read null as the heads
    "qwen2moe-window-on-without-a-window": (
        case("Qwen2MoeForCausalLM", use_sliding_window=True, sliding_window=None, max_window_layers=0),
        r"sliding_window=None with use_sliding_window=True is not supported",
    ),
    "mixtral-sliding-layer-types-without-a-window": (
        case("MixtralForCausalLM", edit=dict(set={"layer_types": ["sliding_attention", "full_attention"]})),
        r"sliding_window=None is not supported on layers \[0\]",
    ),
    "mixtral-kv-heads-null": (
        case("MixtralForCausalLM", edit=dict(set={"num_key_value_heads": None})),
        r"num_key_value_heads=None is not a positive integer",
    ),
    "llama-sliding-layer-types-without-a-window": (
        case("LlamaForCausalLM", edit=dict(set={"layer_types": ["sliding_attention", "full_attention"]})),
        r"sliding_window=None is not supported on layers \[0\]",
    ),
    "qwen2moe-kv-heads-null": (
        case("Qwen2MoeForCausalLM", edit=dict(set={"num_key_value_heads": None})),
        r"num_key_value_heads=None is not a positive integer",
    ),
    "llama-kv-heads-null-are-the-heads": (
        case("LlamaForCausalLM", num_key_value_heads=4, edit=dict(set={"num_key_value_heads": None})),
        None,
    ),
    # refused (KeyError); transformers takes max_position_embeddings
    "llama3-rope-without-its-original-context": (
        case("LlamaForCausalLM", rope_parameters=dict(LLAMA3), edit=dict(set={"rope_parameters": dict(LLAMA3)})),
        None,
    ),
    # loaded with rope_parameters' theta (1e4); transformers reads rope_scaling, whose theta is the top level's
    "legacy-rope-beside-rope-parameters-with-another-theta": (
        case(
            "LlamaForCausalLM",
            rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0),
            edit=dict(legacy_rope=True, both_ropes=True, set={"rope_theta": 5e5}),
        ),
        r"rope_scaling .* and rope_parameters .* disagree",
    ),
    # read as 2.0; transformers fails on it
    "rope-factor-a-string": (
        case("LlamaForCausalLM", edit=dict(set={"rope_parameters": dict(rope_type="linear", factor="2.0")})),
        r"factor='2\.0' is not a number",
    ),
    # read as True (bool("false")); transformers refuses the config
    "norm-topk-prob-a-string": (
        case("Qwen2MoeForCausalLM", edit=dict(set={"norm_topk_prob": "false"})),
        r"norm_topk_prob='false' is not true or false",
    ),
    # loaded in bfloat16 by default; transformers' dtype="auto" takes the weights' (float32)
    "dtype-left-out": (case("LlamaForCausalLM", edit=dict(dtype_key=None)), None),
}


# Mistral loads since the property: Llama without biases, with a window on every layer whenever one is set
MISTRAL = {
    "mistral-without-a-window": (case("MistralForCausalLM", sliding_window=None), None),
    # transformers' 4096 when left out: no shorter than this context
    "mistral-window-left-out": (case("MistralForCausalLM", edit=dict(drop=["sliding_window"])), None),
    "mistral-head-dim-of-its-own": (case("MistralForCausalLM", head_dim=16, sliding_window=None), None),  # as Nemo's
    "mistral-window-shorter-than-the-context": (
        case("MistralForCausalLM", sliding_window=8),
        r"sliding_window=8 is not supported on layers \[0, 1\]",
    ),
}


def test_the_accepted_architectures_are_the_loaders():
    assert ACCEPTED == set(checkpoint.ARCHITECTURES) | set(qwen2_moe.ARCHITECTURES)


@pytest.mark.parametrize("name", [*FOUND, *MISTRAL])
def test_pinned_checkpoints(name):
    checkpoint_case, refusal = {**FOUND, **MISTRAL}[name]
    outcome, message = check(checkpoint_case)  # the property's own assertions, then the expected outcome
    assert outcome == ("match" if refusal is None else "refused"), message
    if refusal is not None:
        assert re.search(refusal, message), message
