"""Other libraries' ops that a CUDA graph cannot hold as they are, traced as device-only equivalents.

make_fx's decomposition table, keyed by op: where a trace meets one of these ops, it records the equivalent's ops
instead. Only device traces use it: on the CPU nothing is captured, and eager's own kernels run as they are."""

from __future__ import annotations

from collections.abc import Callable

import torch


def grouped_mm_by_expert(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[S, in], [E, in, out], [E] cumulative row counts -> [S, out]: rows [offs[e-1], offs[e]) times weight[e], rows
    past offs[-1] zero.

    transformers' `grouped_mm_fallback` (its MoE experts where torch._grouped_mm cannot run: float32, or no sm80)
    reads `offs` on the host to slice the rows: a copy to pageable host memory, which no CUDA graph can capture. Here
    each expert's matmul runs over every row and keeps its own (E times the flops of the slices, no host sync; the
    experts are static, so the loop unrolls in the trace). Each row's result is the same dot products, rounded as
    the GEMM of that row count rounds: assert_close to the fallback, not bit for bit."""
    rows = torch.arange(input.shape[0], device=input.device, dtype=offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True)[:, None]  # [S, 1] in [0, E]; E: past the last expert's rows
    out = input.new_zeros(input.shape[0], weight.shape[2])
    for e in range(weight.shape[0]):
        out = torch.where(expert == e, input @ weight[e], out)
    return out


# (library namespace, op name) -> its device-only equivalent
EQUIVALENTS: dict[tuple[str, str], Callable] = {
    ("transformers", "grouped_mm_fallback"): grouped_mm_by_expert,
}


def foreign_decompositions(device: str) -> dict:
    """The decomposition table of a trace on `device`: the EQUIVALENTS whose library has registered its op."""
    if device == "cpu":
        return {}
    table = {}
    for (namespace, name), fn in EQUIVALENTS.items():
        packet = getattr(getattr(torch.ops, namespace), name, None)  # registered once its library is imported
        if packet is not None:
            table[packet.default] = fn
    return table
