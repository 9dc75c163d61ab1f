"""The tuners' choices on disk (fgraph/kernels/_tuned.py): a second process reads what the first timed and times
nothing; another GPU, or fgraph.config.tune_cache off, times again. The GPU is stubbed (its name, its capture state):
the choice logic runs on the CPU; what the kernels compute is the GPU specs' (tests/kernels/test_linear.py)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent.parent

SCRIPT = """
import contextlib, json, sys
from unittest import mock
import torch
import fgraph
from fgraph.kernels import _gemv

gpu, cache_on = sys.argv[1], sys.argv[2] == "on"
fgraph.config.tune_cache = cache_on
props = mock.Mock(major=9, minor=0)
props.name = gpu
KEYS = [  # (key, what its tuner would pick): a split-K config, and cuBLAS
    ((2, 520, 512, torch.bfloat16, False, False, 0, 0), (16, 128, 4, 3, True, 2)),
    ((1, (64, 32), 64, torch.bfloat16, True, "group", 0), None),
]
timed, readied = [], []
with (
    mock.patch.object(torch.cuda, "get_device_properties", lambda i: props),
    mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False),
    mock.patch.object(torch.cuda, "device", lambda d: contextlib.nullcontext()),
):
    got = [
        _gemv._chosen(key, torch.device("cuda", 0), lambda cfg=cfg: timed.append(1) or cfg, readied.append)
        for key, cfg in KEYS
    ]
print(json.dumps({"timed": len(timed), "readied": readied, "loaded": _gemv.counts["loaded"],
                  "got": [list(c) if c else None for c in got]}))
"""


def run(tmp_path, gpu="H200", cache="on") -> dict:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, gpu, cache], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_choices_and_times_nothing(tmp_path):
    first, second = run(tmp_path), run(tmp_path)
    assert first["timed"] == 2 and first["loaded"] == 0
    assert second["timed"] == 0 and second["loaded"] == 2
    assert second["got"] == first["got"] == [[16, 128, 4, 3, True, 2], None]
    # a loaded config is made ready outside any capture (its split-K counters), as its first launch would have
    assert second["readied"] == [[16, 128, 4, 3, True, 2]] and first["readied"] == []


def test_another_gpu_or_the_switch_off_times_again(tmp_path):
    run(tmp_path)
    assert run(tmp_path, gpu="H100")["timed"] == 2
    assert run(tmp_path, cache="off")["timed"] == 2


def test_the_choices_follow_inductors_cache_dir_when_a_process_moves_it(tmp_path, monkeypatch):
    import fgraph
    from fgraph.kernels import _tuned

    monkeypatch.setattr(fgraph.config, "tune_cache", True)
    monkeypatch.setattr(_tuned, "_identity", lambda index: "gpu")
    key = (2, 520, 512, "bf16", False, False, 0, 0)
    for name in ("a", "b"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / name))
        assert _tuned.load(key, 0) == (False, None)  # (b: nothing stored where a's choice went)
        _tuned.store(key, 0, (16, 128, 4, 3, True, 2))
        assert _tuned.load(key, 0) == (True, (16, 128, 4, 3, True, 2))
    assert [p.name for p in (tmp_path / "b" / "fgraph").iterdir()] == ["tuned-gpu.json"]
