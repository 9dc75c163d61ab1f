"""flashinfer's mixed steps as full CUDA graphs, on the CPU's stand-ins for flashinfer and for the graph.

The stand-in's CUDA-graph prefill wrapper reads its metadata from fgraph's buffers and its schedule from its int
workspace, as flashinfer's does, and refuses a schedule that is not the buffers' (a stale plan)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Mode
from fgraph.ops import _attn_flashinfer as FI
from fgraph.ops import attention as A
from tests.ops.attention_cases import TOY_BATCH, Case, flashinfer_stand_in, refill, toy_inputs, toy_step


def jit_mixed(buckets=(8, 16, 32), mode="FULL"):
    def step(cache, batch, routine, backend):  # a new function each time: jit objects of one function share graphs
        return toy_step(cache, batch, routine, backend)

    return fgraph.jit(
        step,
        static=["routine", "backend"],
        donate=["cache"],
        batch={"batch": TOY_BATCH},
        buckets=list(buckets),
        mode=mode,
    )


def run_steps(f, steps, jcache=None):
    """Each (query lengths, seq lengths, seed) through f and through eager: outputs and written caches equal."""
    for qlens, seqlens, seed in steps:
        cache, batch = toy_inputs(Case(qlens, seqlens, 4, 2, dtype=torch.float32, seed=seed))
        if jcache is None:
            jcache = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
        else:
            refill(jcache, cache)
        want, cache = toy_step(cache, batch, routine="mixed", backend="flashinfer")
        got, jcache = f(jcache, batch, routine="mixed", backend="flashinfer")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(jcache.k + jcache.v, cache.k + cache.v):
            torch.testing.assert_close(a[1:], b[1:], rtol=0, atol=0, equal_nan=True)  # page 0: the padding's
    return jcache


# a mixed step: 1-5 sequences, each a chunk of 1-6 new tokens after 0-10 cached ones (<= 30 tokens, bucket <= 32)
step_lens = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 10)), min_size=1, max_size=5)


@pytest.mark.parametrize("in_graph", [False, True], ids=["uploaded", "copied-by-the-graph"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(step_lens, st.booleans()), min_size=2, max_size=5))
def test_mixed_steps_replay_full_graphs_that_equal_eager(in_graph, steps):
    """FULL with flashinfer: each mixed signature is one full graph, and random mixed batches (prefill chunks and
    decodes; token counts that are not buckets) replayed one after another each equal eager.

    A step may repeat the last one's lengths on other pages (`again`): the same offsets, so the plan is skipped,
    while the page ids the kernels read change. Every plan of a graph wrapper is counted: plan() sets it up, then
    the module's plan is called directly (offsets changed) or skipped (unchanged). With
    fgraph.config.inputs_in_graph the graph copies the staged metadata in itself, at its first layer."""
    with flashinfer_stand_in() as fake, pytest.MonkeyPatch.context() as mp:
        mp.setattr(fgraph.config, "inputs_in_graph", in_graph)
        f, runs, last = jit_mixed(), [], None
        for i, (lens, again) in enumerate(steps):
            if again and last is not None:
                lens = last
            runs.append(([q for q, _ in lens], [q + c for q, c in lens], i))
            last = lens
        run_steps(f, runs)
        assert {e.mode for e in f.entries.values()} == {Mode.FULL}
        buckets = {e.sig.bucket for e in f.entries.values()}
        # the graphs' wrappers (eager's single-token steps get graph wrappers too, of other sizes)
        graphs = [w for key, w in FI._wrappers.items() if key[0] == "mixed" and key[1] in buckets]
        assert len(graphs) == len(buckets)
        assert [w.counts["plan"] for w in graphs] == [1] * len(graphs)  # plan() once a wrapper, by its warm-up
        # one plan before each capture and each call (the first capture's serves its warm-up too)
        assert sum(sum(w.counts.values()) for w in graphs) == len(runs) + f.stats()["total"]["captures"]
        assert fake.module >= sum(w.counts["module"] for w in graphs)
        uploads = FI._plan_bufs["cpu"].uploads
        assert (uploads["graph_full"] + uploads["graph_lengths"] > 0) == in_graph


def test_mixed_plans_are_skipped_only_while_the_query_offsets_and_page_counts_stay():
    """The schedule follows the query offsets and the page counts: the same lengths on other pages skip the plan;
    other query offsets (the same page counts) or other page counts each re-plan through the module."""
    with flashinfer_stand_in():
        f = jit_mixed(buckets=(16,))
        jcache, before = None, {"plan": 0, "fast": 0, "module": 0, "skip": 0}
        for qlens, seqlens, how in [
            ([3, 1, 2], [9, 5, 2], "plan"),  # plan() for the capture's all-padding batch, the module for the call
            ([3, 1, 2], [9, 5, 2], "skip"),  # other pages (another seed), the same offsets
            ([1, 3, 2], [7, 7, 2], "module"),  # the same page counts (2, 2, 1), other query offsets
            ([1, 3, 2], [9, 7, 2], "module"),  # other page counts
        ]:
            jcache = run_steps(f, [(qlens, seqlens, len(how))], jcache)
            (w,) = [w for key, w in FI._wrappers.items() if key[:2] == ("mixed", 16)]  # the graph's
            after = dict(w.counts)
            assert after[how] > before[how] and after["fast"] == 0, (how, after)
            before = after
        assert before == {"plan": 1, "fast": 0, "module": 3, "skip": 1}


def test_a_mixed_plan_that_would_change_the_captured_launch_is_an_error(monkeypatch):
    """flashinfer fixes a CUDA-graph prefill plan's launch (its info) by the bucket; if one did not, the graph
    would replay a stale launch. fgraph compares each plan's info with the first and raises instead."""
    with flashinfer_stand_in():
        f = jit_mixed(buckets=(16,))
        jcache = run_steps(f, [([3, 1, 2], [9, 5, 2], 0)])
        (w,) = [w for key, w in FI._wrappers.items() if key[:2] == ("mixed", 16)]
        module = w.replay.fn
        monkeypatch.setattr(w.replay, "fn", lambda *args: (*module(*args)[:2], 64))  # another tile size
        with pytest.raises(fgraph.FgraphError, match="changed its kernel launch") as e:
            run_steps(f, [([1, 3, 2], [9, 7, 2], 1)], jcache)
        assert "backend='flash_attn'" in str(e.value)


