"""The tuner's candidate kernels made before they are timed: compiled, first in worker processes
(fgraph.config.compile_workers; 0: the tuner's threads alone), and loaded.

The tuner compiles tens of kernels at a key's first call, side by side in threads (`_gemv._fastest`). Threads overlap
only what leaves the GIL (LLVM, ptxas); Triton's front end walks each kernel's Python AST under it, and a cold start's
compiling stays GIL-bound (benchmarks/NOTES.md). Here a compile can first run in a worker process: the same `warmup`
call, its tensors given as their dtypes (Triton's MockTensor: an aligned pointer), under a driver that names the
parent's GPU target and touches no GPU, and then (Triton <= 3.6) its C launcher's build. Both land in Triton's disk
cache, and the parent's own warmup and load, run next, find them there: the same source, argument specialisation,
options and target make the same cache key. So the kernel is always the parent's own; a worker that fails costs only
the parent's own compile (`counts`).

Most of that work starts before the tuner asks: as a piece is compiled, `ahead` is given every launch its tuner will
compile (`_gemv_ops.compile_ahead`, from the trace's fake tensors), and the workers compile them while Inductor
compiles the piece. The tuner's compile of a launch waits for its job if a worker has it (`precompile`), and takes it
back if none has yet: a worker takes jobs only once it has imported torch and Triton (seconds, more beside Inductor's
own workers), and where a piece's Inductor compile is shorter than that (the CLI's decode step), the tuner's threads
compile them at once, as without workers, rather than wait.

A worker is `python -c 'serve(fd)'` over pipes (as Inductor's compile workers are), not multiprocessing's spawn,
which would import the user's main script again in every worker. They start with the first job, and are killed, not
waited for, when they stop."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import traceback
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import torch

from .._config import config

log = logging.getLogger("fgraph")

# ahead: compiles queued as a piece was compiled, before its tuner asked (`ahead`); remote: those a worker compiled;
# failed: those a worker could not compile (the parent compiled them itself); broken: those that found their worker
# dead (then none is asked again here). The tuner's compiles (`precompile`), while workers run: waited, those that
# found theirs in a worker and waited for it; taken, those that found theirs still queued (every worker busy, or still
# starting) and took it back; late, those that found none queued (a cold start's piece compiled ahead should leave
# none). direct: the first launches of a kernel launched untuned (sdpa_decode's) that found their job queued ahead
# (each also counted waited or taken). ahead_errors: ops whose kernels could not be queued ahead (a bug, never a wrong
# answer: the first call compiles them)
counts = dict.fromkeys(("remote", "failed", "broken", "ahead", "waited", "late", "taken", "direct", "ahead_errors"), 0)
_lock = threading.Lock()
# (pickled job, its Future) for the workers' threads; None until the first job, or stopped
_todo: queue.Queue | None = None
_all: list[tuple[subprocess.Popen, threading.Thread]] = []  # each worker and the thread that feeds it
_jobs: dict[bytes, Future] = {}  # every job queued, by its pickled self: a launch is queued once here
_launched: set[bytes] = set()  # the direct launches made (`direct`): only a first one waits for its job
_broken = False


def _start() -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # (the parent's imports)
    replies, reply_fd = os.pipe()  # (its own pipe: nothing the worker prints, from its first import on, lands in it)
    cmd = [sys.executable, "-c", f"from fgraph.kernels._workers import serve; serve({reply_fd})"]
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=quiet, stderr=quiet, env=env, pass_fds=(reply_fd,))
    os.close(reply_fd)
    proc.replies = os.fdopen(replies, "rb")
    return proc


def prestart() -> bool:
    """Whether there are workers (config.compile_workers of them), started here on first use: none when off or once
    one broke."""
    global _todo, _broken
    if not config.compile_workers or _broken:
        return False
    with _lock:
        if _todo is None:
            _todo = queue.Queue()
            for _ in range(config.compile_workers):
                try:
                    proc = _start()
                except OSError:  # (no interpreter to start, no pipes left: the tuner's threads alone)
                    log.debug("fgraph: a compile worker could not start", exc_info=True)
                    _broken = True
                    break
                # (a daemon: a process that exits with jobs queued does not wait for them)
                feed = threading.Thread(target=_feed, args=(proc, _todo), name="fgraph-compile-worker", daemon=True)
                feed.start()
                _all.append((proc, feed))
        return not _broken


def _feed(worker: subprocess.Popen, todo: queue.Queue) -> None:
    """A worker's thread: once the worker says it is ready, each job taken from todo sent to it and its reply counted,
    until a None. Until then its jobs wait in todo, where the tuner can take them back (`precompile`)."""
    global _broken
    with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError):  # (dead: its first job finds it so)
        pickle.load(worker.replies)  # ("ready": its imports done)
    while (item := todo.get()) is not None:
        job, done = item
        if not done.set_running_or_notify_cancel():  # (taken back by the tuner, or dropped at shutdown)
            continue
        try:
            worker.stdin.write(job)
            worker.stdin.flush()
            ok, _ = pickle.load(worker.replies)
            outcome = "remote" if ok else "failed"  # (the parent's own compile says why, if it fails too)
        except (OSError, EOFError, pickle.UnpicklingError):  # dead: this job and the next ones fail at once
            outcome = "broken" if todo is _todo else "stopped"  # (killed by shutdown: not counted)
            _broken = _broken or outcome == "broken"  # (no new job is sent: the parent compiles them)
        if outcome != "stopped":
            with _lock:
                counts[outcome] += 1
        done.set_result(outcome)


def shutdown() -> None:
    """Stop the workers (the next compile that asks for them starts new ones, even after one died), at once: the jobs
    not started are dropped and the workers killed, a compile waiting for either compiles it itself. A worker keeps
    nothing worth a clean exit (Triton writes each cache entry whole, by rename), and a process's exit waits for none
    of them: not for one still importing torch, nor for eight interpreters' teardowns."""
    global _todo, _broken
    with _lock:
        stopping, todo, _todo, _broken = list(_all), _todo, None, False
        _all.clear()
        _jobs.clear()
        _launched.clear()
    if todo is None:
        return
    with contextlib.suppress(queue.Empty):
        while True:
            todo.get_nowait()[1].cancel()
    for _ in stopping:
        todo.put(None)
    for proc, _ in stopping:
        proc.kill()  # (its feed thread's read ends: the job it sent ends "stopped", not counted)
    for proc, feed in stopping:
        proc.wait()
        feed.join(timeout=5)
        for pipe in (proc.stdin, proc.replies):
            with contextlib.suppress(OSError):
                pipe.close()


