"""GPU: tensor parallelism over NCCL on 2 GPUs, the all-reduces and the logits all-gather captured inside the CUDA
graphs. With the random-weight Qwen2.5-0.5B preset (14 q heads, 2 KV heads: one KV head per rank):
  - float32, torch attention: greedy tokens of TP=2 in every capture mode (and eager) == TP=1 eager. TP changes
    the summation order of the o_proj / down_proj reductions, so only float32 (TF32 off, torch's default) keeps
    the two within ~1e-6 of each other, far below the gaps between the top logits that greedy decoding reads;
  - bfloat16, the best attention backend: TP=2 in every capture mode == TP=2 eager bit for bit (same kernels on
    the same buckets; a 2-rank all-reduce adds two numbers, so it is exact whatever NCCL's algorithm).
And the TP=1 vs TP=2 decode-step latency table of benchmarks/tp_bench.py (llama3-8b, batch 1 and 64).
Run on a 2-GPU device: `bash scripts/gpu_tests.sh tests/examples/test_tp_gpu.py` (ranks are spawned by
examples.tp.launch, killed past the deadline)."""

import gc
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="multigpu: needs 2 GPUs")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("eager", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
NEW_TOKENS = 8
ENGINE = dict(max_seqs=32, max_seq_len=384, max_batch_tokens=128, buckets=(1, 8, 32, 128))
DEADLINE_S = 540  # under the device's 10-minute command limit


def prompts(n: int = 21) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [
        torch.randint(0, 151936, ((1, 300, 17, 64, 5, 129, 33)[i % 7] + i // 7,), generator=g).tolist()
        for i in range(n)
    ]


def generate_all(build, *a, **kw) -> list[list[int]]:
    eng = build(*a, **ENGINE, **kw)  # captures both routines up front (modes other than eager)
    for p in prompts():
        eng.add(p, max_new_tokens=NEW_TOKENS)
    tokens = eng.run(progress=False).tokens
    if kw["mode"] != "eager":
        assert not any(eng.step_fn.stats()["fallbacks"].values()), eng.step_fn.stats()["fallbacks"]
    del eng
    gc.collect()  # its graphs go now, before the process group at the end of the rank
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return tokens


def _tokens_per_mode(t, dtype_name: str, backend: str, with_tp1: bool):
    """On every rank: TP=2 tokens per mode (and TP=1 eager tokens, each rank on its own GPU, when asked)."""
    from examples import engine, llama, tp

    cfg, dtype, dev = llama.preset("qwen2.5-0.5b"), getattr(torch, dtype_name), f"cuda:{torch.cuda.current_device()}"
    full = llama.init_params(cfg, dtype, dev, seed=0)
    out = {}
    if with_tp1:
        out["tp1"] = generate_all(engine.build, cfg, full, backend=backend, mode="eager")
    mine = tp.shard_params(full, cfg, t)
    del full
    torch.cuda.empty_cache()
    out["impl"] = t.all_reduce_impl
    for mode in MODES:
        out[mode] = generate_all(tp.build, cfg, mine, t, backend=backend, mode=mode)
    return out


def first_difference(want, got) -> str | None:
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"request {i} (prompt of {len(prompts()[i])}) differs at token {k}: {a} vs {b}"
    return None


def test_tp2_greedy_tokens_equal_tp1_in_every_mode_fp32():
    from examples import tp

    got = tp.launch(_tokens_per_mode, 2, "float32", "torch", True, timeout_s=DEADLINE_S)
    assert got["impl"] == "symm"  # the default on GPUs: the symmetric-memory all-reduce is what is compared
    assert len({tuple(t) for t in got["tp1"]}) > 1  # outputs vary with the prompt: the comparison means something
    for mode in MODES:
        diff = first_difference(got["tp1"], got[mode])
        assert diff is None, f"TP=2 {mode} vs TP=1 eager (float32): {diff}"


def test_tp2_captured_equals_tp2_eager_bf16():
    from examples import tp
    from fgraph.ops import attention as A

    got = tp.launch(_tokens_per_mode, 2, "bfloat16", A.resolve_backend("auto", "cuda"), False, timeout_s=DEADLINE_S)
    assert got["impl"] == "symm"
    for mode in MODES[1:]:
        diff = first_difference(got["eager"], got[mode])
        assert diff is None, f"TP=2 {mode} vs TP=2 eager (bfloat16): {diff}"


def _all_reduce_cases(t):
    """Rank side: the symm all-reduce against NCCL's, for messages on both sides of the one-shot limit, called
    eagerly and replayed from a CUDA graph on a new value at the captured address."""
    import attrs

    from examples import allreduce

    nccl = attrs.evolve(t, all_reduce_impl="nccl")
    out = []
    sizes = [(1, torch.bfloat16), (7, torch.float32), (896, torch.bfloat16), (64 * 4096, torch.bfloat16)]
    sizes.append((allreduce.ONE_SHOT_MAX_BYTES // 2 + 8, torch.bfloat16))  # past the workspace: NCCL
    for n, dtype in sizes:
        g = torch.Generator(device="cuda").manual_seed(n + t.rank)
        x = torch.randn(n, device="cuda", generator=g).to(dtype)
        eager = t.all_reduce(x)
        want = nccl.all_reduce(x).clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = t.all_reduce(x)
        x.mul_(3)
        graph.replay()
        want_new = nccl.all_reduce(x).clone()
        one_shot = allreduce.one_shot(x.numel() * x.element_size(), t.group)
        out.append((n, one_shot, torch.equal(eager, want), torch.equal(replayed, want_new)))
    torch.cuda.synchronize()
    return out


def test_symm_all_reduce_equals_nccl_eager_and_in_a_graph():
    from examples import tp

    got = tp.launch(_all_reduce_cases, 2, timeout_s=DEADLINE_S, all_reduce="symm")
    # one-shot for messages of whole 16-byte vectors that fit the workspace; the rest go through NCCL
    assert [one for _, one, _, _ in got] == [False, False, True, True, False]
    for n, _, eager_ok, graph_ok in got:
        assert eager_ok, f"symm all-reduce of {n} elements != NCCL's"
        assert graph_ok, f"symm all-reduce of {n} elements replayed in a CUDA graph != NCCL's on the new input"


def test_tp_bench_prints_latency_table():
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.tp_bench", "--model", "llama3-8b", "--batches", "1", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=dict(os.environ, OUT=os.environ.get("OUT", "/tmp")),
    )
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index("decode step, ms") :]
    for b in (1, 64):
        assert f"llama3-8b | {b} |" in table
    assert "FULL" in table and "x" in table