def test_unpadded_mixed_calls_get_a_plain_prefill_wrapper_and_padded_ones_a_graph_wrapper():
    """Outside fgraph.jit a mixed call's metadata holds its real sequences, fewer than its tokens: flashinfer's
    graph mode needs one sequence slot per token, so that call gets the plain wrapper (planned every call);
    metadata padded to the bucket (pad_metadata, as fgraph pads it) gets the bucket's graph wrapper."""
    with flashinfer_stand_in():
        case = Case([3, 1, 2], [9, 5, 2], 4, 2, dtype=torch.float32)
        pad = lambda x: torch.cat([x, x.new_zeros(8 - x.shape[0], *x.shape[1:])])
        for meta, tokens in ((case.meta, lambda x: x), (A.pad_metadata(case.meta, 8), pad)):
            kc, vc = case.k_cache.clone(), case.v_cache.clone()
            q, k, v = (tokens(x) for x in (case.q, case.k, case.v))
            out = A.attention(q, k, v, kc, vc, meta, backend="flashinfer", routine="mixed")
            torch.testing.assert_close(out[:6].double(), case.expected(), rtol=1e-5, atol=1e-5)
        # (routine, bucket, width): the plain wrapper has neither
        assert {(key[0], key[1], key[4]) for key in FI._wrappers} == {("mixed", 8, 8), ("mixed", None, None)}
