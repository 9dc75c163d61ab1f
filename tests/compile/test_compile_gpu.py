"""GPU: compiled pieces at every bucket a step can be padded to give the uncompiled graphs' greedy tokens, for
Hugging Face checkpoints of shapes no preset has: hidden sizes that are not multiples of 64, 1-4 KV heads, tied and
untied embeddings, odd vocabularies, MoE layers. Each shape is drawn from a seeded generator and named in the test's
id, so a failure names the shape that broke it. `examples.generate --capture-all` captures every mixed bucket up to
256 tokens (16 prompts of 16) and every decode bucket up to 16, so a piece compiled at one bucket and run at another
shows here, at capture.

Run on the device: `bash scripts/gpu_tests.sh tests/compile/test_compile_gpu.py`."""

import random

import pytest
import torch

from examples import generate
from tests.hf import NO_SPECIAL_TOKENS, save_tiny

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def shapes(n: int, seed: int = 47) -> list[dict]:
    """n model shapes drawn at random: dense Qwen2 or Qwen2-MoE, hidden = heads x head_dim (not a multiple of 64
    for most), GQA ratio 1-4, tied or untied, a vocabulary that is no power of two."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kv = rng.choice([1, 2, 4])
        heads = kv * rng.choice([1, 2, 4])
        head_dim = rng.choice([16, 24, 32, 40])
        out.append(
            dict(
                moe=i % 3 == 2,
                hidden_size=heads * head_dim,
                num_attention_heads=heads,
                num_key_value_heads=kv,
                vocab_size=rng.randrange(300, 1200) | 1,
                tie_word_embeddings=rng.random() < 0.5,
                intermediate_size=rng.choice([96, 200, 344]),
            )
        )
    return out


SHAPES = shapes(6)


def save(shape: dict, path: str) -> str:
    shape = dict(shape)
    moe = shape.pop("moe")
    base = dict(num_hidden_layers=2, max_position_embeddings=512, **shape, **NO_SPECIAL_TOKENS)
    if moe:
        cfg = transformers.Qwen2MoeConfig(
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=48, **base
        )
        save_tiny(transformers.Qwen2MoeForCausalLM, cfg, path)
    else:
        save_tiny(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**base), path)
    return path


def tokens(path: str, *flags: str) -> list:
    argv = ["--model", path, "--dtype", "float32", "--backend", "torch", "--no-progress", "--greedy", "--json"]
    argv += ["--num-prompts", "16", "--prompt-len", "16", "--max-new-tokens", "4", "--capture-all", *flags]
    return generate.main(argv)["tokens"]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_compiled_pieces_at_every_bucket_give_the_uncompiled_tokens(shape, tmp_path):
    path = save(shape, str(tmp_path / "model"))
    want = tokens(path, "--no-compile", "--mode", "FULL")
    for mode in ("FULL", "PIECEWISE"):
        assert tokens(path, "--compile", "--mode", mode) == want, f"{mode}, shape {shape}"
    torch.cuda.synchronize()
