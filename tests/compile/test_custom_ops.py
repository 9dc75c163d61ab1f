"""fgraph's own custom ops (the fgraph::linear family that compiled pieces call): their fake kernels agree with the
real ones for every row count, symbolic included (`torch.library.opcheck`: schema, fake tensor, dynamic shapes under
AOT dispatch), at rows that are not powers of two. Inductor's code asserts the sizes the fakes give, so a fake that
disagreed would fail a bucket's warm-up."""

import pytest
import torch

import fgraph  # noqa: F401  (registers torch.ops.fgraph)

ops = torch.ops.fgraph
K, N = 24, 40


def cases(m: int, device: str = "cpu", dtype=torch.float32) -> list:
    x, r, nw = (torch.randn(*s, device=device, dtype=dtype) for s in ((m, K), (m, K), (K,)))
    w, u, b = (torch.randn(*s, device=device, dtype=dtype) for s in ((N, K), (N, K), (N,)))
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


# on CUDA in bfloat16 the real kernels are fgraph's Triton ones (the few-row GEMVs) at the rows they serve
DEVICES = [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device, dtype", DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 248, 250, 512])
def test_every_fgraph_op_has_a_fake_that_agrees_with_it(rows, device, dtype):
    for op, args in cases(rows, device, dtype):
        failed = {k: v for k, v in torch.library.opcheck(op, args).items() if v != "SUCCESS"}
        assert not failed, f"{op} at {rows} rows: {failed}"
