"""CPU parity of the example Llama / Qwen2 against Hugging Face transformers, the oracle.

Tiny random HF models are saved with save_pretrained, loaded by examples.checkpoint, and compared in float32:
logits of a batched prefill and of several decode steps (tight tolerance), then greedy tokens of the engine
against `model.generate` (identical). Cases cover GQA and MQA, tied embeddings, q/k/v bias and Llama-3 RoPE
scaling (with a short original context, so that scaling changes the frequencies that matter).
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from examples import checkpoint, engine, llama  # noqa: E402
from fgraph.ops import attention as A  # noqa: E402
from tests.hf import NO_SPECIAL_TOKENS, save_tiny  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "llama-gqa-llama3rope": ("llama", dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen2-gqa-tied-bias": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2-mha-untied-bias": ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=False)),
}
PAGE = 4  # small pages: every sequence spans several, so the block tables are exercised


def make_hf(kind: str, extra: dict, path: str, seed: int = 0):
    """A tiny random HF model, saved to `path`. All weights (biases and norms too) are perturbed."""
    base = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=256,
        **NO_SPECIAL_TOKENS,
    )
    if kind == "llama":
        return save_tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig(**base, **extra), path, seed)
    return save_tiny(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**base, **extra), path, seed)


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    kind, extra = CASES[request.param]
    hf = make_hf(kind, extra, path)
    cfg, params = checkpoint.load(path, dtype="float32")
    return hf, cfg, params, path


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


def test_config_mapping(models):
    hf, cfg, params, _ = models
    c = hf.config
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
        64,
        2,
        4,
        c.num_key_value_heads,
        128,
    )
    assert cfg.tie_embeddings == (params.lm_head is None) == bool(c.tie_word_embeddings)
    assert cfg.qkv_bias == (c.model_type == "qwen2")
    assert params.layers[0].wqkv.shape == (cfg.qkv_dim, 64) and params.layers[0].w13.shape == (256, 64)
    torch.testing.assert_close(params.inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=0, atol=0)


def assert_steps_match_hf(step, cfg, hf, params, n_steps: int):
    """A batched prefill of 3 sequences (routine "mixed"), then decode steps: the logits of every new position
    match HF's, and each sequence continues with HF's greedy token."""
    cache = llama.init_cache(cfg, num_pages=16, page_size=PAGE, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 11, 1)]
    pages = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11]]
    done = [0, 0, 0]
    for it in range(n_steps):
        qlens = [len(s) - d for s, d in zip(seqs, done)]
        meta = A.build_metadata(qlens, [len(s) for s in seqs], pages, PAGE, 8)
        toks = [t for s, d in zip(seqs, done) for t in s[d:]]
        pos = [p for s, d in zip(seqs, done) for p in range(d, len(s))]
        batch = llama.Batch(torch.tensor(toks), torch.tensor(pos), meta)
        logits, cache = step(params, cache, batch, routine="mixed" if it == 0 else "decode")
        assert logits.shape == (len(toks), 128) and logits.dtype == torch.float32
        start = 0
        for i, s in enumerate(seqs):
            want = hf_logits(hf, s)[done[i] :]  # [qlen, V]: every new position, not only the last
            torch.testing.assert_close(logits[start : start + qlens[i]], want, atol=1e-4, rtol=1e-4)
            start += qlens[i]
            done[i] = len(s)
            s.append(int(want[-1].argmax()))


def test_prefill_and_decode_logits_match_hf(models):
    hf, cfg, params, _ = models
    assert_steps_match_hf(llama.make_step(cfg), cfg, hf, params, n_steps=5)


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def test_greedy_engine_matches_hf_generate(models):
    hf, cfg, params, _ = models
    # max_batch_tokens 8 < the longest prompt: its prefill is chunked and mixed with the others' decodes.
    eng = engine.build(
        cfg, params, backend="torch", mode="eager", max_seqs=3, max_seq_len=64, page_size=PAGE, max_batch_tokens=8
    )
    for p in PROMPTS:
        eng.add(p, max_new_tokens=12)
    report = eng.run(progress=False)
    assert report.tokens == [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert report.output_tokens == 36 and all(t >= 0 for t in report.ttft)
    assert not eng.running and len(eng.blocks.free) == eng.cache.k[0].shape[0] - 1  # every page released


def test_loader_errors(tmp_path):
    path = str(tmp_path)
    make_hf("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True), path)
    cfg_path = os.path.join(path, "config.json")
    c = json.load(open(cfg_path))

    def write(**kw):
        json.dump(dict(c, **kw), open(cfg_path, "w"))

    write(num_key_value_heads=4)  # k_proj is [32, 64] in the weights, the config implies [64, 64]
    with pytest.raises(checkpoint.CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape"):
        checkpoint.load(path)
    write(architectures=["GPT2LMHeadModel"])
    with pytest.raises(checkpoint.CheckpointError, match="GPT2LMHeadModel.*not supported"):
        checkpoint.load(path)
    write(tie_word_embeddings=False)  # untied, but the file has no lm_head.weight
    with pytest.raises(checkpoint.CheckpointError, match="'lm_head.weight' is missing"):
        checkpoint.load(path)
    write()
    json.dump(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}},
        open(os.path.join(path, "model.safetensors.index.json"), "w"),
    )
    with pytest.raises(checkpoint.CheckpointError, match="model-00002-of-00002.safetensors.*does not exist"):
        checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match="config.json does not exist"):
        checkpoint.load(str(tmp_path / "nowhere"))


# config.json of the real checkpoints (transformers 4 style: top-level rope_theta, rope_scaling) -> the presets.
REAL_CONFIGS = {
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=24,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=None,
        max_position_embeddings=32768,
        sliding_window=32768,
        use_sliding_window=False,
        max_window_layers=21,
        tie_word_embeddings=True,
        hidden_act="silu",
        torch_dtype="bfloat16",
    ),
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        mlp_bias=False,
        attention_bias=False,
        tie_word_embeddings=False,
        hidden_act="silu",
        torch_dtype="bfloat16",
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_configs_map_to_presets(tmp_path, name):
    json.dump(REAL_CONFIGS[name], open(tmp_path / "config.json", "w"))
    assert checkpoint.read_config(str(tmp_path)) == llama.preset(name)
    assert checkpoint.dtype_of(None, str(tmp_path)) == torch.bfloat16


def test_sharded_checkpoint_with_index(tmp_path):
    """Many shards + model.safetensors.index.json load to the same tensors as one file."""
    make_hf("llama", dict(num_key_value_heads=2), str(tmp_path / "one"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "one"))
    hf.save_pretrained(str(tmp_path / "many"), max_shard_size="40KB")
    assert os.path.exists(tmp_path / "many" / "model.safetensors.index.json")
    (_, a), (_, b) = checkpoint.load(str(tmp_path / "one")), checkpoint.load(str(tmp_path / "many"), dtype="bfloat16")
    assert b.layers[1].w13.dtype == torch.bfloat16
    torch.testing.assert_close(a.layers[1].w13.bfloat16(), b.layers[1].w13, rtol=0, atol=0)
    torch.testing.assert_close(a.lm_head.bfloat16(), b.lm_head, rtol=0, atol=0)


def test_presets_and_random_init():
    cfg = llama.preset("tiny")
    p1, p2 = llama.init_params(cfg, torch.float32, "cpu", seed=0), llama.init_params(cfg, torch.float32, "cpu", seed=0)
    assert torch.equal(p1.layers[1].wqkv, p2.layers[1].wqkv)
    q = llama.preset("qwen2.5-0.5b")
    assert (q.dim, q.n_layers, q.n_heads, q.n_kv_heads, q.qkv_dim) == (896, 24, 14, 2, 1152)
    assert q.qkv_bias and q.tie_embeddings and llama.preset("llama3-8b").rope_scaling.type == "llama3"
    with pytest.raises(Exception, match="unknown preset"):
        llama.preset("gpt-5")


@pytest.mark.parametrize("backend", A.BACKENDS)
@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_tracing_without_zero_one_specialisation_keeps_the_programs(backend, routine, monkeypatch):
    """The symbolic trace is made without torch's 0/1 specialisation (so bucket 1 may share it); for every
    backend's step the ops it records for buckets >= 2 are the ones the specialising trace records."""
    import contextlib

    import fgraph
    from benchmarks.common import decode_batch
    from fgraph.trace import _make, _traced

    cfg = llama.preset("tiny")
    params = llama.init_params(cfg, torch.float32, "cpu")
    ps = A.page_size_for(backend)
    cache = llama.init_cache(cfg, 1 + 8 * 2, ps, torch.float32, "cpu")
    batch, _ = decode_batch(cfg.vocab_size, 8, ps, ps, 2 * ps)  # 8 sequences at position ps / 2
    spec = llama.Batch(fgraph.Batched(pad=0), fgraph.Batched(pad=0), A.metadata_batching())
    traced = []
    monkeypatch.setattr(_traced, "trace", lambda *a: traced.append(_make.trace(*a)) or traced[-1])
    monkeypatch.setitem(A.TAKES, backend, (None, None))  # only traced, in float32: no kernel of the backend runs
    for oblivious in (True, False):
        if not oblivious:
            monkeypatch.setattr(_make, "_size_oblivious", contextlib.nullcontext)
        f = fgraph.jit(
            llama.make_step(cfg, backend=backend, max_seq_len=2 * ps),
            static=["routine"],
            donate=["cache"],
            batch={"batch": spec},
            buckets=[8],
        )
        fgraph.explain(f, params, cache, batch, routine=routine)
    ops = [[str(n.target) for n in gm.graph.nodes if n.op == "call_function"] for gm, _ in traced]
    assert len(ops) == 2 and ops[0] == ops[1] and len(ops[0]) > 20


def test_llama3_rope_takes_a_top_level_original_max_position_embeddings_as_transformers_does(tmp_path):
    path = str(tmp_path)
    l3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    make_hf("llama", dict(num_key_value_heads=2, rope_parameters=dict(l3, original_max_position_embeddings=16)), path)
    c = json.load(open(os.path.join(path, "config.json")))
    json.dump(dict(c, original_max_position_embeddings=64), open(os.path.join(path, "config.json"), "w"))
    hf = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    cfg, params = checkpoint.load(path, dtype="float32")
    assert cfg.rope_scaling.original_max_position_embeddings == 64
    torch.testing.assert_close(params.inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=0, atol=0)
