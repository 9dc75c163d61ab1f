"""torch 2.11's fake slices, sized as torch 2.12 sizes them while fgraph traces (fgraph/trace/_slice_compat.py).

On torch >= 2.12 the shim is off and torch's own rule serves; these specs force it on, so that the code 2.11 runs is
tested on every torch: a slice bounded by the batch size traces, equals eager at sizes that are not buckets, and the
rule is torch's own again once the trace is done."""

import pytest
import torch
from torch._subclasses import fake_impls

import fgraph
from fgraph import Batched
from fgraph.trace import _slice_compat
from tests.test_semantics import MODES

TABLE = torch.arange(64.0).reshape(16, 4)


def head_of_a_table(x):
    return x + TABLE[: x.shape[0]]  # [n, 4]: the table's first n rows


def tail_of_a_table(x):
    return x.sum() + TABLE[x.shape[0] :].sum()  # the rows past n


def first_rows(x):
    return x[:3] * 2  # min(3, n) rows: fewer than 3 at n < 3


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(_slice_compat, "NEEDED", True)
    yield
    assert _slice_compat._users == [0]


@pytest.mark.parametrize("mode", MODES)
def test_a_slice_bounded_by_the_batch_traces_and_equals_eager(forced, mode):
    rule = fake_impls.op_implementations_dict[torch.ops.aten.slice.Tensor]
    f = fgraph.jit(head_of_a_table, batch={"x": Batched()}, buckets=[4, 8], mode=mode)
    for n in (3, 5, 8, 2):
        x = torch.randn(n, 4)
        torch.testing.assert_close(f(x), head_of_a_table(x), rtol=0, atol=0)
    assert fake_impls.op_implementations_dict[torch.ops.aten.slice.Tensor] is rule  # torch's own again


def test_a_slice_from_the_batch_size_on_traces(forced):
    """The rows past n: padded to the bucket, they are the bucket's (logged as mixing padded rows into real ones,
    tests/padding); what torch 2.11 refused was the trace itself."""
    f = fgraph.jit(tail_of_a_table, batch={"x": Batched()}, buckets=[4, 8], mode="FULL")
    x = torch.randn(4, 4)
    torch.testing.assert_close(f(x), tail_of_a_table(x), rtol=0, atol=0)  # at a bucket: no padded row


def test_a_slice_past_the_batch_is_clamped_as_eager_clamps_it(forced):
    f = fgraph.jit(first_rows, mode="FULL")
    for n in (2, 5):  # a trace per size: the output's rows are min(3, n)
        x = torch.randn(n, 4)
        torch.testing.assert_close(f(x), first_rows(x), rtol=0, atol=0)


def test_the_shim_is_off_where_torch_sizes_slices_itself():
    assert _slice_compat.NEEDED == (torch.torch_version.TorchVersion(torch.__version__) < (2, 12))
