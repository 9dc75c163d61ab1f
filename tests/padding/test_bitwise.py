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


class LastToken(torch.nn.Module):
    """[n, t, 64] -> [n, 1, 256]: the last token's logits (an HF model's head at logits_to_keep=1). A Linear of a 3-D
    input that no view makes 2-D: torch folds it into one GEMM where the weight requires grad (a Parameter's default)
    and runs a batched GEMM where it does not, which round apart."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(64, 256)

    def forward(self, h):
        return self.head(h[:, -1:, :])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("requires_grad", [True, False])
def test_a_modules_weights_are_traced_with_their_requires_grad(mode, device, requires_grad):
    # lifted tensors are read as data (detached), and traced with their flag: the kernels eager picks
    m = LastToken().to(device).requires_grad_(requires_grad)
    f = fgraph.jit(m, mode=mode, compile=False)
    with torch.no_grad():
        for k, t in enumerate((7, 9, 7, 9)):
            h = rand(device, 3, t, 64, seed=k)
            assert torch.equal(f(h), m(h)), f"call {k}"
        assert f.stats()["total"]["traces"] == 2
        m.requires_grad_(not requires_grad)  # the flags are part of the signature: the slow path traces anew
        g = fgraph.jit(m, mode=mode, compile=False)  # (f's signatures and graphs; g's first call takes the slow path)
        h = rand(device, 3, 7, 64, seed=9)
        assert torch.equal(g(h), m(h)) and g.stats()["total"]["traces"] == 3


def test_a_call_run_eagerly_is_the_plain_function_on_the_modules_own_parameters(monkeypatch):
    m, kinds = LastToken(), []
    f = fgraph.jit(m)
    monkeypatch.setattr(fgraph.config, "max_signatures", 0)  # every call runs eagerly ("cap")
    m.head.register_forward_pre_hook(lambda head, args: kinds.append(type(head.weight)))
    with torch.no_grad():
        h = rand("cpu", 3, 7, 64, seed=0)
        assert torch.equal(f(h), m(h))
    assert f.stats()["fallbacks"]["cap"] == 1
    assert kinds == [torch.nn.Parameter] * 2  # the jitted call's eager run, then the plain call
