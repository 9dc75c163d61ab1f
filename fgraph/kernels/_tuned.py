"""The tuners' choices on disk: what fgraph::linear's family timed in one process, read by the next instead of timing
again (the timing loops are most of a warm start's capture: docs/performance.md).

One JSON file per identity, beside Inductor's cache (so an empty Inductor cache is an empty tuner cache too): the
GPU's name and compute capability, the CUDA, torch and Triton versions and the source of the kernels and their
candidate configs. A choice is only valid where all of these are the same; any change is another file. Within a
file, a key (rows, columns, K, dtype, bias, kind, ...) maps to a config or null (cuBLAS). fgraph.config.tune_cache
switches it off (every process times its own keys, as before)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pathlib
import tempfile

import torch

from .._config import config


def _name(key: tuple) -> str:
    """A key as text, without its last item (the device's index: the identity names the GPU)."""
    return repr(tuple(str(k) if isinstance(k, torch.dtype) else k for k in key[:-1]))


def _path(index: int) -> str:
    """The file of device `index`'s identity, under Inductor's cache dir as it is now (TORCHINDUCTOR_CACHE_DIR, read
    at each call as Inductor reads it: a process that moves its caches moves its choices with them)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "fgraph", f"tuned-{_identity(index)}.json")


@functools.cache
def _identity(index: int) -> str:
    """Device `index`'s identity: its GPU, CUDA, torch and Triton, and the kernels' source, hashed."""
    here = pathlib.Path(__file__).parent
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    props = torch.cuda.get_device_properties(index)
    ident = [props.name, f"{props.major}.{props.minor}", torch.version.cuda, torch.__version__, triton_version]
    ident += [(here / name).read_text() for name in ("_gemv.py", "_gemv_kernels.py")]
    return hashlib.sha256("\n".join(map(str, ident)).encode()).hexdigest()[:24]


def _read(path: str) -> dict:
    try:
        with open(path) as fh:
            got = json.load(fh)
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def load(key: tuple, index: int):
    """(True, the stored choice: a config tuple or None) or (False, None) where nothing is stored for key."""
    if not config.tune_cache:
        return False, None
    stored = _read(_path(index))
    name = _name(key)
    if name not in stored:
        return False, None
    cfg = stored[name]
    return True, (tuple(cfg) if cfg is not None else None)


def store(key: tuple, index: int, choice) -> None:
    """Add key's choice to the file (a read, merge and atomic replace: processes tuning side by side keep each
    other's keys, up to a lost write, which only costs a later process a timing)."""
    if not config.tune_cache:
        return
    path = _path(index)
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        stored = _read(path)
        stored[_name(key)] = list(choice) if choice is not None else None
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(stored, fh)
        os.replace(tmp, path)
