"""Traced: which donated leaves warm-up and capture put back, and outputs that are no input of the function."""

import pytest
import torch

import fgraph
from fgraph import Batched

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]


def paged_step(x, idx, cache):
    cache["k"].index_put_((idx,), x)  # padded rows (idx pad 0) write only row 0: the scratch area
    cache["len"].add_(1)  # no padded row: a counter beside the pages
    return x * 2, cache


@pytest.mark.parametrize("mode", MODES)
def test_scratch_state_written_by_no_padded_row_is_put_back(mode):
    """scratch= skips the put-back only for writes from the batched rows: a counter in the same state is put back
    after warm-up and capture, so after every call it holds what eager leaves."""
    f = fgraph.jit(
        paged_step,
        donate=["cache"],
        scratch=["cache"],
        batch={"x": Batched(), "idx": Batched(pad=0)},
        mode=mode,
        buckets=[2, 4, 8],
    )
    cache = {"k": torch.zeros(10, 3), "len": torch.zeros((), dtype=torch.int64)}
    ref = {k: v.clone() for k, v in cache.items()}
    for n in [3, 3, 2, 5, 1]:  # new signatures (captured on all-padding batches) and replays
        x, idx = torch.randn(n, 3), torch.arange(1, n + 1)
        f(x, idx, cache)
        paged_step(x, idx, ref)
        assert cache["len"].item() == ref["len"].item()
        assert torch.equal(cache["k"][1:], ref["k"][1:])  # (row 0: the scratch area)


T = (torch.randn(3), torch.tensor(2.0))  # tensors inside a tuple: not lifted


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
@pytest.mark.parametrize("which", [0, 1])
def test_an_unlifted_tensor_returned_as_it_is_is_a_trace_error(mode, which):
    """Returned without an op reading it, a tensor fgraph does not lift is the TraceError an op reading it gets,
    not torch's KeyError from splitting the program."""
    f = fgraph.jit(lambda x: (x + 1, T[which]), batch={"x": Batched()}, buckets=[4], mode=mode)
    with pytest.raises(fgraph.TraceError, match="is not one of its inputs"):
        f(torch.randn(3, 3))


def test_a_global_a_repeated_function_returns_is_a_trace_error():
    w = torch.randn(3)
    layer = fgraph.repeated(lambda y: (y + 1, w))
    f = fgraph.jit(lambda x: layer(x), batch={"x": Batched()}, buckets=[4])
    with pytest.raises(fgraph.TraceError, match="is not one of its inputs"):
        f(torch.randn(3, 3))
