"""A capture that fails midway is an fgraph error, never a dead process: the graph it leaves is kept (torch's
destructor assumes a capture that ended, pytorch/pytorch#180395), and CUDA, the pool and later captures go on
working."""

import pytest
import torch

import fgraph
from fgraph.capture import CudaGraph, abandoned, new_pool

pytestmark = pytest.mark.gpu


@torch.library.custom_op("fgraph_test::through_host", mutates_args=())
def through_host(x: torch.Tensor) -> torch.Tensor:
    # a copy to pageable host memory: fine when run, illegal while a CUDA graph is being captured
    return x.cpu().to(x.device) + 1


@through_host.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_graph_whose_capture_failed_is_kept_and_the_next_capture_replays():
    x = torch.ones(4, device="cuda")
    pool, before = new_pool("cuda"), abandoned()
    g = CudaGraph(pool)
    with pytest.raises(RuntimeError):
        g.capture(lambda t: t.cpu() + 1, x)
    assert abandoned() == before + 1
    del g
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    again = CudaGraph(pool)
    out = again.capture(lambda t: t * 3, x)
    x.fill_(2.0)
    again.replay()
    assert torch.equal(out, torch.full((4,), 6.0, device="cuda"))


def test_a_jitted_function_whose_capture_fails_raises_an_fgraph_error_and_cuda_still_works():
    x = torch.ones(4, device="cuda")
    f = fgraph.jit(lambda t: through_host(t) * 2, compile=False)
    with pytest.raises(fgraph.FgraphError, match="capture"):
        f(x)
    assert f.stats()["total"]["captures"] == 0  # the signature was dropped, nothing half made is kept
    g = fgraph.jit(lambda t: t * 5, compile=False)
    for v in (1.0, 2.0):
        assert torch.equal(g(torch.full((4,), v, device="cuda")), torch.full((4,), 5 * v, device="cuda"))
    torch.cuda.synchronize()
