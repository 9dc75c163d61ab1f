"""fgraph's own custom ops (the fgraph::linear family that compiled pieces call): their fake kernels agree with the
real ones for every row count, symbolic included (`torch.library.opcheck`: schema, fake tensor, dynamic shapes under
AOT dispatch), at rows that are not powers of two. Inductor's code asserts the sizes the fakes give, so a fake that
disagreed would fail a bucket's warm-up."""

import pytest
import torch

import fgraph  # noqa: F401  (registers torch.ops.fgraph)

ops = torch.ops.fgraph
K, N = 24, 40


def cases(m: int) -> list:
    x, r, nw = torch.randn(m, K), torch.randn(m, K), torch.randn(K)
    w, u, b = torch.randn(N, K), torch.randn(N, K), torch.randn(N)
    return [
        (ops.linear.default, (x, w, b)),
        (ops.linear.default, (x, w, None)),
        (ops.linear_glu.default, (x, w, None)),  # one weight: gate and up rows
        (ops.linear_glu.default, (x, w, u)),  # two weights
        (ops.linears.default, (x, [w, u], [b, b])),
        (ops.linears.default, (x, [w, u, w], [None, None, None])),
        (ops.norm_linear.default, (x, r, nw, 1e-6, w, b, False)),
        (ops.norm_linear.default, (x, None, nw, 1e-6, w, None, True)),
    ]


@pytest.mark.parametrize("rows", [1, 3, 248, 250, 512])
def test_every_fgraph_op_has_a_fake_that_agrees_with_it(rows):
    for op, args in cases(rows):
        failed = {k: v for k, v in torch.library.opcheck(op, args).items() if v != "SUCCESS"}
        assert not failed, f"{op} at {rows} rows: {failed}"
