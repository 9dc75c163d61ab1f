"""The tuner's compile workers (fgraph/kernels/_workers.py, fgraph.config.compile_workers): a kernel a worker process
compiled is a disk-cache hit for the parent's own compile of the same launch, so the kernel the parent runs is always
its own; a worker that fails costs only that compile, counted.

No GPU here: Triton compiles for an H100/H200 target (sm_90) on the CPU, and the parent binds its warmup under the same
GPU-less driver the workers use (on the GPU, the CUDA driver: it names the same target)."""

import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch

import fgraph
from fgraph.kernels import _workers

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="the interpreter compiles nothing")

# fgraph::linear_glu's activation kernel (`glu`) for out [4, 4864] = silu(g) * u, bf16: the arguments of its launch
GLU_ARGS = (torch.bfloat16, torch.bfloat16, torch.bfloat16, 4864, 9728, 9728, 4864)
GLU_KWARGS = {"BLOCK": 1024, "PDL": False}


@pytest.fixture
def gpu_less(tmp_path, monkeypatch):
    """An empty Triton cache, the GPU-less sm_90 driver in this process too, and two workers."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from fgraph.kernels import _gemv_kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(fgraph.config, "compile_workers", 2)
    monkeypatch.setattr(driver, "_active", _workers._Target(GPUTarget("cuda", 90, 32)))  # (set_active's, undone)
    _gemv_kernels.glu.device_caches.clear()
    before = dict(_workers.counts)
    yield _gemv_kernels.glu, before
    _gemv_kernels.glu.device_caches.clear()
    _workers.shutdown()


def in_a_worker(glu, **kwargs) -> Future:
    """glu's launch queued for the workers (as a piece compiles) and waited for until one has it: past its imports."""
    _workers.ahead(glu, (4, 5), *GLU_ARGS, **{**GLU_KWARGS, **kwargs})
    job = _workers._jobs[_workers._key(glu, (4, 5), GLU_ARGS, {**GLU_KWARGS, **kwargs})]
    deadline = time.monotonic() + 120
    while not (job.running() or job.done()):
        assert time.monotonic() < deadline, "no worker took the job"
        time.sleep(0.02)
    return job


def test_a_kernel_a_worker_compiled_is_a_cache_hit_for_the_parents_own_compile(gpu_less, monkeypatch, tmp_path):
    glu, before = gpu_less
    in_a_worker(glu)
    _workers.precompile(glu, (4, 5), GLU_ARGS, GLU_KWARGS)  # (the tuner's: waits for it)
    assert _workers.counts["remote"] == before["remote"] + 1 and any(tmp_path.iterdir())

    from triton.backends.nvidia.compiler import CUDABackend

    def compiles(*args, **kwargs):  # (a compile's stages, which a cache hit never builds)
        raise AssertionError("the parent compiled a kernel the worker had compiled")

    monkeypatch.setattr(CUDABackend, "add_stages", compiles)
    got = glu.warmup(*GLU_ARGS, grid=(4, 5), **GLU_KWARGS)
    assert got.metadata.name == "glu" and got.asm.get("cubin")


def test_a_job_queued_before_inductor_sets_tritons_cache_dir_fills_the_dir_the_tuner_reads(
    gpu_less, tmp_path, monkeypatch
):
    # a user's process: no TRITON_CACHE_DIR until Inductor sets one as it loads its first kernel, after a piece's jobs
    # were queued and before its tuner compiles
    glu, before = gpu_less
    monkeypatch.setattr(triton.knobs.cache, "dir", triton.knobs.Env())  # (Triton's: the variable, else its default)
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    in_a_worker(glu).result(timeout=60)
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    if os.getenv("TRITON_CACHE_DIR") is None:  # (Inductor's CachingAutotuner, as it loads a kernel)
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(0)
    _workers.precompile(glu, (4, 5), GLU_ARGS, GLU_KWARGS)
    assert _workers.counts["waited"] == before["waited"] + 1 and _workers.counts["late"] == before["late"]
    assert triton.knobs.cache.dir == triton_cache_dir(0) and any(os.scandir(triton.knobs.cache.dir))


def test_a_failing_worker_costs_only_the_parents_own_compile(gpu_less):
    glu, before = gpu_less
    in_a_worker(glu, BLOCK=1000).result(timeout=60)  # tl.arange needs a power of two
    _workers.precompile(glu, (4, 5), GLU_ARGS, {**GLU_KWARGS, "BLOCK": 1000})
    assert _workers.counts["failed"] == before["failed"] + 1 and _workers.counts["remote"] == before["remote"]
    assert _workers.prestart()  # a kernel's error leaves the workers to the next one


