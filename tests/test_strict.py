"""strict=True means strict: what would make a jitted call's answer differ from the plain function's is an error at
trace time, not a log line. Without strict the same is logged once and the call runs."""

import logging

import pytest
import torch

import fgraph
from fgraph import Batched

pytestmark = pytest.mark.usefixtures("each_device")  # the CPU, and CUDA on the GPU


def centred(x):
    return x - x.mean(0)  # the mean of the batch axis: padded rows change it


def noised(x):
    return x + torch.rand_like(x)


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_an_op_mixing_padded_rows_into_real_ones_is_an_error_under_strict(mode):
    f = fgraph.jit(centred, batch={"x": Batched()}, buckets=[8], mode=mode, strict=True)
    with pytest.raises(fgraph.TraceError, match=r"strict=True\): padding is visible: aten\.mean.* at .*test_strict"):
        f(torch.randn(5, 3))


def test_declared_mixing_is_allowed_under_strict():
    f = fgraph.jit(centred, batch={"x": Batched(mixes=True)}, buckets=[8], strict=True)
    assert f(torch.randn(8, 3)).shape == (8, 3)  # (a bucket's own size: no padded rows to mix)


def test_a_random_draw_is_an_error_under_strict():
    f = fgraph.jit(noised, strict=True)
    with pytest.raises(
        fgraph.TraceError, match=r"(?s)strict=True\): aten\.rand_like at .*another stream.*Fix: draw the noise outside"
    ):
        f(torch.zeros(4))


def test_without_strict_both_are_logged_once_and_run(caplog):
    mixing = fgraph.jit(centred, batch={"x": Batched()}, buckets=[8])
    random = fgraph.jit(noised)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for _ in range(2):
            mixing(torch.randn(5, 3))
            random(torch.zeros(4))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("padding is visible" in m for m in messages) == 1
    assert sum("draws another stream" in m for m in messages) == 1
