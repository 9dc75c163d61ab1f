"""GPU: the engine's fault handling and seeded sampling on CUDA with captured graphs, and the loader's
non-finite check on device tensors (the CPU suite covers the logic: tests/examples/test_engine_faults.py,
tests/examples/test_checkpoint_errors.py). Run on the device:
`bash scripts/gpu_tests.sh tests/examples/test_engine_gpu.py`."""

import pytest
import torch

from examples import checkpoint, engine, llama

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 300, 2, 999, 41, 8, 8, 120, 77, 3, 64, 500, 1, 23, 45, 6, 7, 90], [11], [4, 4, 4, 4, 9], [7] * 40]


@pytest.fixture(scope="module")
def tiny():
    cfg = llama.preset("tiny")
    return cfg, llama.init_params(cfg, torch.bfloat16, "cuda", seed=0)


def build(tiny):
    return engine.build(
        *tiny, backend="auto", mode="FULL_AND_PIECEWISE", max_seqs=4, max_seq_len=96, max_batch_tokens=32
    )


def submit(eng):
    for i, p in enumerate(PROMPTS):
        eng.add(p, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=10 + i)


def test_a_ctrl_c_while_waiting_for_sampled_tokens_resumes_to_the_same_tokens_on_cuda(tiny):
    eng = build(tiny)
    submit(eng)
    want = eng.run(progress=False).tokens
    submit(eng)
    assert eng.run(progress=False).tokens == want  # seeded sampling on the device: the same tokens again
    submit(eng)
    choose, calls = eng.choose, [0]

    def interrupted(logits, ready):
        calls[0] += 1
        out = choose(logits, ready)
        if calls[0] == 5:
            raise KeyboardInterrupt
        return out

    eng.choose = interrupted
    with pytest.raises(KeyboardInterrupt):
        eng.run(progress=False)
    owned = [p for r in eng.running for p in r.pages]
    assert sorted(owned + list(eng.blocks.free)) == list(range(1, eng.blocks.num_pages))
    eng.choose = choose
    assert eng.run(progress=False).tokens == want


def test_sampling_on_cuda_draws_from_the_nucleus(tiny):
    from examples import sampling

    n = 1000
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], device="cuda")
    got = sampling.sample(
        p.log().expand(n, 4),
        torch.ones(n, device="cuda"),
        torch.full((n,), 0.7, device="cuda"),
        (torch.arange(n, device="cuda") + 0.5) / n,
    )
    counts = torch.bincount(got, minlength=4).tolist()
    assert counts[2:] == [0, 0] and abs(counts[0] - 625) <= 2


def test_a_nan_weight_is_found_on_cuda(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from tests.examples.test_models import make_hf

    make_hf("llama", dict(num_key_value_heads=2), str(tmp_path))
    ts = load_file(str(tmp_path / "model.safetensors"))
    ts["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(ts, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(checkpoint.CheckpointError, match=r"non-finite .* model\.layers\.1\.mlp\.up_proj\.weight"):
        checkpoint.load(str(tmp_path), dtype="bfloat16", device="cuda")
