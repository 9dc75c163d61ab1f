"""CPU parity of the example MoE decoder (examples/qwen2_moe.py) against Hugging Face transformers.

Tiny random Qwen2-MoE (shared expert, a dense mlp_only layer, with and without norm_topk_prob) and Mixtral
models are saved with save_pretrained and loaded by examples.qwen2_moe.load; float32 logits of a batched
prefill and decode steps must match HF's, greedy tokens of the engine must equal `generate`, under every MoE
backend and capture mode. explain shows where the MoE breaks are.
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fgraph  # noqa: E402
from examples import checkpoint, generate, llama, qwen2_moe  # noqa: E402
from fgraph.ops import attention as A  # noqa: E402
from tests.examples.test_models import PAGE, PROMPTS, assert_steps_match_hf, hf_greedy  # noqa: E402
from tests.hf import NO_SPECIAL_TOKENS, save_tiny  # noqa: E402

BASE = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    **NO_SPECIAL_TOKENS,
)
CASES = {
    "qwen2moe-shared-dense1": (
        "qwen2_moe",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            rope_theta=1e6,
        ),
    ),
    "qwen2moe-renorm-top3": (
        "qwen2_moe",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=6,
            num_experts_per_tok=3,
            shared_expert_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    "mixtral": ("mixtral", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
}


def make_hf(kind, extra, path, seed=0):
    if kind == "qwen2_moe":
        model = save_tiny(transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(**BASE, **extra), path, seed)
    else:
        model = save_tiny(transformers.MixtralForCausalLM, transformers.MixtralConfig(**BASE, **extra), path, seed)
    return type(model).from_pretrained(path).eval()  # reloaded: the saved files are what both sides read


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_hf(*CASES[request.param], path)
    cfg, params = qwen2_moe.load(path, dtype="float32")
    return hf, cfg, params, path


def test_config_mapping(models):
    hf, cfg, params, _ = models
    c = hf.config
    moe_layers = [i for i, l in enumerate(params.layers) if l.moe is not None]
    if c.model_type == "qwen2_moe":
        assert moe_layers == [i for i in range(3) if i not in c.mlp_only_layers]
        assert (cfg.num_experts, cfg.shared_intermediate, cfg.renormalize) == (
            c.num_experts,
            c.shared_expert_intermediate_size,
            c.norm_topk_prob,
        )
        assert params.layers[0].moe.shared_gate.shape == (1, 64) and cfg.qkv_bias
    else:
        assert moe_layers == [0, 1, 2] and cfg.renormalize and params.layers[0].moe.shared_w13 is None
        assert not cfg.qkv_bias and params.layers[0].bqkv is None
    w = params.layers[0].moe
    assert w.w13.shape == (cfg.num_experts, 2 * cfg.moe_intermediate, 64) and w.top_k == c.num_experts_per_tok
    assert isinstance(cfg, llama.LlamaConfig)  # same attention config and KV cache as the dense models


@pytest.mark.parametrize("moe_backend", ["local", "all2all"])
def test_prefill_and_decode_logits_match_hf(models, moe_backend):
    hf, cfg, params, _ = models
    step = qwen2_moe.make_step(qwen2_moe.MoEConfig(**{**vars_of(cfg), "moe_backend": moe_backend}))
    assert_steps_match_hf(step, cfg, hf, params, n_steps=4)


def vars_of(cfg):
    import attrs

    return attrs.asdict(cfg, recurse=False)


def greedy_engine(hf, cfg, params, moe_backend, mode, capture):
    cfg = qwen2_moe.MoEConfig(**{**vars_of(cfg), "moe_backend": moe_backend})
    eng = qwen2_moe.build(
        cfg,
        params,
        backend="torch",
        mode=mode,
        max_seqs=3,
        max_seq_len=64,
        page_size=PAGE,
        max_batch_tokens=8,
        capture=capture,
    )
    for p in PROMPTS:
        eng.add(p, max_new_tokens=8)
    report = eng.run(progress=False)
    assert report.tokens == [hf_greedy(hf, p, 8) for p in PROMPTS]
    if mode != "eager":
        modes = {dict(e.sig.statics)["routine"]: e.mode for e in eng.step_fn.entries.values()}
        want = fgraph.Mode.PIECEWISE if moe_backend == "all2all" else fgraph.Mode(mode).for_routine(True)
        assert modes["decode"] is want


@pytest.mark.parametrize("moe_backend, mode", [("local", "eager"), ("all2all", "FULL")])
def test_greedy_engine_matches_hf_generate(models, moe_backend, mode):
    greedy_engine(*models[:3], moe_backend, mode, capture=False)  # traced and captured on first use


@pytest.mark.parametrize(
    "moe_backend, mode",
    [("local", "FULL"), ("all2all", "FULL"), ("allgather", "FULL_AND_PIECEWISE"), ("all2all", "PIECEWISE")],
)
def test_greedy_engine_captured_up_front(tmp_path_factory, moe_backend, mode):
    path = str(tmp_path_factory.mktemp("captured"))
    hf = make_hf(*CASES["qwen2moe-shared-dense1"], path)
    greedy_engine(hf, *qwen2_moe.load(path, dtype="float32"), moe_backend, mode, capture=True)


def test_explain_shows_moe_boundaries(models):
    hf, cfg, params, _ = models
    n_moe = sum(l.moe is not None for l in params.layers)
    for moe_backend in ("local", "all2all"):
        cfg2 = qwen2_moe.MoEConfig(**{**vars_of(cfg), "moe_backend": moe_backend})
        eng = qwen2_moe.build(
            cfg2,
            params,
            backend="torch",
            mode="FULL",
            max_seqs=2,
            max_seq_len=32,
            page_size=PAGE,
            max_batch_tokens=4,
            capture=False,
        )
        text = str(eng.explain("decode"))
        assert text.count("] break moe") == n_moe and text.count("ends at break moe") == n_moe
        assert text.count("] break attention") == 3 and f"pieces: {2 * (3 + n_moe) + 1} " in text
        if moe_backend == "all2all":
            assert "mode: PIECEWISE (FULL requested -> PIECEWISE (all2all exchanges per-rank token counts" in text
            assert "support NEVER (all2all exchanges" in text
        else:
            assert "mode: FULL" in text and "support NEVER" not in text


def test_user_break_list_keeping_all2all_inside_a_graph_fails_at_capture(models):
    hf, cfg, params, _ = models
    cfg = qwen2_moe.MoEConfig(**{**vars_of(cfg), "moe_backend": "all2all"})
    step = qwen2_moe.make_step(cfg, "torch", 64)
    cache = llama.init_cache(cfg, 8, PAGE, torch.float32, "cpu")
    spec = llama.Batch(tokens=fgraph.Batched(pad=0), positions=fgraph.Batched(pad=0), meta=A.metadata_batching())
    f = fgraph.jit(
        step,
        static=["routine"],
        donate=["cache"],
        batch={"batch": spec},
        buckets=[4],
        mode="FULL",
        breaks=["attention"],
    )
    batch = llama.Batch(
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        A.build_metadata([1], [1], [[1]], PAGE, 16),
    )
    with pytest.raises(fgraph.CaptureError, match=r"'moe'.*host(.|\n)*Fix: add 'moe' to breaks="):
        f.capture(params, cache, batch, routine="decode", progress=False)


def test_generate_command_runs_a_moe_checkpoint(models, capsys):
    """`python -m examples.generate --model DIR` picks the MoE loader and step by the checkpoint's architecture."""
    hf, cfg, params, path = models
    prompt = ",".join(map(str, PROMPTS[0]))
    out = generate.main(
        [
            "--model",
            path,
            "--prompt-ids",
            prompt,
            "--greedy",
            "--max-new-tokens",
            "6",
            "--json",
            "--no-progress",
            "--mode",
            "FULL",
            "--moe-backend",
            "all2all",
        ]
    )
    assert out["tokens"] == [hf_greedy(hf, PROMPTS[0], 6)]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == out["tokens"]


