"""`python -m examples.generate` answers a user's error with one line on stderr and a non-zero exit (2 for a bad
command line), and the traceback only under --debug; every numeric flag is checked before anything is built."""

import os
import subprocess
import sys

import pytest

import fgraph
from examples import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
}


@pytest.mark.parametrize("flags", list(USAGE))
def test_a_bad_flag_is_a_usage_error_in_one_line(flags, capsys):
    with pytest.raises(SystemExit) as e:
        generate.main(flags.split() + QUICK)
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
}


@pytest.mark.parametrize("flags", list(RUNTIME))
def test_a_user_error_found_later_exits_1_in_one_line_and_raises_under_debug(flags, capsys):
    with pytest.raises(SystemExit) as e:
        generate.main(flags.split() + QUICK + ["--num-prompts", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and RUNTIME[flags] in err and "Traceback" not in err
    with pytest.raises(fgraph.FgraphError):
        generate.main(flags.split() + QUICK + ["--num-prompts", "1", "--debug"])


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