atexit.register(shutdown)


def _key(fn, grid: tuple, args: tuple, kwargs: dict) -> bytes:
    """A launch's job, pickled: what the worker is sent, and its key in `_jobs`. Asks the current device's target:
    inside that device's context."""
    import triton
    from triton.runtime import driver

    job = (
        fn.fn.__module__,
        fn.fn.__name__,
        tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
        grid,
        kwargs,
        driver.active.get_current_target(),
        triton.knobs.cache.dir,
    )
    return pickle.dumps(job)


def _pin_cache_dir() -> None:
    """Set TRITON_CACHE_DIR, where unset, as Inductor sets it for the process when it loads its first kernel (its
    cache dir's triton/<device>): a piece's jobs are queued before Inductor compiles it, and a job names the dir it
    fills, so without this the workers would fill Triton's default dir and the tuner, compiling after Inductor, read
    the other. Inside the device's context."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    from triton.runtime import driver

    if os.getenv("TRITON_CACHE_DIR") is None:  # (torch/_inductor/runtime/triton_heuristics.py, CachingAutotuner)
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(driver.active.get_current_device())


def ahead(fn, grid: tuple, *args, **kwargs) -> None:
    """Queue the Triton kernel fn's compile for these launch arguments (a trace's fake tensors will do: only their
    dtypes travel) for the workers, into Triton's disk cache, and return: the tuner's compile of the same launch then
    waits for it, or takes it back if no worker has started it (`precompile`). Nothing when off."""
    if not prestart():
        return
    _pin_cache_dir()
    key = _key(fn, grid, args, kwargs)
    with _lock:
        if _todo is None or key in _jobs:  # (shut down since prestart; or queued already, by another piece)
            return
        _jobs[key] = Future()
        _todo.put((key, _jobs[key]))
        counts["ahead"] += 1


def precompile(fn, grid: tuple, args: tuple, kwargs: dict) -> None:
    """Before the parent compiles the Triton kernel fn for these launch arguments: wait for a worker's compile of it
    (`ahead`), which the parent's then finds in Triton's disk cache. A compile still queued (every worker busy, or
    still importing torch: seconds where Inductor's compile of the piece was short) is taken back, and one never
    queued left: the parent compiles both at once, beside the workers. Called from the tuner's threads, inside the
    device's context."""
    if not _queueing():
        return
    key = _key(fn, grid, args, kwargs)
    with _lock:
        job = _jobs.get(key)
        if job is None:
            counts["late"] += 1
            return
    _wait(job)


def _queueing() -> bool:
    """Whether jobs may be queued for a compile to wait for: workers started and none dead, and still on."""
    return _todo is not None and not _broken and bool(config.compile_workers)


def _wait(job: Future) -> None:
    """Wait for a queued job a worker has; take it back if none has it yet (the caller compiles it)."""
    if job.cancel():
        with _lock:
            counts["taken"] += 1
        return
    try:
        if job.result() == "stopped":  # (its worker killed at shutdown: the parent compiles it)
            return
    except CancelledError:  # (dropped at shutdown: the parent compiles it)
        return
    with _lock:
        counts["waited"] += 1


def direct(fn, grid: tuple):
    """fn[grid], for a kernel launched as it is, not tuned (sdpa_decode's): the first launch of its arguments first
    waits for the compile queued ahead for it, if any (`ahead`), as the tuner's compiles do, so that the launch's own
    compile, on the calling thread, is a disk hit. Inside the device's context."""
    if not _queueing():
        return fn[grid]

    def launch(*args, **kwargs):
        key = _key(fn, grid, args, kwargs)
        with _lock:
            job = None if key in _launched else _jobs.get(key)
            _launched.add(key)
            counts["direct"] += job is not None
        if job is not None:
            _wait(job)
        return fn[grid](*args, **kwargs)

    return launch


def runner(fn, grid: tuple, warm=False):
    """A Triton kernel's launch over grid, or (warm) its compilation for those arguments alone and its loading (the
    tuner's), or (warm "ahead") that compilation started in a worker process (`ahead`)."""
    if warm == "ahead":
        return functools.partial(ahead, fn, grid)
    return functools.partial(compile_and_load, fn, grid) if warm else fn[grid]


def make(cfgs: list, launch) -> list:
    """launch(cfg, warm=True) for every config, side by side in threads: each kernel compiled (by a worker, if one has
    its job: `ahead`) and loaded. The configs whose kernel does not fit this GPU: Triton raises OutOfResources as
    it loads one that needs more shared memory or threads than the GPU has."""
    from triton.runtime.errors import OutOfResources

    def fits(cfg) -> bool:
        try:
            launch(cfg, warm=True)
        except OutOfResources:
            return False
        return True

    with ThreadPoolExecutor(min(len(cfgs), os.cpu_count() or 1, 16) or 1) as pool:
        return [c for c, ok in zip(cfgs, pool.map(fits, cfgs)) if not ok]


def compile_and_load(fn, grid: tuple, *args, **kwargs) -> None:
    """Compile the Triton kernel fn for these arguments and load it as its first launch would: its module onto the
    current device and its launcher, which Triton up to 3.6 builds from C with the host's compiler (~1 s; one per
    distinct signature). In the tuner's threads these builds overlap the other candidates' compiles; at the first
    launch they ran one after another in the timing loop."""
    precompile(fn, grid, args, kwargs)  # (with compile_workers: the warmup below reads what a worker compiled)
    compiled = fn.warmup(*args, grid=grid, **kwargs)
    load = getattr(compiled, "_init_handles", None)  # (Triton's lazy loader: the first launch calls it)
    if load is not None:
        load()


class _Target:
    """The driver a worker compiles under: the parent's GPU target and no GPU (binding a warmup's arguments and
    compiling asks the driver for nothing more)."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _launcher(compiled) -> None:
    """Build the kernel's C launcher (Triton up to 3.6 builds one per signature with the host's compiler as a kernel
    first loads, ~0.2 s each): it lands in Triton's disk cache, keyed by its source, so the parent's load finds it."""
    from triton.backends.nvidia import driver

    if hasattr(driver, "make_launcher"):  # (later Tritons launch every kernel through one built-in launcher)
        with contextlib.suppress(Exception):  # (none buildable here, as without libcuda: the parent builds its own)
            driver.CudaLauncher(compiled.src, compiled.metadata)


def serve(reply_fd: int) -> None:
    """A worker's loop: each job read from stdin compiled, (ok, error text) written to reply_fd, until stdin ends."""
    import triton
    from triton.runtime import driver

    out = os.fdopen(reply_fd, "wb")
    pickle.dump((True, "ready"), out)  # (imports done: jobs may come)
    out.flush()
    while True:
        try:
            module, name, args, grid, kwargs, target, cache_dir = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        try:
            os.environ["TRITON_CACHE_DIR"] = triton.knobs.cache.dir = cache_dir
            driver.set_active(_Target(target))
            _launcher(getattr(importlib.import_module(module), name).warmup(*args, grid=grid, **kwargs))
            reply = (True, None)
        except Exception:
            reply = (False, traceback.format_exc())
        pickle.dump(reply, out)
        out.flush()
