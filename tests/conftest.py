import pytest
import torch

from fgraph import _shared


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
