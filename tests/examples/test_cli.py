"""`python -m examples.generate` answers a user's error with one line on stderr and a non-zero exit (2 for a bad
command line), and the traceback only under --debug; every numeric flag is checked before anything is built."""

import os
import shlex
import subprocess
import sys

import pytest
import torch

import fgraph
from examples import generate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK = ["--no-progress", "--mode", "eager", "--max-new-tokens", "2"]

USAGE = {  # flags -> what the one line names
    "--num-prompts 0": "--num-prompts: 0 is out of range",
    "--prompt-len -3": "--prompt-len: -3 is out of range",
    "--max-new-tokens 2.5": "--max-new-tokens: '2.5' is not an integer",
    "--max-seqs 0": "--max-seqs: 0 is out of range",
    "--max-batch-tokens -1": "--max-batch-tokens: -1 is out of range",
    "--tp 0": "--tp: 0 is out of range",
    "--temperature -1": "--temperature: -1 is out of range",
    "--temperature nan": "--temperature: nan is out of range",
    "--top-p 0": "--top-p: 0 is out of range",
    "--top-p 1.5": "--top-p: 1.5 is out of range",
    f"--seed {2**70}": f"--seed: {2**70} is out of range",
    "--seed -1": "--seed: -1 is out of range",
    "--dtype bogus": "--dtype: invalid choice: 'bogus'",
    "--device bogus": "--device: 'bogus' is not a device",
    "--prompt-ids 1,x": "--prompt-ids ['1,x']: not comma-separated integers",
    "--mode bogus": "--mode: invalid choice",
    "--model ''": "--model: an empty path (an unset shell variable?)",  # not the embedded model, silently
    "--mode EAGER --compile": "--compile with --mode EAGER: nothing is captured, so nothing would be compiled",
    "--mode NONE --compile": "--compile with --mode NONE: nothing is captured",
    "--num-prompts 99999999999": "--num-prompts 99999999999 x --prompt-len 16: more than 16777216 random prompt",
    "--prompt-len 99999999999": "--num-prompts 4 x --prompt-len 99999999999: more than 16777216 random prompt",
}


@pytest.mark.parametrize("flags", list(USAGE))
def test_a_bad_flag_is_a_usage_error_in_one_line(flags, capsys):
    with pytest.raises(SystemExit) as e:
        generate.main(QUICK + shlex.split(flags))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and USAGE[flags] in err and "Traceback" not in err


RUNTIME = {  # flags -> what the one line names (errors found once the model is known)
    "--prompt-ids 5000": "request 0: prompt[0]=5000 is out of range [0, 1024)",
    "--prompt-len 5000": "request 0: 5000 prompt + 2 new tokens exceed max_seq_len=4096",
    "--model /nonexistent": "/nonexistent/config.json does not exist",
    "--prompt hello": "--prompt needs a tokenizer.json",
    "--backend bogus": "bogus",
    "--tp 3": "tensor parallelism over 3 ranks: 4 q heads, 2 KV heads and 512 MLP columns must split evenly",
    "--preset tiny-moe --tp 2": "tensor parallelism: MoEConfig is not supported",
    "--moe-backend all2all": "--moe-backend all2all: tiny is a dense model (no experts)",
}


@pytest.mark.parametrize("flags", list(RUNTIME))
def test_a_user_error_found_later_exits_1_in_one_line_and_raises_under_debug(flags, capsys):
    with pytest.raises(SystemExit) as e:
        generate.main(flags.split() + QUICK + ["--num-prompts", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and RUNTIME[flags] in err and "Traceback" not in err
    with pytest.raises(fgraph.FgraphError):
        generate.main(flags.split() + QUICK + ["--num-prompts", "1", "--debug"])


@pytest.mark.parametrize(
    "gpus, flags, says",
    [
        (1, "--tp 2", "--tp 2: 1 CUDA device(s) here, one per rank is needed"),
        (2, "--tp 2 --device cuda:1", "--device cuda:1 with --tp 2: each rank takes its own GPU (pass --device cuda)"),
    ],
)
def test_tensor_parallelism_on_gpus_that_cannot_hold_it_is_a_usage_error(gpus, flags, says, monkeypatch, capsys):
    """Spawned ranks take a GPU each (rank r: cuda:r): found before any rank starts, not as a CUDA error in one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        generate.parse_args(flags.split())
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err


def test_temperature_zero_is_greedy_and_greedy_wins():
    greedy = generate.main(QUICK + ["--greedy", "--json", "--temperature", "0.7"])
    assert generate.main(QUICK + ["--temperature", "0", "--json"])["tokens"] == greedy["tokens"]


def test_a_fresh_process_exits_2_with_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "examples.generate", "--tp", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--tp: 0 is out of range" in r.stderr


@pytest.mark.slow
def test_a_tensor_parallel_run_says_nothing_but_its_answer():
    """--tp 2 in the default (jitted) mode: no padding report (the logits are gathered vocab-major), no leaked
    semaphores at exit (the ranks' tqdm lock), only the tokens and the summary."""
    argv = ["--tp", "2", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--no-progress"]
    r = subprocess.run(
        [sys.executable, "-m", "examples.generate", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "[0] 2 prompt tokens -> [" in r.stdout
    assert not [ln for ln in r.stderr.splitlines() if "padding is visible" in ln or "leaked" in ln], r.stderr


@pytest.mark.slow
def test_a_users_error_under_spawned_tensor_parallelism_is_one_line():
    """Every rank printed the error, then torch's spawn logged a SIGTERM and the parent added
    `error: ProcessExitedException: process 1 terminated with exit code 1`: three lines and a torch exception."""
    argv = ["--tp", "2", "--prompt-ids", "5000", "--max-new-tokens", "2", "--no-progress"]
    r = subprocess.run(
        [sys.executable, "-m", "examples.generate", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "request 0: prompt[0]=5000 is out of range" in r.stderr and "ProcessExitedException" not in r.stderr


def test_ctrl_c_while_torch_imports_exits_130_in_one_line():
    """Ctrl-C in the first seconds (torch still importing, before main() runs) printed a 40-line import
    traceback and died by the signal, not the one line and exit 130 the module docstring promises."""
    import signal
    import time

    p = subprocess.Popen(
        [sys.executable, "-m", "examples.generate", "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)  # (the handler is set within ~0.1 s; importing torch takes seconds after it)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err == "interrupted\n", (p.returncode, err[-500:])
