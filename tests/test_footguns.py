"""Footguns: behaviour that changes when a function is jitted and captured. Each test pins what happens.

SILENT MISMATCHES (wrong results, no error):
  outputs_overwritten_with_copy_outputs_off  MED  copy_outputs=False (the engine's opt-in): valid until the next call
  python_side_effects_run_once           HARD  prints/appends in the function happen at trace time only (appending
                                               a traced value is an EscapeError: tests/test_semantics.py)
  values_stored_into_an_argument         HARD  `state["h"] = h + 1` stores into the trace's own dict: the caller's
                                               keeps its old value (the returned dict has the new one)
  storage_swapped_under_a_tensor         HARD  `t.data = u` / `t.set_(u)` / `t.t_()` / `t.requires_grad_()` on a
                                               captured tensor: the same object, other memory, strides or autograd
                                               needs; not seen (checking every address per call
                                               costs more than a small model's step). Pass `u` instead.
  frozen_record_changed_by_force         HARD  object.__setattr__ on a frozen attrs/dataclass instance: frozen
                                               trees are proven unchanged by identity. attrs.evolve it instead.
  repeated_reads_python_values_once     MED   fgraph.repeated: a Python value read from outside its arguments
                                               (a per-layer scale in a closure) is copied from the first call to
                                               every later one. Pass it as an argument.
  grad_mode_read_under_another_name     MED   a branch on torch.is_grad_enabled() gets a trace per grad mode, but
                                               a name bound to it before tracing (`from torch import
                                               is_grad_enabled`, torch._C's) replays the branch it was traced
                                               under. Call torch.is_grad_enabled() by that name
  module_changes_without_tensors        MED   forward hooks added after the first call, a parameter-free submodule
                                               swapped for one with the same guarded values (Tanh -> Sigmoid), a
                                               global / closure / dict slot rebound to a new module: the trace
                                               keeps the old. Call .reset() after such edits
  shared_state_across_threads           MED   two jitted functions donating the same state, called from two
                                               threads: one's capture puts the state back over the other's update.
                                               Serialize such calls (a lock of your own)
  private_and_computed_attributes       MED   a module's `_private` attribute, a property or `getattr(self, "k")`,
                                               torch's backend and deterministic flags: not guarded, not listed by
                                               explain. Pass the value as an argument (static= if it picks the
                                               program), or .reset() after the edit
  cublas_reduction_flags                 MED   allow_bf16/fp16_reduced_precision_reduction toggled between calls:
                                               graphs keep the GEMM kernels chosen at capture (rounding only; the
                                               settings that change dtypes or TF32 are part of the signature)
  requires_grad_flipped_after_the_trace  MED   model.requires_grad_(False) between calls the replay path serves:
                                               its graphs keep the kernels picked for the old flags (matmul's fold
                                               of a 3-D input; rounding only). The slow path keys on the flags;
                                               proving ~300 flags per call costs as much as the pointers' proof.
                                               Call .reset() after the flip
  matmul_fold_under_inference_mode       MED   under torch.inference_mode() torch's trace (make_fx) records a
                                               3-D input's matmul as a batched GEMM where eager folds it into one
                                               (rounding only). torch.no_grad() traces eager's kernels
  torch_module_fast_paths                MED   nn.MultiheadAttention / TransformerEncoderLayer take torch's fused
                                               fast path in eager inference, never under fgraph's trace (torch
                                               skips it there): rounding only, the same math
ERRORS RAISED (at least the user knows):
  item_during_trace                      EASY  TraceError naming the line (tests/test_errors.py)
  padded_rows_mixed_into_real_ones       MED   logged once at trace time with the line, listed by explain
                                               (x.mean(0), softmax over tokens, ...: tests/padding/test_padding.py)
  random_draws_differ_from_eager         MED   rand, dropout, multinomial, ...: padded rows and warm-up runs draw
                                               too, so a seeded run differs from eager; logged once with the line,
                                               listed by explain. Draw the noise outside and pass it in
FIXED (pinned so they stay fixed; the full specs: tests/test_semantics.py, test_capture_state.py, test_padding.py):
  new tensors, replaced containers, grown lists, changed static fields, threads, interrupted captures, kept outputs,
  wrappers of jitted functions jitted again (functools.wraps, partial, torch.func.grad/vmap, jit of jit, methods),
  traced values stored outside the function (EscapeError at the end of the trace and at first use, not fakes)
  statics_keyed_by_type_and_value              static 2, 2.0 and True are signatures of their own, as in jax.jit
                                               (finer than jax: 0.0 / -0.0, and tuple items: docs/contract.md)
  warmup_and_capture_leave_no_trace            donated state written by warm-up and capture is put back;
                                               jit(scratch=[...]) skips the copy for state whose padded rows
                                               write only a scratch area (the KV cache's page 0)
"""

