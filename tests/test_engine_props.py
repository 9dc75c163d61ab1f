"""A property of the engine: for random request streams every request gets the tokens it gets alone.

A stream is waves of requests added between run() calls: prompts of 1 token to past a page and past
max_batch_tokens (chunked prefills), 1 new token to the rest of max_seq_len (and one past it, which add() must
refuse), greedy and seeded sampling side by side, EOS ids taken from what the requests generate (so they stop
early), more requests than seats, few pages, and one run() interrupted by a KeyboardInterrupt at some call of
the model step or of a phase of a step, then resumed; in every mode, overlapped or step by step. The oracle is
the request alone through the plain step (`Alone`); each run()'s report must account for what ran.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.test_engine_faults import build, inject
from tests.test_generate import tiny  # noqa: F401 (the tiny model, a module fixture)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny model's ops take microseconds, and handing them to a second thread on a
    loaded 2-core machine cost 10x (a 30-token reference 0.5 s instead of 0.05 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------ what it found
def test_the_report_after_an_interrupted_run_covers_the_interrupted_runs_steps_and_time(tiny):  # noqa: F811
    """A run() interrupted at its 5th step hands back nothing; the run() that resumes it hands back the request,
    whose 6 tokens took 6 steps. Its report said 2 steps and the second run's time alone (3x the rate)."""
    eng = build(tiny, overlap=False)
    eng.add([1, 2, 3], max_new_tokens=6)
    real, slow = eng.step_fn, lambda *a, **k: time.sleep(0.02) or real(*a, **k)
    eng.step_fn = slow
    restore = inject(eng, "step_fn", KeyboardInterrupt(), "before", 5)
    with pytest.raises(KeyboardInterrupt):
        eng.run(progress=False)
    restore()
    eng.step_fn = real
    rep = eng.run(progress=False)
    assert rep.steps == eng.steps == 6 and rep.output_tokens == 6 and rep.elapsed >= 4 * 0.02
    assert eng.run(progress=False).steps == 0  # (reported once)


def test_an_undone_step_takes_back_the_time_of_the_first_token_it_gave(tiny):  # noqa: F811
    """A step interrupted after sampling (here: while staging the next batch) gives no token; the request kept
    the first-token time of the token taken back, so its TTFT was that of a token it never got."""
    eng = build(tiny, overlap=True)
    r = eng.add([1, 2, 3], max_new_tokens=4)
    restore = inject(eng, "_stage", KeyboardInterrupt(), "after", 2)  # the 1st step's staging of the 2nd
    with pytest.raises(KeyboardInterrupt):
        eng.run(progress=False)
    restore()
    assert r.output == [] and r.t_first is None
    t = time.perf_counter()
    assert eng.run(progress=False).ttft[0] >= t - r.t_arrive