def test_generate_command_moe_preset(capsys):
    out = generate.main(
        [
            "--preset",
            "tiny-moe",
            "--num-prompts",
            "2",
            "--prompt-len",
            "5",
            "--max-new-tokens",
            "3",
            "--json",
            "--no-progress",
            "--device",
            "cpu",
            "--moe-backend",
            "all2all",
            "--explain",
        ]
    )
    assert [len(t) for t in out["tokens"]] == [3, 3] and out["model"] == "tiny-moe"
    text = capsys.readouterr().err  # with --json, explain goes to stderr
    assert "break moe" in text and "FULL requested -> PIECEWISE" in text


def test_loader_rejects_dense_and_unknown_architectures(tmp_path):
    path = str(tmp_path)
    make_hf(*CASES["mixtral"], path)
    c = json.load(open(os.path.join(path, "config.json")))
    json.dump(dict(c, architectures=["LlamaForCausalLM"]), open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(checkpoint.CheckpointError, match="'LlamaForCausalLM' is not a supported MoE"):
        qwen2_moe.load(path)
    json.dump(dict(c, architectures=["MixtralForCausalLM"]), open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(checkpoint.CheckpointError, match="'MixtralForCausalLM' is not supported(.|\n)*qwen2_moe"):
        checkpoint.load(path)  # the dense loader points to the MoE one


def test_a_mixtral_config_is_read_with_mixtrals_defaults_and_its_window_refused(tmp_path):
    """Keys a Mixtral config.json leaves out take Mixtral's values (rope theta 1e6, rms_norm_eps 1e-5), not Llama's:
    the logits match transformers' from the same directory. A sliding window (set whenever `sliding_window` is,
    with no `use_sliding_window` key) is refused: it used to load and differ past the window."""
    path = str(tmp_path)
    make_hf(*CASES["mixtral"], path)
    cfg_path = os.path.join(path, "config.json")
    c = json.load(open(cfg_path))
    left_out = {k: v for k, v in c.items() if k not in ("rope_parameters", "rope_theta", "rms_norm_eps")}
    json.dump(left_out, open(cfg_path, "w"))
    hf = transformers.MixtralForCausalLM.from_pretrained(path).eval()
    cfg, params = qwen2_moe.load(path, dtype="float32")
    assert (cfg.rope_theta, cfg.norm_eps) == (1e6, 1e-5)
    assert_steps_match_hf(qwen2_moe.make_step(cfg), cfg, hf, params, n_steps=2)
    json.dump(dict(left_out, sliding_window=8), open(cfg_path, "w"))
    with pytest.raises(checkpoint.CheckpointError, match=r"sliding_window=8 is not supported"):
        qwen2_moe.load(path, dtype="float32")


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 is not a positive integer"),  # was a ZeroDivisionError
        (dict(mlp_only_layers="1"), r"mlp_only_layers='1' is not a list of layer indices"),  # was a TypeError
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 is more than the 8 experts"),  # failed in torch.topk
    ],
)
def test_a_bad_moe_config_is_refused_in_one_line(tmp_path, edit, message):
    path = str(tmp_path)
    make_hf(*CASES["qwen2moe-shared-dense1"], path)
    c = json.load(open(os.path.join(path, "config.json")))
    json.dump(dict(c, **edit), open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(checkpoint.CheckpointError, match=message):
        qwen2_moe.load(path, dtype="float32")
