"""explain: deterministic text per signature, compared with expected text."""

import re

import torch

import fgraph
from tests import toys
from tests.toys import jitted, make


def test_explain_one_signature_before_capture():
    f = jitted(mode="FULL_AND_PIECEWISE", buckets=[8])
    params, state, batch = make(n=7)
    assert (
        str(fgraph.explain(f, params, state, batch, routine="mixed", breaks=1))
        == """\
step(breaks=1, routine='mixed', bucket=8)
  tokens: 7 -> bucket 8 (1 padded)
  mode: PIECEWISE (FULL_AND_PIECEWISE requested -> PIECEWISE for the mixed routine)
  compile: uncompiled graphs (the default on cpu; compile=True: Inductor)
  inputs: 3
    params['w']: float32[8, 8]@cpu
    state['count']: int64[]@cpu
    batch['x']: float32[8, 8]@cpu (Batched)
  outputs: 2
    out[0]: float32[8, 8]
    out[1]: int64[]
  read: padded into input buffers: batch['x']; read in place: params['w'], state['count']
  pieces: 3 (2 graph, 1 break)
  [0] graph 2 ops: mm, empty_like; ends at break toy_scale
      in: batch['x'], params['w']
      out: %mm, %empty_like
  [1] break toy_scale  support ALWAYS (declared ALWAYS)
  [2] graph 4 ops: mm, tanh, add, add_; ends at output
      in: %empty_like, params['w'], batch['x'], state['count']
      out: %add, %add_
  captured: no graphs (runs the program eagerly)"""
    )
    assert not f.entries  # explaining traces, but never captures


def test_explain_shows_downgrades_and_capture_cost():
    def fn(x, routine):
        o = torch.empty_like(x)
        toys.toy_decode_only(o, x)
        return o * 2

    f = fgraph.jit(fn, static=["routine"], batch={"x": fgraph.Batched()}, mode="FULL", buckets=[4])
    f.capture(torch.ones(3, 2), routine=["decode", "mixed"], progress=False)
    text = re.sub(r"in \d+\.\d+ s", "in T s", str(fgraph.explain(f)))
    assert (
        text
        == """\
fn(routine='decode', bucket=4)
  mode: FULL (FULL requested)
  compile: uncompiled graphs (the default on cpu; compile=True: Inductor)
  inputs: 1
    x: float32[4, 2]@cpu (Batched)
  outputs: 1
    out: float32[4, 2]
  read: padded into input buffers: x
  pieces: 3 (2 graph, 1 break)
  [0] graph 1 ops: empty_like; ends at break toy_decode_only
      in: x
      out: %empty_like
  [1] break toy_decode_only  support UNIFORM_DECODE (toy_decode_only has no mixed graph routine)
  [2] graph 1 ops: mul; ends at output
      in: %empty_like
      out: %mul
  captured: 1 graph in T s after 1 eager warm-up run(s), pool 0.000 GiB
fn(routine='mixed', bucket=4)
  mode: PIECEWISE (FULL requested -> PIECEWISE (toy_decode_only has no mixed graph routine; toy_decode_only \
supports UNIFORM_DECODE))
  compile: uncompiled graphs (the default on cpu; compile=True: Inductor)
  inputs: 1
    x: float32[4, 2]@cpu (Batched)
  outputs: 1
    out: float32[4, 2]
  read: padded into input buffers: x
  pieces: 3 (2 graph, 1 break)
  [0] graph 1 ops: empty_like; ends at break toy_decode_only
      in: x
      out: %empty_like
  [1] break toy_decode_only  support UNIFORM_DECODE (toy_decode_only has no mixed graph routine)
  [2] graph 1 ops: mul; ends at output
      in: %empty_like
      out: %mul
  captured: 2 graphs in T s after 1 eager warm-up run(s), pool 0.000 GiB"""
    )


def test_explain_of_a_call_no_graph_serves_says_it_runs_eagerly():
    j = fgraph.jit(lambda x: x * 2, batch={"x": fgraph.Batched()}, buckets=[2, 4])
    assert "runs eagerly: 5 tokens exceed the largest bucket 4" in str(fgraph.explain(j, torch.ones(5)))
    assert "runs eagerly: an empty batch" in str(fgraph.explain(j, torch.ones(0)))
    assert not j.entries


def test_explain_cache_misses_covers_a_functions_first_miss(caplog):
    """As jax logs a never-seen function: the first signature is explained too, then each later one by its closest."""
    f = jitted(mode="NONE", buckets=[8])
    params, state, batch = make()
    fgraph.config.explain_cache_misses = True
    try:
        with caplog.at_level("WARNING", logger="fgraph"):
            f(params, state, batch, routine="decode")
            f(params, state, batch, routine="mixed")
    finally:
        fgraph.config.explain_cache_misses = False
    logged = [r.getMessage() for r in caplog.records if "new signature" in r.getMessage()]
    assert logged == [
        "fgraph.jit(step): new signature (breaks=2, routine='decode', bucket=8); the first of this function (none made "
        "before)",
        "fgraph.jit(step): new signature (breaks=2, routine='mixed', bucket=8); closest captured signature (breaks=2, "
        "routine='decode', bucket=8) differs in static arguments {'breaks': 2, 'routine': 'decode'} vs {'breaks': 2, "
        "'routine': 'mixed'}",
    ]


def test_a_function_without_a_routine_is_told_it_runs_as_a_mixed_step_and_how_to_capture_it_whole():
    def fn(x):
        o = torch.empty_like(x)
        toys.toy_scale(o, x, 0.5)
        return o * 2

    f = fgraph.jit(fn, batch={"x": fgraph.Batched()}, buckets=[4])  # the default mode, FULL_AND_PIECEWISE
    text = str(fgraph.explain(f, torch.ones(3, 2)))
    assert "mode: PIECEWISE (FULL_AND_PIECEWISE requested -> PIECEWISE: a call without a routine static is a " in text
    assert "(mode='FULL' captures it whole)" in text
    whole = fgraph.jit(fn, batch={"x": fgraph.Batched()}, buckets=[4], mode="FULL")
    assert "mode: FULL (FULL requested)" in str(fgraph.explain(whole, torch.ones(3, 2)))
