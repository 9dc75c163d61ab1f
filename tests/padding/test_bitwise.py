"""What is bit for bit (docs/contract.md, "What is bitwise"): uncompiled graphs replay eager's kernels on the padded
rows, so a jitted call equals the plain function called on its inputs padded to the bucket and cut back, bit for bit;
when N is a bucket, that is the plain function's own answer."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched
from tests.test_semantics import MODES, device, rand  # noqa: F401 (device: a fixture)

BUCKETS = [4, 8, 16]


def mlp(w, x, pos):
    """[64, 64], [n, 64], [n] -> [n, 64]: GEMMs whose rounding may depend on their row count, and an index."""
    h = torch.tanh(x @ w + pos[:, None].to(x.dtype))
    return h @ w.T * 0.5


def padded(x: torch.Tensor, b: int, pad) -> torch.Tensor:
    return torch.cat([x, x.new_full((b - x.shape[0], *x.shape[1:]), pad)])


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ns=st.lists(st.integers(1, 16), min_size=1, max_size=5))
def test_uncompiled_graphs_equal_eager_on_the_padded_rows_bit_for_bit(mode, device, ns):
    w = rand(device, 64, 64, seed=0)
    f = fgraph.jit(mlp, batch={"x": Batched(), "pos": Batched(pad=-1)}, buckets=BUCKETS, mode=mode, compile=False)
    for k, n in enumerate(ns):
        x, pos = rand(device, n, 64, seed=k), torch.arange(n, device=device)
        b = next(b for b in BUCKETS if b >= n)
        got = f(w, x, pos)
        assert torch.equal(got, mlp(w, padded(x, b, 0.0), padded(pos, b, -1))[:n]), f"N={n} in bucket {b}"
        if n == b:
            assert torch.equal(got, mlp(w, x, pos)), f"N={n}, a bucket"
        else:  # rounding apart at most
            torch.testing.assert_close(got, mlp(w, x, pos))