import logging

import pytest
import torch

import fgraph
from fgraph import Batched
from tests import toys


def scale_fn():
    factor = {"value": 2.0}

    def f(x):
        return x * factor["value"]

    return f, factor


def test_outputs_overwritten_with_copy_outputs_off():
    f = fgraph.jit(lambda x: x * 2, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4], copy_outputs=False)
    a = f(torch.ones(4))
    b = f(torch.full((4,), 3.0))
    assert a.tolist() == [6.0] * 4  # should be [2.0] * 4! the second replay wrote into the same buffer
    assert a.data_ptr() == b.data_ptr()


def test_outputs_are_copies_by_default():
    f = fgraph.jit(lambda x: x * 2, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    a = f(torch.ones(4))
    f(torch.full((4,), 3.0))
    assert a.tolist() == [2.0] * 4


def test_python_constants_are_guarded():
    """(No longer a footgun: a Python value the trace baked in, here a closed-over dict's entry, is guarded.)"""
    fn, factor = scale_fn()
    f = fgraph.jit(fn, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    assert f(torch.ones(4)).tolist() == [2.0] * 4
    factor["value"] = 10.0
    assert f(torch.ones(4)).tolist() == [10.0] * 4  # a new signature: traced again
    with fgraph.disable_jit():
        assert f(torch.ones(4)).tolist() == [10.0] * 4


def test_python_constants_are_guarded_across_jit_objects():
    fn, factor = scale_fn()
    assert fgraph.jit(fn, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])(torch.ones(4)).tolist() == [2.0] * 4
    factor["value"] = 10.0
    f = fgraph.jit(fn, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])  # the same function and options
    assert f(torch.ones(4)).tolist() == [10.0] * 4  # its cache is the first jit object's, keyed by the value


