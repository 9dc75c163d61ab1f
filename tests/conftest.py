import importlib.util
import os

# The specs compare a call padded to its bucket with the plain call, bit for bit. MKL's default GEMM rounds a row by
# the row count on some CPUs (AVX-512 Xeons: nn.Linear of 3 rows against the same rows padded to 4), which
# docs/contract.md allows ("What is bitwise"); its strict reproducible mode does not. Read at MKL's first call.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

import fgraph
from fgraph.function import forget_all

# On CUDA fgraph.jit compiles its pieces by default (fgraph.config.compile_cuda). The suite's specs compare jitted
# calls with eager bit for bit, which holds for eager's own kernels: they ask for those by this switch, and a compile
# per test would cost minutes of the GPU lanes. The default's own specs turn it back on (test_compile_default*.py),
# and the compiled lane runs Inductor's pieces over whole models.
fgraph.config.compile_cuda = False

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist workers (scripts/test.sh: -n 2) share the host's cores: each takes its part of torch's intra-op
    # threads, or two workers of two threads each wait on each other's cores at every op's barrier
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def _interpreting() -> bool:
    """Whether Triton's interpreter runs fgraph's Triton kernels on CPU tensors here (TRITON_INTERPRET=1, Triton
    installed: scripts/test.sh's second pass)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_tests.sh on the device")
    if not _interpreting():
        skips["interpreter"] = pytest.mark.skip(reason="Triton's interpreter (TRITON_INTERPRET=1, Triton installed)")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_jit_state():
    """Each test's jit objects start afresh: state is shared per function and options, process-wide
    (fgraph/function/_shared.py), and tests jit the same module-level functions again and again."""
    forget_all()
    yield


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def each_device(request):
    """The test once on the CPU and once with CUDA as torch's default device (tensors its code makes land there);
    files of specs that create their tensors without a device= opt in with
    `pytestmark = pytest.mark.usefixtures("each_device")`."""
    with torch.device(request.param):
        yield request.param
