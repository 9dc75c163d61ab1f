"""Other libraries' ops a CUDA graph cannot hold, traced as device-only equivalents (fgraph/trace/_foreign.py)."""

import pytest
import torch

from fgraph.trace import foreign_decompositions, grouped_mm_by_expert

moe = pytest.importorskip("transformers.integrations.moe")


@pytest.mark.parametrize("counts", [[3, 0, 2, 1], [0, 0, 5, 0], [1, 1, 1, 1]])
@pytest.mark.parametrize("past", [0, 2])
def test_grouped_mm_by_expert_is_transformers_fallback_without_a_host_sync(counts, past):
    """Rows sorted by expert, empty experts, and rows past the last expert's (left zero), as the fallback does."""
    g = torch.Generator().manual_seed(sum(counts) + past)
    s = sum(counts) + past
    x, w = torch.randn(s, 8, generator=g), torch.randn(len(counts), 8, 6, generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    want = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
    torch.testing.assert_close(grouped_mm_by_expert(x, w, offs), want)
    assert not grouped_mm_by_expert(x, w, offs)[s - past :].any()


def test_device_traces_decompose_the_fallback_and_cpu_traces_keep_it():
    fallback = torch.ops.transformers.grouped_mm_fallback.default
    assert foreign_decompositions("cuda:0") == {fallback: grouped_mm_by_expert}
    assert foreign_decompositions("cpu") == {}  # nothing is captured there: eager's kernels run as they are