def test_on_by_default_half_the_cpus_up_to_eight_and_none_started_before_a_compile_asks():
    assert fgraph.config.compile_workers == max(1, min(8, os.cpu_count() // 2))
    assert _workers._todo is None  # (a CPU run, whose pieces make no fgraph::linear, starts none)


def test_a_compile_a_worker_has_is_the_one_the_tuners_compile_waits_for(gpu_less, monkeypatch):
    glu, before = gpu_less
    in_a_worker(glu)  # (as a piece compiles: returns at once)
    _workers.ahead(glu, (4, 5), *GLU_ARGS, **GLU_KWARGS)  # (another piece's same launch: queued once)
    _workers.precompile(glu, (4, 5), GLU_ARGS, GLU_KWARGS)  # (the tuner's, at the first call)
    _workers.precompile(glu, (4, 5), GLU_ARGS, {**GLU_KWARGS, "BLOCK": 512})  # (a launch never queued)
    got = {k: _workers.counts[k] - before[k] for k in before}
    assert got == {**dict.fromkeys(before, 0), "ahead": 1, "remote": 1, "waited": 1, "late": 1}


def test_a_dead_worker_leaves_every_compile_to_the_parent_and_no_thread_waiting(gpu_less, monkeypatch):
    glu, before = gpu_less
    monkeypatch.setattr(fgraph.config, "compile_workers", 1)
    in_a_worker(glu).result(timeout=60)
    worker, _ = _workers._all[0]
    worker.kill()
    worker.wait()
    for b in (512, 256):  # (two more launches for the one dead worker)
        _workers.ahead(glu, (4, 5), *GLU_ARGS, **{**GLU_KWARGS, "BLOCK": b})
    compiles = [  # the tuner's, one each: each returns, none waits for the dead worker forever
        threading.Thread(target=_workers.precompile, args=(glu, (4, 5), GLU_ARGS, {**GLU_KWARGS, "BLOCK": b}))
        for b in (1024, 512, 256)
    ]
    for t in compiles:
        t.start()
    for t in compiles:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in compiles)
    assert _workers.counts["broken"] - before["broken"] >= 1 and not _workers.prestart()
    assert _workers.counts["remote"] == before["remote"] + 1


def test_stopping_drops_the_jobs_not_started_and_what_waits_for_them_returns(gpu_less, monkeypatch):
    """A process that exits (or stops the workers) with a piece's jobs queued ahead waits for none of them, nor for
    the one a worker is compiling."""
    glu, before = gpu_less
    monkeypatch.setattr(fgraph.config, "compile_workers", 1)
    blocks = [16384 >> i for i in range(10)]  # (ten launches, ~0.3-1 s each to compile)
    jobs = [in_a_worker(glu, BLOCK=blocks[0])]
    for b in blocks[1:]:
        _workers.ahead(glu, (4, 5), *GLU_ARGS, **{**GLU_KWARGS, "BLOCK": b})
        jobs.append(_workers._jobs[_workers._key(glu, (4, 5), GLU_ARGS, {**GLU_KWARGS, "BLOCK": b})])
    waiting = threading.Thread(target=_workers.precompile, args=(glu, (4, 5), GLU_ARGS, {**GLU_KWARGS, "BLOCK": 16384}))
    waiting.start()  # (the tuner's compile of the launch the worker has: waiting for it)
    t0 = time.perf_counter()
    _workers.shutdown()
    waiting.join(timeout=20)
    assert not waiting.is_alive() and time.perf_counter() - t0 < 5 and all(j.done() for j in jobs)
    assert _workers.counts["remote"] - before["remote"] < len(blocks) and _workers.counts["broken"] == before["broken"]
    assert _workers.prestart()  # (and the next compile that asks starts new ones)


def test_what_a_worker_prints_from_its_start_never_reaches_its_replies(gpu_less, monkeypatch, tmp_path):
    glu, before = gpu_less
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('printed before any fgraph code runs')\n")
    monkeypatch.syspath_prepend(str(site))  # (a worker imports what the parent can)
    in_a_worker(glu).result(timeout=60)
    assert _workers.counts["remote"] == before["remote"] + 1


def test_a_compile_no_worker_has_yet_is_taken_back_and_stopping_waits_for_no_worker(gpu_less, monkeypatch, tmp_path):
    """Workers still importing torch (here: a minute) hold up neither the tuner nor the process's exit."""
    glu, before = gpu_less
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.syspath_prepend(str(site))
    t0 = time.perf_counter()
    _workers.ahead(glu, (4, 5), *GLU_ARGS, **GLU_KWARGS)
    _workers.precompile(glu, (4, 5), GLU_ARGS, GLU_KWARGS)  # (the tuner's: the parent compiles it)
    _workers.precompile(glu, (4, 5), GLU_ARGS, GLU_KWARGS)  # (another of its threads: compiles it too, not waits)
    _workers.shutdown()
    assert time.perf_counter() - t0 < 5
    got = {k: _workers.counts[k] - before[k] for k in before}
    assert got == {**dict.fromkeys(before, 0), "ahead": 1, "taken": 2}


def test_a_worker_that_cannot_start_leaves_the_compiles_to_the_parent(gpu_less, monkeypatch):
    glu, before = gpu_less

    def cannot(*args, **kwargs):
        raise OSError("no interpreter")

    monkeypatch.setattr(_workers.subprocess, "Popen", cannot)
    _workers.precompile(glu, (4, 5), GLU_ARGS, GLU_KWARGS)  # (returns: the parent compiles it)
    _workers.ahead(glu, (4, 5), *GLU_ARGS, **GLU_KWARGS)
    _workers.precompile(glu, (4, 5), GLU_ARGS, GLU_KWARGS)
    assert not _workers.prestart() and _workers.counts == before


def test_a_direct_launchs_first_call_waits_for_its_compile_queued_ahead_and_no_later_one_does(gpu_less):
    """sdpa_decode's kernels are launched as they are, not tuned: the first launch of arguments queued ahead waits
    for the worker's compile (its own is then a disk hit), once; a launch never queued waits for nothing."""
    glu, before = gpu_less
    launches = []

    class Recorded:  # glu, its launches recorded (no GPU here)
        fn = glu.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    in_a_worker(glu)
    for _ in range(2):
        _workers.direct(Recorded(), (4, 5))(*GLU_ARGS, **GLU_KWARGS)
    _workers.direct(Recorded(), (4, 5))(*GLU_ARGS, **{**GLU_KWARGS, "BLOCK": 512})
    got = {k: _workers.counts[k] - before[k] for k in before}
    assert got == {**dict.fromkeys(before, 0), "ahead": 1, "remote": 1, "waited": 1, "direct": 1} and len(launches) == 3
