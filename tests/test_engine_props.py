"""A property of the engine: for random request streams every request gets the tokens it gets alone.

A stream is waves of requests added between run() calls: prompts of 1 token to past a page and past
max_batch_tokens (chunked prefills), 1 new token to the rest of max_seq_len (and one past it, which add() must
refuse), greedy and seeded sampling side by side, EOS ids taken from what the requests generate (so they stop
early), more requests than seats, few pages, and one run() interrupted by a KeyboardInterrupt at some call of
the model step or of a phase of a step, then resumed; in every mode, overlapped or step by step. The oracle is
the request alone through the plain step (`Alone`); each run()'s report must account for what ran.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from examples import llama, sampling
from examples.request import RequestError
from fgraph.ops import attention as A
from tests.test_engine_faults import build, inject
from tests.test_generate import tiny  # noqa: F401 (the tiny model, a module fixture)

PAGE, MAX_SEQ_LEN = 4, 40
MAX_PAGES = math.ceil(MAX_SEQ_LEN / PAGE)


class Alone:
    """The oracle: one request through the plain (unjitted) step, its whole prompt in one call, then one token a
    call, on a cache of its own with the engine's page size and block-table width (the same attention shapes).
    Greedy takes the argmax; sampling draws what the seed defines at each position (sampling.uniform). Memoised
    per (prompt, temperature, top_p, seed): the longest continuation asked for so far."""

    def __init__(self, cfg, params):
        self.params, self.step = params, llama.make_step(cfg, "torch", MAX_SEQ_LEN)
        self.cache = llama.init_cache(cfg, 1 + MAX_PAGES, PAGE, params.embed.dtype, "cpu")
        self.memo: dict = {}

    def __call__(self, prompt, n: int, temperature=0.0, top_p=1.0, seed=0) -> list[int]:
        key = (tuple(prompt), temperature, top_p, seed if temperature else None)
        if len(self.memo.get(key, ())) < n:
            self.memo[key] = self._generate(prompt, n, temperature, top_p, seed)
        return self.memo[key][:n]

    def _generate(self, prompt, n, temperature, top_p, seed) -> list[int]:
        out, fed, start = [], list(prompt), 0
        while len(out) < n:
            end = start + len(fed)
            meta = A.build_metadata([len(fed)], [end], [list(range(1, 1 + math.ceil(end / PAGE)))], PAGE, MAX_PAGES)
            batch = llama.Batch(torch.tensor(fed), torch.arange(start, end), meta)
            with torch.no_grad():
                logits, self.cache = self.step(self.params, self.cache, batch, "decode" if len(fed) == 1 else "mixed")
            u = sampling.uniform(seed, end) if temperature else 0.0  # (greedy: no seed, no draw)
            knobs = [torch.tensor([x], dtype=torch.float32) for x in (temperature, top_p, u)]
            out.append(int(sampling.sample(logits[-1:], *knobs)[0]))
            fed, start = out[-1:], end
        return out


@pytest.fixture(scope="module")
def alone(tiny):  # noqa: F811
    return Alone(*tiny)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny model's ops take microseconds, and handing them to a second thread on a
    loaded 2-core machine cost 10x (a 30-token reference 0.5 s instead of 0.05 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


EOS_AS = {"list": list, "numpy": np.array, "torch": torch.tensor}  # how eos_ids reach the engine


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


@pytest.mark.parametrize("kind", list(EOS_AS))
def test_eos_ids_as_a_tokenizer_hands_them_over_stop_requests(tiny, alone, kind):  # noqa: F811
    """eos_ids as a torch tensor became a set of tensors, which no sampled int equals: EOS never stopped a
    request. They are read as ints now, and what is not ids is refused when the engine is made."""
    first, eos, _ = alone([11], 3, 1.0, 1.0, seed=5)  # (sampled: greedy repeats the prompt's last token here)
    assert first != eos
    eng = build(tiny, eos_ids=EOS_AS[kind]([eos]))
    assert eng.eos_ids == {eos} and all(type(t) is int for t in eng.eos_ids)
    eng.add([11], max_new_tokens=3, temperature=1.0, seed=5)
    rep = eng.run(progress=False)
    assert rep.tokens == [[first, eos]] and rep.requests[0].finish_reason == "eos"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(eos_ids=2), "eos_ids=2 is not a sequence of token ids"),
        (dict(eos_ids=[2.0]), r"eos_ids\[0\]=2.0 is not an integer"),
        (dict(eos_ids=[-1]), r"eos_ids\[0\]=-1 is out of range"),
        (dict(max_seqs=0, num_pages=9), r"max_seqs=0 is out of range \[1, inf\)"),
        (dict(max_batch_tokens=2.5), r"max_batch_tokens=2.5 is not an integer"),
    ],
)
def test_engine_options_that_would_fail_later_are_refused_when_it_is_made(tiny, kw, match):  # noqa: F811
    """max_seqs=0 admitted no request, and run() returned at once with every request still waiting."""
    with pytest.raises(RequestError, match=match):
        build(tiny, **kw)
