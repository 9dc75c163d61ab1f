"""GPU: expert parallelism over NCCL on 2 GPUs, the tiny MoE model's engine on each rank serving its own requests
(tests/ops/test_moe_dist.py's ep_engine_tokens, the CPU/gloo test's rank function: each rank its own requests, of
other counts and lengths, the ranks padded to one token count per step):
  - float32, torch attention: allgather and all2all, eager and every capture mode, give the greedy tokens of
    moe_backend="local" with all the experts on one GPU (float32 keeps the reordered expert sums far below the
    gaps between top logits);
  - bfloat16, FA2 and FlashInfer attention: each captured mode equals EP eager bit for bit (same kernels), with
    allgather's NCCL collectives inside FULL graphs and all2all cut out, the step captured piecewise around it.
Run on a 2-GPU device: `bash scripts/gpu_tests.sh tests/examples/test_ep_gpu.py`."""

import pytest
import torch

from tests.ops.test_moe_dist import ep_engine_tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="multigpu: needs 2 GPUs")]

MODES = ("eager", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE")
EXPECTED = {
    ("allgather", "PIECEWISE"): ["PIECEWISE"],
    ("allgather", "FULL"): ["FULL"],
    ("allgather", "FULL_AND_PIECEWISE"): ["FULL", "PIECEWISE"],  # decode full, mixed piecewise
    ("all2all", "PIECEWISE"): ["PIECEWISE"],
    ("all2all", "FULL"): ["PIECEWISE"],
    ("all2all", "FULL_AND_PIECEWISE"): ["PIECEWISE"],
}


def launch(*args):
    from examples import tp

    return tp.launch(ep_engine_tokens, 2, *args, timeout_s=400)


def test_ep2_equals_local_on_one_gpu_fp32():
    everyone = launch("float32", "torch", MODES)
    assert everyone[0]["local"][0] != everyone[1]["local"][0]  # each rank served its own requests
    for rank, out in enumerate(everyone):
        for (backend, mode), (tokens, used, _) in ((k, v) for k, v in out.items() if k != "local"):
            assert tokens == out["local"][0], f"rank {rank}: {backend} {mode} vs local"
            assert used == EXPECTED.get((backend, mode), []), (rank, backend, mode, used)


@pytest.mark.parametrize("attention", ["flash_attn", "flashinfer"])
def test_ep2_captured_equals_ep2_eager_bf16(attention):
    everyone = launch("bfloat16", attention, MODES)
    for rank, out in enumerate(everyone):
        for backend in ("allgather", "all2all"):
            for mode in MODES[1:]:
                tokens, used, _ = out[backend, mode]
                assert tokens == out[backend, "eager"][0], (
                    f"rank {rank}: {backend} {mode} vs {backend} eager ({attention})"
                )
                if backend == "all2all" or mode == "PIECEWISE":
                    assert used == ["PIECEWISE"], (rank, backend, mode, used)
                else:  # allgather inside full graphs (flashinfer's mixed batches stay piecewise: its prefill plans)
                    assert "FULL" in used, (rank, backend, mode, used)
