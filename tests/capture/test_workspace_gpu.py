"""A captured graph keeps the memory its library calls use: what other code does to torch's cuBLAS workspaces (clear
them, as torch.compile's cudagraph trees do around every recording; destroy graphs captured on the same stream, which
clears that stream's workspace in newer torch) cannot free memory a jitted function's graphs still write, so their
replays neither crash nor write into tensors they do not own."""

import gc

import pytest
import torch

import fgraph
from fgraph import Batched

pytestmark = pytest.mark.gpu

# (1, 4864) @ (4864, 896) in bf16: Qwen2.5-0.5B's down projection at B=1, which cuBLAS runs with split-K on an H200
# (its partial sums go to the handle's workspace, then a reduction kernel reads them back)
K, N = 4864, 896
WORKSPACE = 32 << 20  # torch's cuBLAS workspace on sm90 (:4096:8)


def down(x, w):
    return x @ w


def other(x, w):
    return (x @ w).float()


def workspace_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if "splitK" in e.key or "reduce" in e.key.lower()]


def clear_workspaces():
    torch._C._cuda_clearCublasWorkspaces()


def compile_reduce_overhead():
    g = torch.compile(lambda a, b: a @ b + 1, mode="reduce-overhead")
    a = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        g(a, b)
    torch.cuda.synchronize()


def nothing():
    pass


@pytest.mark.parametrize("then", [clear_workspaces, compile_reduce_overhead, nothing], ids=lambda f: f.__name__)
def test_what_others_do_to_cublas_workspaces_cannot_reach_a_jitted_functions_graphs(then):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=gen) / K**0.5
    xs = [torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    first = fgraph.jit(other, batch={"x": Batched()}, mode="FULL", buckets=[1])
    second = fgraph.jit(down, batch={"x": Batched()}, mode="FULL", buckets=[1])
    first(xs[0], w)  # captured first: the graphs captured after it may share what its capture allocated
    second(xs[0], w)
    assert workspace_kernels(lambda: second(xs[0], w)), "this GEMM no longer runs with split-K here: pick another"
    then()
    first.reset()  # its graphs and its pool go (the cache is the function's, shared by its jit objects: reset)
    del first
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # whatever memory was freed is now someone else's: fill it with a value the GEMM's partial sums never are
    sentinels = [torch.full((WORKSPACE // 4,), 7.0, device="cuda") for _ in range(16)]
    for x in xs:
        got = second(x, w)
        assert torch.equal(got, down(x, w))
    torch.cuda.synchronize()
    assert all(bool((s == 7.0).all()) for s in sentinels), "a replay wrote into memory its graph does not own"
    assert second.stats()["total"]["captures"] == 1