def test_repeated_reads_python_values_once():
    scale = {"now": 1.0}

    @fgraph.repeated
    def block(x, w):
        return torch.tanh(x @ w) * scale["now"]  # read from outside the arguments

    @fgraph.repeated
    def block_arg(x, w, s):
        return torch.tanh(x @ w) * s  # passed in: part of the template's key

    def model(x, ws, as_arg):
        for k, w in enumerate(ws):
            scale["now"] = float(k + 1)
            x = block_arg(x, w, scale["now"]) if as_arg else block(x, w)
        return x

    ws, x = [torch.eye(2) for _ in range(3)], torch.ones(3, 2)
    for as_arg, close in [(False, False), (True, True)]:
        f = fgraph.jit(model, static=["as_arg"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
        assert torch.allclose(f(x, ws, as_arg), model(x, ws, as_arg)) is close  # from outside: layer 1's scale x3


def test_grad_mode_read_under_another_name():
    # torch.is_grad_enabled() itself keys the trace (tests/test_semantics.py); a name bound to it before
    # tracing (`from torch import is_grad_enabled`) is not seen
    is_grad_enabled = torch.is_grad_enabled
    f = fgraph.jit(lambda x: x * 2 if is_grad_enabled() else x * 3, mode="PIECEWISE")
    with torch.no_grad():
        assert f(torch.ones(2)).tolist() == [3.0, 3.0]
    assert f(torch.ones(2)).tolist() == [3.0, 3.0]  # eager gives [2.0, 2.0]: grad mode is on


class PrivatelyScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._scale = 2.0

    def forward(self, x):
        return x * self._scale


def test_private_and_computed_attributes():
    m = PrivatelyScaled()
    f = fgraph.jit(m, mode="PIECEWISE")
    assert f(torch.ones(2)).tolist() == [2.0, 2.0]
    m._scale = 3.0
    assert f(torch.ones(2)).tolist() == [2.0, 2.0]  # eager gives [3.0, 3.0]: `_scale` is not guarded
    f.reset()
    assert f(torch.ones(2)).tolist() == [3.0, 3.0]  # the fix here: reset after the edit


def test_module_changes_without_tensors():
    """A parameter-free submodule swapped for one whose guarded values differ (ReLU's `inplace`, Tanh has none) is
    seen: the module tree changed, so what the function reads is scanned again. One swapped for a module with the
    same guarded values (Tanh for Sigmoid: none) is not."""
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    f, x = fgraph.jit(m, mode="PIECEWISE"), -torch.ones(1, 2)
    with torch.no_grad():
        f(x)
        m[1] = torch.nn.Tanh()
        assert torch.equal(f(x), m(x))  # ReLU's guard gone: another signature
        m[1] = torch.nn.Sigmoid()
        assert not torch.equal(f(x), m(x))  # the trace still applies Tanh
        f.reset()
        assert torch.equal(f(x), m(x))  # the fix: reset after editing the module


def test_statics_keyed_by_type_and_value():
    f = fgraph.jit(lambda x, k: x * k, static=["k"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    x = torch.arange(3)
    assert f(x, 2).dtype == torch.int64
    assert f(x, 2.0).dtype == torch.float32  # as eager: 2.0 == 2 in Python, but a static is keyed by its type too
    assert f(x, True).dtype == torch.int64 and f(x, True).tolist() == [0, 1, 2]
    assert len(f.entries) == 3


def test_warmup_and_capture_leave_no_trace():
    def bump(x, state):
        state["calls"].add_(1)
        return x + 1, state

    f = fgraph.jit(bump, donate=["state"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    state = {"calls": torch.zeros(())}
    f(torch.ones(3), state)
    assert state["calls"].item() == 1  # warm-up and capture ran it on the all-padding dummy, then put it back
    f(torch.ones(3), state)
    assert state["calls"].item() == 2  # replays are exact


def test_warmup_runs_once_per_trace_capture_once_per_signature():
    def bump(x, state):
        state["calls"].add_(1)
        return x + 1, state

    f = fgraph.jit(bump, donate=["state"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4, 8, 16])
    state = {"calls": torch.zeros(())}
    f.capture(torch.ones(3), state, progress=False)
    assert state["calls"].item() == 0  # capture ran the function, then put the donated state back
    assert f.stats()["total"]["warmups"] == 1  # one warm-up (buckets >= 2 share a trace), one capture per bucket
    f(torch.ones(3), state)
    assert state["calls"].item() == 1


@pytest.mark.parametrize(
    "break_op, mode, runs",
    [("toy_planned", "PIECEWISE", 1 + 3), ("toy_planned", "FULL", 3 + 3), ("toy_prepared", "FULL", 1 + 3)],
)
def test_a_planned_break_is_warmed_up_per_signature_only_inside_full_graphs(break_op, mode, runs):
    """A break with a plan hook may keep host state per signature (flashinfer's per-bucket wrappers), so a FULL
    graph, which records the break, warms up every signature, unless the hook says it made that state itself
    (returns True, as flashinfer's does once a first wrapper exists). PIECEWISE runs the break eagerly in its
    capture pass anyway: one warm-up per trace, as without plans."""

    def bump(x, lens, state):
        state["calls"].add_(1)
        o = torch.empty_like(x)
        getattr(toys, break_op)(o, x, lens)
        return o + 1, state

    f = fgraph.jit(bump, donate=["state"], batch={"x": Batched(), "lens": Batched()}, mode=mode, buckets=[4, 8, 16])
    state = {"calls": torch.zeros(())}
    f.capture(torch.ones(3, 2), torch.ones(3, dtype=torch.int32), state, progress=False)
    assert state["calls"].item() == 0  # put back after the warm-ups and capture runs
    assert f.stats()["total"]["warmups"] == runs - 3  # warm-ups + one capture run per bucket


def test_python_side_effects_run_once_at_trace():
    log = []

    def f(x):
        log.append("called")
        return x + 1

    j = fgraph.jit(f, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    for _ in range(3):
        j(torch.ones(2))
    assert log == ["called"]  # should be 3 entries! only the trace ran Python


def test_values_stored_into_an_argument_stay_in_the_trace():
    """Storing into a container argument (`state["h"] = ...`) is a Python side effect: it ran once, on the trace's
    own dict. The caller's dict keeps what it held, as under jax.jit; the returned one holds the new value."""

    def f(x, state):
        state["h"] = state["h"] + 1
        return x * 2, state

    j = fgraph.jit(f, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    state = {"h": torch.zeros(3)}
    _, back = j(torch.ones(2), state)
    assert state["h"].tolist() == [0.0] * 3  # should be [1.0] * 3! eager stores into the caller's dict
    assert back is not state and back["h"].tolist() == [1.0] * 3  # the fix: use the returned state


def test_storage_swapped_under_a_tensor():
    """The replay path proves a leaf unchanged by identity: the same tensor object. Swapping the memory under it
    (`.data =`, `.set_`) or its strides (`.t_()`) keeps the object, so the graph still reads the old memory, in the
    old layout; `.requires_grad_()` on it is not refused as a new tensor that requires grad is (a jitted call is
    inference)."""
    f = fgraph.jit(lambda x, p: x * p["s"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    p = {"s": torch.full((1,), 2.0)}
    f(torch.ones(4), p)
    f(torch.ones(4), p)
    p["s"].data = torch.full((1,), 5.0)
    assert f(torch.ones(4), p).tolist() == [2.0] * 4  # should be [5.0] * 4! the graph reads the old memory
    p["s"] = torch.full((1,), 5.0)  # a new tensor is seen
    assert f(torch.ones(4), p).tolist() == [5.0] * 4
    g = fgraph.jit(lambda x, p: x @ p["w"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[2])
    w = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    g(torch.eye(2), w), g(torch.eye(2), w)
    w["w"].t_()
    assert g(torch.eye(2), w).tolist() == [[1.0, 2.0], [3.0, 4.0]]  # should be transposed! the old layout
    w["w"] = w["w"].clone()  # a new tensor is seen
    assert g(torch.eye(2), w).tolist() == [[1.0, 3.0], [2.0, 4.0]]
    g(torch.eye(2), w)
    w["w"].requires_grad_()
    assert not g(torch.eye(2), w).requires_grad  # should be an FgraphError (grad mode is on), as for a new tensor
    with pytest.raises(fgraph.FgraphError, match=r"requires grad and grad mode is on"):
        g(torch.eye(2), {"w": w["w"]})


def test_frozen_record_changed_by_force():
    import attrs

    @fgraph.register
    @attrs.frozen
    class P:
        s: torch.Tensor

    f = fgraph.jit(lambda x, p: x * p.s, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    p = P(torch.full((1,), 2.0))
    f(torch.ones(4), p)
    f(torch.ones(4), p)
    object.__setattr__(p, "s", torch.full((1,), 5.0))
    assert f(torch.ones(4), p).tolist() == [2.0] * 4  # should be [5.0] * 4! a frozen tree is not re-read
    assert f(torch.ones(4), attrs.evolve(p)).tolist() == [5.0] * 4  # a new object is


def test_a_batched_input_aliasing_written_state_after_the_first_call():
    """A batched input is read from a padded copy made before the call. Passing one that shares memory with state
    the function writes is refused where a call's layout is first seen (tests/test_semantics.py); the replay path
    does not compare memory ranges per call, so the same aliasing on a later call of a known layout goes unseen."""

    def step(x, state):
        state["h"].add_(1)
        return x * 2

    f = fgraph.jit(step, donate=["state"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    state = {"h": torch.ones(3)}
    f(torch.ones(3), state)  # the layout, learned without aliasing
    out = f(state["h"], state)  # x is state["h"]: eager returns (h + 1) * 2
    assert out.tolist() == [4.0] * 3  # should be [6.0] * 3! read before the write


def test_cublas_reduction_flags():
    """cuBLAS's reduced-precision reduction flags pick among GEMM kernels that round differently, not the dtype of
    any result: they are not read per call (autocast, the default dtype and TF32 precision are, tests/test_semantics
    .py), so a signature captured under one setting replays its kernels under the other."""
    mm = torch.backends.cuda.matmul
    f = fgraph.jit(lambda x: x @ x.T, batch={"x": Batched()}, mode="FULL", buckets=[4])
    f(torch.ones(3, 2))
    before = mm.allow_bf16_reduced_precision_reduction
    mm.allow_bf16_reduced_precision_reduction = not before
    try:
        f(torch.ones(3, 2))
    finally:
        mm.allow_bf16_reduced_precision_reduction = before
    assert len(f.entries) == 1  # should be 2 for kernels chosen anew; the same graph replayed


def test_requires_grad_flipped_after_the_trace():
    """Lifted tensors are traced with their requires_grad (torch picks kernels by it), and signatures key on it, but
    the replay path does not read ~300 flags per call: a flip between two calls it serves keeps the old kernels."""
    from tests.padding.test_bitwise import LastToken

    m = LastToken()
    f = fgraph.jit(m)
    h = torch.randn(3, 7, 64)
    with torch.no_grad():
        before = m(h)
        f(h), f(h)  # the same tensor again: the replay path serves it
        m.requires_grad_(False)
        got = f(h)
        after = m(h)
        assert not torch.equal(before, after)  # (eager's own kernels moved: a batched GEMM instead of one GEMM)
        assert torch.equal(got, before)  # should equal `after`! the old trace's kernels
        assert f.stats()["total"]["traces"] == 1
        f.reset()
        assert torch.equal(f(h), after)


def test_matmul_fold_under_inference_mode():
    """Under inference mode make_fx records the last token's head as a batched GEMM, where eager runs one GEMM (the
    weights' flags set on the trace's fakes or not). Under no_grad the trace is eager's."""
    from tests.padding.test_bitwise import LastToken

    m = LastToken()
    h = torch.randn(3, 7, 64)
    with torch.inference_mode():
        got, want = fgraph.jit(m)(h), m(h)
    assert not torch.equal(got, want)  # should be equal! another GEMM than eager's
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        assert torch.equal(fgraph.jit(m, mode="FULL")(h), m(h))


def test_torch_module_fast_paths():
    """torch's module fast paths (a fused encoder layer, native MHA) check their arguments and the modes on, and
    skip themselves under fgraph's trace: a jitted layer runs the composite path, which rounds apart from eager's
    fast path."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0).eval()
    f = fgraph.jit(layer)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        got, fast = f(x), layer(x)
    assert not torch.equal(got, fast)  # should be equal! eager's fast path against the traced composite path
    torch.testing.assert_close(got, fast)
    with torch.enable_grad():  # (no fast path in eager either when its weights require grad under grad mode)
        assert torch.equal(f(x), layer(x))


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_random_draws_differ_from_eager(mode, caplog):
    def noisy(x):
        return x + torch.rand_like(x)

    j, x = fgraph.jit(noisy, batch={"x": Batched()}, mode=mode, buckets=[4]), torch.zeros(3, 2)
    torch.manual_seed(0)
    want = [noisy(x) for _ in range(2)]
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        got = [j(x) for _ in range(2)]
    assert not torch.equal(got[1], want[1])  # the bucket's 8 draws, not eager's 6 (and warm-up's before them)
    assert sum("aten.rand_like at" in r.getMessage() for r in caplog.records) == 1
    assert "random: aten.rand_like at" in str(fgraph.explain(j, x))
    # the fix: the noise passed in is eager's
    plus = fgraph.jit(lambda x, noise: x + noise, batch={"x": Batched(), "noise": Batched()}, mode=mode, buckets=[4])
    torch.manual_seed(0)
    assert all(torch.equal(plus(x, torch.rand_like(x)), w) for w in want)
