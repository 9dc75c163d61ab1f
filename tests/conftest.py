import os

import pytest
import torch

from fgraph import _shared

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist workers (scripts/test.sh: -n 2) share the host's cores: each takes its part of torch's intra-op
    # threads, or two workers of two threads each wait on each other's cores at every op's barrier
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_tests.sh on the device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_jit_state():
    """Each test's jit objects start afresh: state is shared per function and options, process-wide
    (fgraph/_shared.py), and tests jit the same module-level functions again and again."""
    _shared.forget_all()
    yield
