"""jax.jit's contract, as specs against eager: a jitted function gives the answer the plain function would, for any
inputs of the same kind, in every mode, whatever the caller did between calls (issue #20, dispatch half).

Inputs are values: a non-static tensor may be a new tensor on any call (read in place when it is the captured one,
else copied, counted in stats()). Nothing is stale: a leaf replaced inside a container, a longer list, a changed
static field are seen. Threads get their own results. A failed or interrupted capture leaves nothing behind.
Outputs are copies by default. Retraces are bounded and loud. stats() counts every signature.
"""

import collections
import contextlib
import dataclasses
import functools
import gc
import logging
import threading
import weakref

import attrs
import pytest
import torch

import fgraph
from fgraph import Batched
from fgraph.capture import _entry as E
from fgraph.function import _shared
from tests import toys

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]
# "cuda-default": on the GPU with torch.set_default_device("cuda") in force (fgraph's own buffers must not follow it)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cuda-default", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param != "cuda-default":
        yield request.param
        return
    prev = torch.get_default_device()
    torch.set_default_device("cuda")
    try:
        yield "cuda"
    finally:
        torch.set_default_device(prev)


def layer(p, x):
    """A dense layer, a break (so PIECEWISE and FULL really split), another dense op: x [N, 4] -> [N, 4]."""
    h = x @ p["w"]
    o = torch.empty_like(h)
    toys.toy_scale(o, h, 0.5)
    return torch.tanh(o) + p["b"]


def params(device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {
        "w": torch.randn(4, 4, generator=g, device="cpu").to(device),
        "b": torch.randn(4, generator=g, device="cpu").to(device),
    }


def rand(device, *shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu").to(device)


# -- inputs are values -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_new_input_tensors_every_call(mode, device):
    j = fgraph.jit(layer, mode=mode)
    p = params(device)
    for k in range(4):
        x = rand(device, 3, 4, seed=k)  # not Batched: read by address in a graph
        torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    # the first x and the second (the graphs are captured again to read it) are read in place, later ones copied
    assert j.stats()["total"]["copies"] == (0 if mode == "NONE" else 2)


@pytest.mark.parametrize("mode", MODES)
def test_a_reloaded_checkpoint_is_read_in_place_and_the_old_one_still_works(mode, device):
    j = fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4])
    old, new = params(device, 0), params(device, 1)
    before = {k: v.clone() for k, v in old.items()}
    x = rand(device, 3, 4)
    torch.testing.assert_close(j(old, x), layer(old, x), rtol=0, atol=0)
    captures = j.stats()["total"]["captures"]
    for _ in range(3):  # the new params are read in place after one more capture: no copies
        torch.testing.assert_close(j(new, x), layer(new, x), rtol=0, atol=0)
    graphed = mode != "NONE"
    assert j.stats()["total"]["copies"] == 0
    assert j.stats()["total"]["captures"] == captures * (2 if graphed else 1)
    torch.testing.assert_close(j(old, x), layer(old, x), rtol=0, atol=0)  # the old ones too, now copied
    for k in old:  # tensors are never written into by a call that did not pass them
        assert torch.equal(old[k], before[k])
    assert j.stats()["total"]["copies"] == int(graphed)


@pytest.mark.parametrize("mode", MODES)
def test_new_params_are_seen_by_every_signature(mode, device):
    """Each signature's graphs read their own captured tensors: new params met at one bucket are copied at the
    others too, also when the replay path meets them first there."""
    j = fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4, 8])
    old, new = params(device, 0), params(device, 1)
    x4, x8 = rand(device, 3, 4), rand(device, 7, 4)
    j(old, x4), j(old, x8)
    for p, x in [(new, x4), (new, x8), (new, x8), (old, x4), (old, x8)]:
        torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_functional_state_fed_back(mode, device):
    """jax-style state: a new dict of new tensors returned and passed back in."""

    def step(p, x, state):
        h = layer(p, x) + state["h"]
        return h.sum(0), {"h": h * 0.5}

    j = fgraph.jit(step, mode=mode)
    p, x = params(device), rand(device, 3, 4)
    s_jit = s_eager = {"h": torch.zeros(3, 4, device=device)}
    for _ in range(4):
        y, s_jit = j(p, x, s_jit)
        y_ref, s_eager = step(p, x, s_eager)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        torch.testing.assert_close(s_jit["h"], s_eager["h"], rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_donated_state_passed_as_a_new_tensor(mode, device):
    """The function updates donated state in place: a new tensor passed for it ends the call holding what eager
    would leave in it, and the originally captured tensor, passed again later, still works."""

    def step(p, x, state):
        state["h"].mul_(0.5).add_(layer(p, x))
        return state["h"].sum(0), state

    j = fgraph.jit(step, donate=["state"], mode=mode)
    p, x = params(device), rand(device, 3, 4)
    first = {"h": torch.zeros(3, 4, device=device)}
    j(p, x, first)  # captures with `first` (warm-up and capture run the function too: tests/test_footguns.py)
    for s in [{"h": rand(device, 3, 4, seed=7)}, first, {"h": rand(device, 3, 4, seed=8)}, first]:
        ref = {"h": s["h"].clone()}
        y, back = j(p, x, s)
        assert back is s  # the caller's own state object, as eager returns it
        torch.testing.assert_close(y, step(p, x, ref)[0], rtol=0, atol=0)
        torch.testing.assert_close(s["h"], ref["h"], rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_donated_batched_input_written_in_place_ends_as_eager_leaves_it(mode, device):
    """The program runs on fgraph's padded copy of a batched input. When the function writes that input in place
    (donated), the caller's rows are copied back after each call, as eager writes the caller's tensor (counted in
    stats: written_back); and the padding the program wrote over is padded again before the next call, so padded
    rows never drift (the max over rows below would see them after 5 calls at the same size: -3 + 5 > 2)."""

    def step(x):
        x.add_(1)
        return x.amax(0)

    j = fgraph.jit(step, donate=["x"], batch={"x": Batched(pad=-3.0, mixes=True)}, mode=mode, buckets=[8])
    sizes = (3, 3, 5, 3, 3, 3, 3, 3, 8)
    for k, n in enumerate(sizes):
        x = rand(device, n, 4, seed=k).abs()  # rows in [0, ~3]: below the pad only if the pad stays put
        ref = x.clone()
        out = j(x)
        torch.testing.assert_close(out, step(ref), rtol=0, atol=0)
        torch.testing.assert_close(x, ref, rtol=0, atol=0)  # the caller's tensor, written as eager writes it
    assert j.stats()["total"]["written_back"] == len(sizes)
    assert "read: padded into input buffers, written back: x" in str(fgraph.explain(j))


@pytest.mark.parametrize("mode", MODES)
def test_a_batched_input_sharing_memory_with_written_state_is_refused(mode):
    """A batched input is read from a padded copy made before the call, so it cannot see what the function writes
    into state it shares memory with (eager would): an error names both, where a call's layout is first seen."""

    def step(x, state):
        state["h"].add_(1)
        return x * 2

    j = fgraph.jit(step, donate=["state"], batch={"x": Batched()}, mode=mode, buckets=[4])
    h = torch.ones(2, 3)
    with pytest.raises(fgraph.SignatureError, match=r"x shares memory with state\['h'\], which the function writes"):
        j(h[0], {"h": h})  # a view of the state
    assert h.tolist() == [[1.0] * 3] * 2  # nothing written: warm-up and capture put the state back
    x, state = torch.ones(3), {"h": torch.ones(3)}
    assert j(x, state).tolist() == [2.0] * 3 and state["h"].tolist() == [2.0] * 3  # apart: as eager


@pytest.mark.parametrize("mode", MODES)
def test_any_input_sharing_memory_with_written_state_is_refused(mode):
    """The same for an input without the batch axis (a view of the state passed again): read in place it would see
    the write, but once calls pass new tensors fgraph reads copies, which would not. Refused on every call that
    passes such a pair, whatever came before."""

    def step(state, ro):
        state["h"].add_(1)
        return ro * 2

    j = fgraph.jit(step, donate=["state"], mode=mode)
    for _ in range(3):  # apart: as eager, on new tensors each call
        h, ro = torch.zeros(3), torch.ones(3)
        assert j({"h": h}, ro).tolist() == [2.0] * 3 and h.tolist() == [1.0] * 3
    h = torch.zeros(3)
    with pytest.raises(fgraph.SignatureError, match=r"ro shares memory with state\['h'\], which the function writes"):
        j({"h": h}, h.view(3))


def reshaped(p, x, state):
    """reshape is a view of a contiguous tensor and a copy of any other layout: each layout traces its own ops."""
    state["h"].reshape(-1)[:4].add_(1)  # writes the state only where reshape is a view of it (a contiguous h)
    return layer({"w": p["w"].reshape(16).view(4, 4), "b": p["b"]}, x), state


LAYOUTS = {  # one [4, 4] value in four memory layouts
    "contiguous": lambda t: t.clone(),
    "offset": lambda t: torch.cat([t.new_zeros(3), t.reshape(-1)])[3:].view(4, 4),  # contiguous, at an offset
    "transposed": lambda t: t.T.contiguous().T,
    "strided": lambda t: torch.stack([t, t], -1)[..., 0],  # every other element of a [4, 8]
}


@pytest.mark.parametrize("mode", MODES)
def test_inputs_in_other_memory_layouts_are_their_own_signatures(mode, device):
    """Strides change what a trace records: reshape of a contiguous tensor is a view (an in-place write through it
    reaches the tensor, `.view` after it works), of a transposed one a copy. So tensors without the batch axis are
    keyed by their strides where they are not contiguous (batched ones are padded into contiguous buffers): a call
    in another layout, before or after the others, returns what eager returns and leaves the state as eager does.
    A storage offset changes no trace: it shares the contiguous signature."""
    j = fgraph.jit(reshaped, donate=["state"], batch={"x": Batched()}, mode=mode, buckets=[4])
    p, x = params(device), rand(device, 3, 4)
    w, h = rand(device, 4, 4, seed=5), rand(device, 4, 4, seed=6)
    calls = [("contiguous", "contiguous"), ("transposed", "contiguous"), ("contiguous", "transposed")]
    calls += [("offset", "transposed"), ("strided", "offset"), ("contiguous", "offset"), *calls]
    for wl, hl in calls:
        q, state, ref = {"w": LAYOUTS[wl](w), "b": p["b"]}, {"h": LAYOUTS[hl](h)}, {"h": LAYOUTS[hl](h)}
        got, back = j(q, x, state)
        assert back is state
        torch.testing.assert_close(got, reshaped(q, x, ref)[0], rtol=0, atol=0, msg=(wl, hl))
        torch.testing.assert_close(state["h"], ref["h"], rtol=0, atol=0, msg=(wl, hl))
    assert len(j.entries) == 4  # (w, h) contiguous or at an offset, w transposed or strided, h transposed


def tied(p, x):
    """Two weights, which a model may tie (one tensor passed for both)."""
    return layer({"w": p["embed"], "b": p["b"]}, x) + x @ p["head"] * 2


@pytest.mark.parametrize("mode", MODES)
def test_one_tensor_passed_for_two_leaves_is_read_as_two(mode, device):
    """Tied weights: the same tensor at p['embed'] and p['head'] on the first call. Each leaf is traced as an input
    of its own, so a later call passing two tensors there reads each of them (a trace of the tied call read only
    one), and a tied call after untied ones reads the one tensor twice."""
    for first_tied in (True, False):
        j = fgraph.jit(tied, batch={"x": Batched()}, mode=mode, buckets=[4])
        w, head, b, x = rand(device, 4, 4, seed=3), rand(device, 4, 4, seed=4), params(device)["b"], rand(device, 3, 4)
        both, apart = {"embed": w, "head": w, "b": b}, {"embed": w, "head": head, "b": b}
        for p in [both, apart, apart, both] if first_tied else [apart, both, both, apart]:
            torch.testing.assert_close(j(p, x), tied(p, x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_strict_refuses_to_copy(mode):
    j = fgraph.jit(layer, mode=mode, strict=True)
    p = params("cpu")
    j(p, rand("cpu", 3, 4))
    with pytest.raises(fgraph.SignatureError, match=r"x is not the tensor the graphs of signature .* read"):
        j(p, rand("cpu", 3, 4, seed=2))


def test_large_copies_are_logged_once(caplog):
    j = fgraph.jit(lambda p, x: x @ p["w"], mode="PIECEWISE")
    x = torch.ones(2, 2048)
    j({"w": torch.zeros(2048, 1024)}, x)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for v in (1.0, 2.0):
            out = j({"w": torch.full((2048, 1024), v)}, x)
    assert out[0, 0].item() == 2048 * 2.0
    msgs = [r.getMessage() for r in caplog.records if "copies" in r.getMessage()]
    assert len(msgs) == 1 and "8.0 MiB" in msgs[0] and "p['w']" in msgs[0]


# -- never stale -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_leaf_replaced_inside_the_same_dict_is_seen(mode, device):
    j = fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4])
    p, x = params(device), rand(device, 3, 4)
    j(p, x), j(p, x)  # the second call takes the replay path
    p["b"] = torch.full((4,), 5.0, device=device)
    torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    p["b"].fill_(7.0)  # updated in place: read in place (or copied again)
    torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_without_the_batch_axis_inside_a_batched_argument_is_seen(mode, device):
    """batch={"batch": {"x": Batched(), "bias": None}}: `bias` is read in place like a parameter, but its container
    is flattened afresh every call, so no container identity vouches for it: every tensor passed there is seen."""

    def f(p, batch):
        return batch["x"] @ p["w"] + batch["bias"]

    j = fgraph.jit(f, batch={"batch": {"x": Batched(), "bias": None}}, mode=mode, buckets=[4])
    p, x = params(device), rand(device, 3, 4)
    zero = torch.zeros(4, device=device)
    for bias in [zero, zero, zero + 7, zero + 7, zero + 9]:  # the same tensor twice, then new ones
        b = {"x": x, "bias": bias}
        torch.testing.assert_close(j(p, b), f(p, b), rtol=0, atol=0)


def masked(p, b, bias):
    """Optional batched inputs: a mask and a bias some calls pass and others leave None."""
    y = b["x"] @ p["w"]
    y = y if b["mask"] is None else y * b["mask"][:, None]
    return y if bias is None else y + bias


@pytest.mark.parametrize("mode", MODES)
def test_a_batched_leaf_may_be_none(mode, device):
    """None where a Batched tensor may be is an absent input, as an empty subtree under jax.jit: a leaf of its own
    (a signature apart from a tensor there) with no batch axis, not a leaf declared Batched that is no tensor."""
    batch = {"b": {"x": Batched(), "mask": Batched()}, "bias": Batched()}
    j = fgraph.jit(masked, batch=batch, mode=mode, buckets=[4, 8])
    p = params(device)
    calls = [(3, 0, 0), (3, 1, 0), (5, 0, 1), (3, 0, 0), (5, 1, 1), (3, 1, 0)]  # (rows, a mask?, a bias?)
    for k, (n, mask, bias) in enumerate(calls):
        b = {"x": rand(device, n, 4, seed=k), "mask": rand(device, n, seed=20 + k) if mask else None}
        c = rand(device, n, 4, seed=40 + k) if bias else None
        torch.testing.assert_close(j(p, b, c), masked(p, b, c), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_longer_list_is_seen(mode, device):
    def f(ws, x):
        for w in ws:
            x = layer({"w": w, "b": 0.0}, x)
        return x

    j = fgraph.jit(f, batch={"x": Batched()}, mode=mode, buckets=[4])
    ws, x = [rand(device, 4, 4, seed=3)], rand(device, 3, 4)
    j(ws, x), j(ws, x)
    ws.append(rand(device, 4, 4, seed=4))
    torch.testing.assert_close(j(ws, x), f(ws, x), rtol=0, atol=0)
    assert len(j.entries) == 2


@fgraph.register
@attrs.define
class Cfg:
    w: torch.Tensor
    scale: float = fgraph.field(static=True, default=1.0)


@fgraph.register
@attrs.frozen
class FrozenCfg:
    w: torch.Tensor
    parts: list  # a mutable list inside a frozen record: still re-read per call


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_static_field_on_the_same_object_is_seen(mode, device):
    def f(c, x):
        return layer({"w": c.w, "b": 0.0}, x) * c.scale

    j = fgraph.jit(f, batch={"x": Batched()}, mode=mode, buckets=[4])
    c, x = Cfg(rand(device, 4, 4)), rand(device, 3, 4)
    j(c, x), j(c, x)
    c.scale = 3.0
    torch.testing.assert_close(j(c, x), f(c, x), rtol=0, atol=0)
    c.w = rand(device, 4, 4, seed=9)
    torch.testing.assert_close(j(c, x), f(c, x), rtol=0, atol=0)


def test_a_mutable_container_inside_a_frozen_one_is_seen():
    def f(c, x):
        return x @ c.w + sum(c.parts)

    j = fgraph.jit(f, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    c, x = FrozenCfg(torch.eye(4), [torch.ones(4)]), torch.ones(3, 4)
    j(c, x), j(c, x)
    c.parts[0] = torch.full((4,), 2.0)
    torch.testing.assert_close(j(c, x), f(c, x), rtol=0, atol=0)


def test_guards_skip_immutable_trees():
    from fgraph._pytree import flatten_with_paths
    from fgraph.function._fastpath import guard_for

    frozen = (torch.ones(1), (torch.ones(1),))
    assert guard_for(frozen, flatten_with_paths(frozen)[1]) is None  # identity is the proof: no per-call work
    d = {"a": [torch.ones(1)]}
    g = guard_for(d, flatten_with_paths(d)[1])
    assert g(d)
    d["a"].append(torch.ones(1))
    assert not g(d)


# -- threads ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_threads_get_their_own_results(mode, device):
    j = fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4])
    p = params(device)
    xs = [rand(device, 3, 4, seed=k) for k in range(4)]
    refs = [layer(p, x) for x in xs]
    j(p, xs[0])
    bad = []

    def worker(k):
        for _ in range(100):
            if not torch.equal(j(p, xs[k]), refs[k]):
                bad.append(k)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert bad == []


def test_a_call_while_another_thread_traces_waits_its_turn():
    """Tracing is per thread: a call from another thread meanwhile is not "inside a trace" (inlined, eager, unlocked,
    uncounted, reading whatever the trace has swapped in) but an fgraph call that waits for the function's lock."""
    from torch._subclasses import FakeTensor

    tracing, release = threading.Event(), threading.Event()

    def f(x, state):
        if isinstance(x, FakeTensor) and not release.is_set():  # thread A's trace, held open
            tracing.set()
            release.wait(5)
        state["n"].add_(1)
        return x * 2, state

    j = fgraph.jit(f, donate=["state"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    state, outs = {"n": torch.zeros(())}, {}
    a = threading.Thread(target=lambda: outs.setdefault("a", j(torch.ones(3), state)[0]))
    b = threading.Thread(target=lambda: outs.setdefault("b", j(torch.ones(2), state)[0]))
    a.start()
    assert tracing.wait(5)
    b.start()
    b.join(0.3)  # B waits on the lock while A traces (it used to run at once, eagerly)
    release.set()
    a.join(), b.join()
    assert outs["a"].tolist() == [2.0] * 3 and outs["b"].tolist() == [2.0] * 2
    assert state["n"].item() == 2 and j.stats()["total"]["calls"] == 2


def test_executions_in_two_threads_keep_their_own_tokens():
    """A enters an execution, B enters one, A leaves, B leaves: neither sees the other's token (its
    once_per_execution memo), and none is left installed after both are done."""
    from fgraph import _primitives as P

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with P.execution() as tok:
            a_in.set()
            b_in.wait(5)
            seen["a"] = P.executing() is tok
        a_out.set()

    def b():
        a_in.wait(5)
        with P.execution() as tok:
            b_in.set()
            a_out.wait(5)
            seen["b"] = P.executing() is tok

    ts = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen == {"a": True, "b": True} and P.executing() is None


# -- failure leaves nothing half made --------------------------------------------------------------------------
def _failing_capture(monkeypatch, exc):
    real, failed = E.Entry.capture, []

    def capture(self, *a, **k):
        if not failed:
            failed.append(True)
            raise exc
        return real(self, *a, **k)

    monkeypatch.setattr(E.Entry, "capture", capture)
    return failed


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_an_interrupted_capture_is_made_again(mode, monkeypatch):
    j = fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4])
    p, x = params("cpu"), rand("cpu", 3, 4)
    _failing_capture(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        j(p, x)
    assert not j.entries and not any(j.cache.traces.values())
    torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    assert j.stats()["total"]["traces"] == 1 and len(j.entries) == 1


def test_a_failed_capture_says_why_and_is_made_again(monkeypatch):
    j = fgraph.jit(layer, batch={"x": Batched()}, mode="FULL", buckets=[4])
    p, x = params("cpu"), rand("cpu", 3, 4)
    _failing_capture(monkeypatch, RuntimeError("cublas handle"))
    with pytest.raises(
        fgraph.CaptureError, match=r"warm-up or capture of signature \(bucket=4\) failed: RuntimeError: cublas handle"
    ):
        j(p, x)
    assert not j.entries
    torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    assert j.stats()["total"]["replays"] == 1


def test_a_capture_out_of_memory_frees_it_and_runs_eagerly(monkeypatch):
    j = fgraph.jit(layer, batch={"x": Batched()}, mode="FULL", buckets=[4])
    p, x = params("cpu"), rand("cpu", 3, 4)
    _failing_capture(monkeypatch, torch.OutOfMemoryError("out of memory"))
    torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    assert not j.entries and j.stats()["fallbacks"]["oom"] == 1
    torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    assert len(j.entries) == 1


@pytest.mark.gpu
def test_a_capture_out_of_memory_on_the_gpu_frees_what_it_made(monkeypatch):
    from fgraph.capture import _graphs as G

    j = fgraph.jit(layer, batch={"x": Batched()}, mode="FULL", buckets=[4])
    p, x = params("cuda"), rand("cuda", 3, 4)
    real = G.CudaGraph.capture

    def capture(self, fn, *args):
        self.junk = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # what the capture made before failing
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    layer(p, x)  # eager's cuBLAS workspace made first (a capture elsewhere may have freed it): not the capture's
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    monkeypatch.setattr(G.CudaGraph, "capture", capture)
    torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    assert j.stats()["fallbacks"]["oom"] == 1 and not j.entries
    assert torch.cuda.memory_allocated() < before + (1 << 20)
    monkeypatch.setattr(G.CudaGraph, "capture", real)
    torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    assert j.stats()["total"]["replays"] == 1


# -- outputs are safe by default -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_kept_outputs_are_not_overwritten(mode, device):
    j = fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4])
    p = params(device)
    x1, x2 = rand(device, 3, 4, seed=1), rand(device, 4, 4, seed=2)
    a = j(p, x1)
    j(p, x2)
    torch.testing.assert_close(a, layer(p, x1), rtol=0, atol=0)


def returns_its_inputs(p, x, w):
    """Outputs that are inputs or views of them, next to a computed one: eager returns the caller's tensors."""
    return {"x": x, "rows": x[:, :2], "flat": w.reshape(-1), "T": w.T, "y": layer(p, x)}


@dataclasses.dataclass
class Logits:  # registered by no one: fgraph registers records where it meets them, outputs included
    scores: torch.Tensor
    top: torch.Tensor


@attrs.define
class Step:
    out: Logits
    n: int


def scored(p, x):
    s = x @ p["w"]
    return Step(Logits(s, s.argmax(-1)), x.shape[0])


@pytest.mark.parametrize("mode", MODES)
def test_records_come_back_as_records_of_this_calls_values(mode, device):
    """A dataclass or attrs instance returned (never seen in the arguments) is a pytree node like a dict: the
    caller gets a record of this call's values at its size, equal to eager's, never the traced record."""
    j = fgraph.jit(scored, batch={"x": Batched()}, mode=mode, buckets=[4, 8])
    p = params(device)
    for k, n in enumerate([3, 4, 7, 3]):
        x = rand(device, n, 4, seed=k)
        got, want = j(p, x), scored(p, x)
        assert type(got) is Step and type(got.out) is Logits and got.n == n
        torch.testing.assert_close(got.out.scores, want.out.scores, rtol=0, atol=0)
        assert torch.equal(got.out.top, want.out.top)


def test_an_output_fgraph_cannot_see_into_is_refused():
    class Box:
        def __init__(self, y):
            self.y = y

    class Fields(collections.OrderedDict):  # a hand-rolled ModelOutput: a dict class pytrees do not know
        pass

    j = fgraph.jit(lambda x: {"a": [x, Box(x + 1)]}, batch={"x": Batched()}, mode="FULL", buckets=[4])
    with pytest.raises(fgraph.TraceError, match=r"output a\[1\] is a .*Box holding tensors, which fgraph cannot see"):
        j(torch.ones(3, 2))
    j = fgraph.jit(lambda x: Fields(y=x + 1), batch={"x": Batched()}, mode="FULL", buckets=[4])
    with pytest.raises(fgraph.TraceError, match=r"the output is a .*Fields holding tensors"):
        j(torch.ones(3, 2))
    j = fgraph.jit(lambda x: {"cache": Box([Box(x * 3)])}, batch={"x": Batched()}, mode="FULL", buckets=[4])
    with pytest.raises(fgraph.TraceError, match=r"output cache is a .*Box holding tensors"):  # a DynamicCache's depth
        j(torch.ones(3, 2))


@pytest.mark.parametrize("mode", MODES)
def test_python_values_among_the_outputs_come_back_as_they_are(mode):
    j = fgraph.jit(lambda x: (x + 1, slice(0, 2), "rows", None), batch={"x": Batched()}, mode=mode, buckets=[4])
    y, sl, s, none = j(torch.ones(3, 2))
    assert torch.equal(y, torch.full((3, 2), 2.0)) and (sl, s, none) == (slice(0, 2), "rows", None)


@pytest.mark.parametrize("copy_outputs", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_outputs_that_are_inputs_or_views_of_them_are_values(mode, copy_outputs, device):
    """`return x`, `x[:, :2]`, `w.reshape(-1)`: equal to eager on every call, new tensors or not, and never the
    caller's own memory (nor fgraph's input buffers, which the next call overwrites), as jax.jit returns values."""
    j = fgraph.jit(returns_its_inputs, batch={"x": Batched()}, mode=mode, buckets=[4], copy_outputs=copy_outputs)
    p = params(device)
    for k, n in enumerate([3, 4, 3]):
        x, w = rand(device, n, 4, seed=k), rand(device, 4, 4, seed=10 + k)
        got, want = j(p, x, w), returns_its_inputs(p, x, w)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
        shared = {t.untyped_storage().data_ptr() for t in (x, w)}
        assert all(got[key].untyped_storage().data_ptr() not in shared for key in ("x", "rows", "flat", "T"))
        if copy_outputs:
            kept = {key: t.clone() for key, t in got.items()}
            j(p, rand(device, 4, 4, seed=99), rand(device, 4, 4, seed=98))
            for key in kept:
                torch.testing.assert_close(got[key], kept[key], rtol=0, atol=0)


def stores_into_its_argument(x, state):
    """jax-style state kept in the dict passed in: new values stored into it (no in-place update), then returned."""
    state["h"] = state["h"] + x.sum(0)
    state["rows"] = x.shape[0]  # a key the caller's dict does not have
    return x * 2, state


@pytest.mark.parametrize("mode", MODES)
def test_an_argument_returned_after_the_function_stored_into_it_holds_the_new_values(mode, device):
    """A donated argument the function returns comes back as the caller's own object only where the function left it
    holding what was passed (its tensors updated in place or not); any other argument returned is a value (its
    tensors copied: tests/padding/test_outputs.py). One it stored new values into comes back as the traced tree of this
    call's values, as jax.jit returns it, never as the caller's object with the old ones. (The caller's own dict
    is not written by a jitted call: tests/test_footguns.py.)"""
    j = fgraph.jit(stores_into_its_argument, batch={"x": Batched(mixes=True)}, mode=mode, buckets=[4, 8])
    for k, n in enumerate([3, 3, 5, 4]):
        x, h = rand(device, n, 2, seed=k), rand(device, 2, seed=10 + k)
        (y, got), (y_ref, want) = j(x, {"h": h}), stores_into_its_argument(x, {"h": h})
        assert got.keys() == want.keys() and got["rows"] == n
        torch.testing.assert_close(got["h"], want["h"], rtol=0, atol=0)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_torch_global_settings_are_part_of_the_signature(mode, device):
    """Autocast, the default dtype and float32 matmul precision change what a trace records (the dtype of a matmul,
    of `torch.zeros(4)`) or which kernels a graph captures: a call under other settings gets its own signature, so
    each result is eager's under the settings of that call, in either order."""
    kind = torch.device(device).type
    w = rand(device, 4, 4, seed=3)

    def f(x):
        return torch.mm(x, w) + torch.zeros(4, device=x.device)

    settings = {
        "defaults": contextlib.nullcontext,
        "autocast": lambda: torch.autocast(kind, dtype=torch.bfloat16),
        "float64 default": lambda: _setting(torch.get_default_dtype, torch.set_default_dtype, torch.float64),
        "TF32 allowed": lambda: _setting(
            torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, "high"
        ),
    }
    j = fgraph.jit(f, batch={"x": Batched()}, mode=mode, buckets=[4])
    x = rand(device, 3, 4)
    for name in ["defaults", "autocast", "defaults", "float64 default", "autocast", "TF32 allowed", "defaults"]:
        with settings[name]():
            got, want = j(x), f(x)
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    assert len(j.entries) == 4
    text = str(fgraph.explain(j))  # each signature names what differs from torch's defaults
    assert f"<torch>=[autocast({kind}, bfloat16)]" in text and "<torch>=[default dtype float64]" in text
    assert "<torch>=[matmul precision high]" in text


@pytest.mark.parametrize("mode", MODES)
def test_a_branch_on_grad_mode_is_part_of_the_signature(mode, device):
    """A function that asks torch.is_grad_enabled() gets a trace per grad mode, each eager's, in either order and
    on the replay path; torch.no_grad() inside the function (torch saving the mode it restores) asks nothing."""
    w = rand(device, 4, 4, seed=3)

    def branches(x, w):
        return x @ w if torch.is_grad_enabled() else x * 3

    def scoped(x, w):
        with torch.no_grad():
            return x @ w

    for f, traces in [(branches, 2), (scoped, 1)]:
        j = fgraph.jit(f, batch={"x": Batched()}, mode=mode, buckets=[4, 8])
        # a bucket first met under the other grad mode; replays (the same w) alternating the modes
        for grad, n in [(False, 3), (True, 6), (True, 3), (False, 6), (False, 3), (True, 2), (True, 6), (False, 6)]:
            x = rand(device, n, 4, seed=n)
            with torch.set_grad_enabled(grad):
                torch.testing.assert_close(j(x, w), f(x, w), rtol=0, atol=0, msg=f"{f.__name__} grad {grad} N={n}")
        assert j.stats()["total"]["traces"] == traces, f.__name__
        assert ("<grad mode>=True" in str(fgraph.explain(j))) is (traces == 2), f.__name__


def test_a_capture_under_no_grad_serves_calls_with_grad_on():
    """Grad mode keys only the traces that read it: serving with grad on what was captured under no_grad replays."""
    j = fgraph.jit(lambda x: torch.tanh(x) * 2, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    with torch.no_grad():
        j.capture(torch.ones(1, 4), progress=False)
    assert torch.equal(j(torch.ones(3, 4)), torch.tanh(torch.ones(3, 4)) * 2)
    assert not any(j.stats()["fallbacks"].values()) and j.stats()["total"]["replays"] == 1


@contextlib.contextmanager
def _setting(get, set_, value):
    """A torch global setting changed for the block (torch.set_default_dtype, set_float32_matmul_precision)."""
    prev = get()
    set_(value)
    try:
        yield
    finally:
        set_(prev)


@pytest.mark.parametrize("mode", MODES)
def test_python_scalars_are_part_of_the_signature_by_value_and_type(mode):
    """2, 2.0 and True are equal in Python but trace to int64, float32 and bool results; 0.0 and -0.0 are equal but
    1 / (x * s) is +inf or -inf. Each is its own signature, in the arguments as inside a batched argument."""
    j = fgraph.jit(lambda x, s: x * s, batch={"x": Batched()}, mode=mode, buckets=[4])
    k = fgraph.jit(lambda b: 1.0 / (b["x"] * b["s"]), batch={"b": {"x": Batched(), "s": None}}, mode=mode, buckets=[4])
    x = torch.arange(3)
    for s in [2, 2.0, True, 2, 2.0]:
        assert torch.equal(j(x, s), x * s) and j(x, s).dtype == (x * s).dtype, s
    for s in [0.0, -0.0, 0.0, -0.0]:
        assert torch.equal(k({"x": torch.ones(3), "s": s}), 1.0 / (torch.ones(3) * s)), s


def scaled(x, k):
    """x times a static: a number, or a tuple of them (its first item)."""
    return x * k[0] if isinstance(k, tuple) else 1.0 / (x * k) if k == 0 else x * k


@pytest.mark.parametrize("mode", MODES)
def test_static_arguments_are_keyed_by_type_and_value(mode, device):
    """As jax.jit keys statics: 1, True and 1.0 are equal in Python (and hash alike) but trace to int64, bool and
    float32 results, so each is its own signature. Finer than jax: 0.0 and -0.0 (1 / (x * k) is +inf or -inf), and
    the items of a tuple, (1, 2) and (True, 2). The replay path keys them so too (each value is called twice)."""
    j = fgraph.jit(scaled, static=["k"], batch={"x": Batched()}, mode=mode, buckets=[4])
    x = torch.arange(1, 4, device=device)
    values = [1, True, 1.0, 0.0, -0.0, (1, 2), (True, 2), (1.0, 2)]
    for k in values + values:
        got = j(x, k)
        with fgraph.disable_jit():
            want = j(x, k)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"k={k!r}")  # dtype included
    assert [dict(e.sig.statics)["k"] for e in j.entries.values()] == values  # the values as passed
    assert [type(dict(e.sig.statics)["k"]) for e in j.entries.values()] == [type(v) for v in values]
    assert len(j.stats()["signatures"]) == len(values)


# -- constants the function makes ------------------------------------------------------------------------------
def host_constants(x):
    """CPU 0-dim tensors made inside the function, as eager code makes them (CUDA ops take them)."""
    two, half = torch.tensor(2.0), torch.full((), 0.5) * torch.tensor(3)  # a CPU op on constants alone
    return torch.where(x > torch.tensor(0.0), x * two, x - half), x.to(torch.int64) + torch.tensor(True)


@pytest.mark.parametrize("mode", MODES)
def test_cpu_scalar_constants_made_inside_are_part_of_the_program(mode, device):
    """As jax.jit embeds constants: on CUDA the constants are made on the device inside the program, FULL graphs
    included, and the answers are eager's."""
    j = fgraph.jit(host_constants, batch={"x": Batched()}, mode=mode, buckets=[4])
    for k in range(3):
        x = rand(device, 3, 4, seed=k)
        got = j(x)
        with fgraph.disable_jit():
            want = j(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_cpu_scalar_constants_are_embedded_in_a_device_program(mode, monkeypatch):
    """The meta device stands in for CUDA (no values: shapes, dtypes and devices are eager's; the program makes each
    constant on the device). Other CPU tensors stay refused (tests/test_errors.py)."""
    monkeypatch.setattr(fgraph.config, "inputs_in_graph", False)  # (FULL graphs cannot copy meta memory in)
    j = fgraph.jit(host_constants, mode=mode)
    x = torch.ones(3, 4, device="meta")
    got = j(x)
    with fgraph.disable_jit():
        want = j(x)
    assert [(g.shape, g.dtype, g.device) for g in got] == [(w.shape, w.dtype, w.device) for w in want]
    text = j.lower(x).as_text()
    for made in ("[], 2.0, dtype = torch.float32", "[], 0.5, device", "[], 3, dtype = torch.int64", "[], True"):
        assert f"aten.full.default({made}" in text, made
    assert "device(type='meta')" in text and "get_attr" not in text and "_tensor_constant" not in text


# -- retraces are bounded and loud -----------------------------------------------------------------------------
def test_python_scalars_retrace_per_value_with_a_warning_and_a_cap(caplog, monkeypatch):
    monkeypatch.setattr(fgraph.config, "max_signatures", 12)
    j = fgraph.jit(lambda x, step: x * step, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    x = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for step in range(20):
            assert j(x, step).tolist() == [float(step)] * 3
    warned = [r.getMessage() for r in caplog.records if "Python scalars" in r.getMessage()]
    assert len(warned) == 1 and "step=8" in warned[0] and "Python scalars" in warned[0]
    assert len(j.entries) == 12 and j.stats()["fallbacks"]["cap"] == 8


# -- a cache per function (issue #32 item 10) --------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_jit_objects_of_one_function_and_options_trace_once(mode, device):
    """As jax.jit: a jit object made per call (`fgraph.jit(f)(x)` in a loop) traces and captures f once. Jit
    objects of one function object and equal options (a new, equal Batched each time) are views of one cache: the
    same entries and stats, counting every view's calls."""
    p = params(device)
    views, captures = [], []
    for k in range(3):
        views.append(fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4]))
        x = rand(device, 3, 4, seed=k)
        torch.testing.assert_close(views[-1](p, x), layer(p, x), rtol=0, atol=0)
        captures.append(views[-1].stats()["total"]["captures"])  # graphs captured: by the first call only
    total = views[0].stats()["total"]
    assert total["traces"] == 1 and total["calls"] == 3 and total["replays"] == (0 if mode == "NONE" else 3)
    assert captures == [{"NONE": 0, "FULL": 1}.get(mode, 2)] * 3  # (PIECEWISE: the two pieces around the break)
    assert all(v.stats() == views[0].stats() and v.cache is views[0].cache for v in views)


@pytest.mark.parametrize("mode", MODES)
def test_other_options_trace_apart(mode):
    """Other options (buckets, copy_outputs, a Batched pad, mode), another function: caches of their own; equal
    options, the same."""
    p, x = params("cpu"), rand("cpu", 3, 4)
    made = [
        fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4]),
        fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[8]),
        fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4], copy_outputs=False),
        fgraph.jit(layer, batch={"x": Batched(pad=1)}, mode=mode, buckets=[4]),
        fgraph.jit(layer, batch={"x": Batched()}, mode="NONE" if mode != "NONE" else "FULL", buckets=[4]),
        fgraph.jit(lambda p, x: layer(p, x), batch={"x": Batched()}, mode=mode, buckets=[4]),
    ]
    for j in made:
        torch.testing.assert_close(j(p, x), layer(p, x), rtol=0, atol=0)
    assert [j.stats()["total"]["traces"] for j in made] == [1] * len(made)
    assert len({id(j.cache) for j in made}) == len(made)
    assert fgraph.jit(layer, batch={"x": Batched()}, mode=mode, buckets=[4]).cache is made[0].cache


@pytest.mark.parametrize("mode", MODES)
def test_a_closure_made_again_is_a_new_function(mode):
    """A closure re-created per loop iteration is a new function object: it never shares a trace (the Python value
    it closes over, frozen into its trace, may differ), and each gives its own eager answer."""
    p, x = params("cpu"), rand("cpu", 3, 4)
    for scale in (1.0, 2.0, 3.0):

        def f(p, x):
            return layer(p, x) * scale

        for calls in (1, 2):  # this function object, jitted again: its trace
            j = fgraph.jit(f, batch={"x": Batched()}, mode=mode, buckets=[4])
            torch.testing.assert_close(j(p, x), f(p, x), rtol=0, atol=0)
            assert j.stats()["total"]["traces"] == 1 and j.stats()["total"]["calls"] == calls


@pytest.mark.parametrize("mode", MODES)
def test_the_shared_cache_goes_away_with_the_function(mode):
    """Held weakly: while the function lives, a new jit object finds its cache (no trace); once the function and
    its jit objects are gone, the cache and its graphs are freed."""

    def make():
        def f(p, x):
            return layer(p, x) + 1

        return f

    p, x = params("cpu"), rand("cpu", 3, 4)
    f = make()
    j = fgraph.jit(f, batch={"x": Batched()}, mode=mode, buckets=[4])
    j(p, x)
    state, entry = weakref.ref(j.state), weakref.ref(next(iter(j.entries.values())))
    del j
    gc.collect()
    j = fgraph.jit(f, batch={"x": Batched()}, mode=mode, buckets=[4])
    torch.testing.assert_close(j(p, x), f(p, x), rtol=0, atol=0)
    assert j.state is state() and j.stats()["total"]["traces"] == 1 and j.stats()["total"]["calls"] == 2
    fn = weakref.ref(f)
    del f, j
    gc.collect()
    assert fn() is None and state() is None and entry() is None


def test_modules_and_bound_methods_share_per_object():
    """An nn.Module is keyed by the module, a bound method (a new object per attribute access) by its function and
    its object: per object, one trace; another object, its own; each cache goes away with its object."""

    class Stepper:
        def __init__(self, seed):
            self.p = params("cpu", seed)

        def step(self, x):
            return layer(self.p, x)

    x = rand("cpu", 3, 4)
    for make, call, batch in [
        (lambda seed: torch.nn.Linear(4, 4), lambda obj: obj, {"input": Batched()}),
        (Stepper, lambda obj: obj.step, {"x": Batched()}),
    ]:
        a, b = make(0), make(1)
        with torch.no_grad():
            for obj in (a, b, a, b, a):
                j = fgraph.jit(call(obj), batch=batch, mode="FULL", buckets=[4])
                torch.testing.assert_close(j(x), call(obj)(x), rtol=0, atol=0)
        views = [fgraph.jit(call(obj), batch=batch, mode="FULL", buckets=[4]) for obj in (a, b)]
        assert [v.stats()["total"]["calls"] for v in views] == [3, 2]
        assert [v.stats()["total"]["traces"] for v in views] == [1, 1]
        state = weakref.ref(views[0].state)
        del a, obj, views, j
        gc.collect()
        assert state() is None


def test_reset_on_one_view_resets_the_shared_cache():
    p, x = params("cpu"), rand("cpu", 3, 4)
    a, b = (fgraph.jit(layer, batch={"x": Batched()}, mode="FULL", buckets=[4]) for _ in range(2))
    a.capture(p, x)
    assert b.sealed and len(b.entries) == 1
    b.reset()
    assert not a.sealed and not a.entries and a.stats()["total"]["traces"] == 0
    torch.testing.assert_close(a(p, x), layer(p, x), rtol=0, atol=0)
    assert b.stats()["total"]["traces"] == 1


def test_options_compare_by_value_with_their_types():
    """The options key: equal for equal options (fresh Batched specs, records of them), apart for values of other
    types (1 and True, a list and a tuple); None (no sharing) where a value is unhashable."""

    @attrs.define
    class Mutable:  # a mutable record: unhashable
        x: object = None

    key = lambda **given: _shared.options_key({"buckets": [4], "batch": None, **given})
    assert key(batch={"x": Batched(pad=0)}) == key(batch={"x": Batched(pad=0)}) is not None
    assert key(batch={"x": Batched(pad=0)}) != key(batch={"x": Batched(pad=0.5)})
    assert key(warmups=1) != key(warmups=True) and key(static=["a"]) != key(static=("a",))
    assert key(batch={"x": Mutable(Batched())}) is None and key(compile={"x": {1, 2}}) is None


# -- stats and explain -----------------------------------------------------------------------------------------
def test_stats_counts_every_signature():
    j = fgraph.jit(lambda x: x * 2, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    for dt in (torch.float32, torch.float64, torch.int64):
        j(torch.ones(3, dtype=dt))
    st = j.stats()
    assert len(st["signatures"]) == 3 and st["total"]["traces"] == 3
    assert "(bucket=4) {x: int64[4]@cpu}" in st["signatures"]


def test_explain_says_what_is_read_in_place_and_what_is_copied():
    j = fgraph.jit(layer, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    p, x = params("cpu"), rand("cpu", 3, 4)
    j(p, x)
    j({"w": p["w"], "b": p["b"].clone()}, x)  # a new b: read in place (captured again)
    j({"w": p["w"], "b": p["b"].clone()}, x)  # and another: copied into fgraph's buffer from now on
    text = str(fgraph.explain(j))
    assert "read: padded into input buffers: x; read in place: p['w']; copied: p['b']" in text


# -- random call sequences against eager -----------------------------------------------------------------------
ACTIONS = ["same", "new_x", "replace_b", "bump_b", "append_w", "new_params", "new_state", "dtype", "scale", "layout"]


def seq_step(p, state, x, scale):
    """A stack of layers over a list of weights, a break each, donated state written then read, a Python scalar."""
    h = x
    for w in p["ws"]:
        w = w.reshape(-1).view(w.shape)  # a view of a contiguous w, a copy of a transposed one: traced apart
        o = torch.empty_like(h)
        toys.toy_scale(o, h @ w, 0.5)
        h = torch.tanh(o)
    state["h"].copy_(p["b"] * 2)  # written before it is read: warm-up and capture runs leave it right
    state["acc"].mul_(0.5).add_(p["b"])  # read, then written: warm-up and capture runs must be put back
    return h * scale + state["h"], state


def _world(device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cpu").to(device, dtype)  # noqa: E731
    return {"ws": [r(4, 4)], "b": r(4)}, {"h": r(4), "acc": r(4)}, r


_SEQ_JITS: dict = {}


def _check_sequence(mode, device, actions):
    key = (mode, device)
    if key not in _SEQ_JITS:  # one jitted function per mode across examples: its caches carry over, as in a server
        _SEQ_JITS[key] = fgraph.jit(
            seq_step, donate=["state"], static=["scale"], batch={"x": Batched()}, mode=mode, buckets=[2, 4, 8]
        )
    j = _SEQ_JITS[key]
    dtype, seed = torch.float32, 0
    p, state, r = _world(device, dtype, seed)
    x, scale, kept = r(3, 4), 1.0, []
    for action, n in actions:

        def mk(*shape):
            return r(*shape).to(dtype)

        if action == "new_x":
            x = mk(n, 4)
        elif action == "replace_b":
            p["b"] = mk(4)
        elif action == "bump_b":
            p["b"].add_(1.0)
        elif action == "append_w" and len(p["ws"]) < 3:
            p["ws"].append(mk(4, 4))
        elif action == "new_params":
            p = {"ws": [w.clone() for w in p["ws"]], "b": p["b"].clone() + 1}
        elif action == "new_state":
            state = {"h": mk(4), "acc": mk(4)}
        elif action == "dtype":
            dtype = torch.float64 if dtype is torch.float32 else torch.float32
            p = {"ws": [w.to(dtype) for w in p["ws"]], "b": p["b"].to(dtype)}
            state, x = {k: v.to(dtype) for k, v in state.items()}, x.to(dtype)
        elif action == "scale":
            scale = float(n)
        elif action == "layout":  # the same values, the other memory layout
            p["ws"] = [w.contiguous() if not w.is_contiguous() else w.T.contiguous().T for w in p["ws"]]
        ref_p = {"ws": [w.clone() for w in p["ws"]], "b": p["b"].clone()}
        ref_out, ref_state = seq_step(ref_p, {k: v.clone() for k, v in state.items()}, x.clone(), scale)
        out, back = j(p, state, x, scale=scale)
        assert back is state
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.testing.assert_close(state["h"], ref_state["h"], rtol=0, atol=0)
        # read, then written: exact on every call, also those that captured (their runs are put back)
        torch.testing.assert_close(state["acc"], ref_state["acc"], rtol=0, atol=0)
        kept.append((out, out.clone()))
    for out, copy in kept:  # outputs kept across calls were never written over
        assert torch.equal(out, copy)


def test_random_call_sequences_equal_eager(device):
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        st.sampled_from(MODES),
        st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(1, 8)), min_size=1, max_size=10),
    )
    def run(mode, actions):
        _check_sequence(mode, device, actions)

    run()


@dataclasses.dataclass
class Mixed:
    y: torch.Tensor
    ids: torch.Tensor
    half: float


def mixed(p, b, s):
    """A record out; a Python scalar whose type and sign matter (int ids * 2.0 is float; 1 / -0.0 is -inf); a
    tensor without the batch axis inside the batched argument; sizes as a float and a bool."""
    x = b["x"]
    y = x @ p["w"] + b["bias"] + 1 / (x[:, :1] * 0 + s)
    return Mixed(y, b["ids"] * s, x.shape[0] / 2), x.shape[0] > 2


_MIXED: dict = {}


def test_random_calls_of_records_scalars_and_loose_tensors_equal_eager():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        st.sampled_from(MODES),
        st.lists(
            st.tuples(st.integers(0, 9), st.sampled_from([2, 2.0, True, 0.5, 0.0, -0.0]), st.sampled_from("sni")),
            min_size=1,
            max_size=8,
        ),
    )
    def run(mode, calls):
        if mode not in _MIXED:  # one jitted function per mode across examples: its caches carry over
            batch = {"b": {"x": Batched(), "ids": Batched(), "bias": None}}
            _MIXED[mode] = fgraph.jit(mixed, batch=batch, mode=mode, buckets=[2, 4, 8])
        j, g = _MIXED[mode], torch.Generator().manual_seed(len(calls))
        p, bias = {"w": torch.randn(4, 4, generator=g)}, torch.randn(4, generator=g)
        for n, s, how in calls:  # the bias tensor: the same, a new one, or the same updated in place
            bias = torch.randn(4, generator=g) if how == "n" else bias.add_(1) if how == "i" else bias
            b = {"x": torch.randn(n, 4, generator=g), "ids": torch.arange(n), "bias": bias}
            (got, big), (want, want_big) = j(p, b, s), mixed(p, b, s)
            assert type(got) is Mixed and big == want_big and got.half == want.half, (n, s)
            assert got.y.dtype == want.y.dtype and torch.equal(got.y, want.y), (n, s, how)
            assert got.ids.dtype == want.ids.dtype and torch.equal(got.ids, want.ids), (n, s)

    run()


# -- wrappers of jitted functions (issue #32, 1): a function that wraps a jitted one runs the wrapper, not the inner
# jitted function. Eager's answer under fgraph.disable_jit() is the oracle.

SCALE = torch.tensor(2.0)  # a global tensor the inner functions read: lifted through every wrapper


def squared(x):
    return x * x * SCALE


def eager(f, *args):
    with fgraph.disable_jit():
        return f(*args)


def twice_of(inner):
    @functools.wraps(inner)
    def twice(x):
        return inner(x) * 2

    return twice


class Scaler:
    def __init__(self):
        self.w = torch.tensor(3.0)

    @fgraph.jit
    def jitted(self, x):
        return x * self.w

    def plain(self, x):
        return self.jitted(x) + 1


WRAPPERS = {
    "torch.func.grad": lambda jf: torch.func.grad(jf),
    "torch.func.vmap": lambda jf: torch.func.vmap(jf),
    "grad of vmap": lambda jf: torch.func.grad(lambda x: torch.func.vmap(jf)(x).sum()),
    "functools.wraps": twice_of,
    "a __wrapped__ chain": lambda jf: twice_of(twice_of(jf)),
    "jit of jit": lambda jf: fgraph.jit(jf),
    "functools.partial": lambda jf: functools.partial(lambda f, x: f(x) - 1, jf),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_jitted_wrapper_of_a_jitted_function_gives_the_wrappers_answer(mode, wrapper):
    """functools.update_wrapper copies the wrapped object's __dict__: a jitted function's own fields (fn, options,
    cache) must not become the wrapper's, and what the inner function reads is read through the wrapper."""
    x = torch.tensor([3.0]) if "vmap" in wrapper else torch.tensor(3.0)
    outer = WRAPPERS[wrapper](fgraph.jit(squared, mode=mode))
    want = eager(outer, x)
    assert torch.allclose(fgraph.jit(outer, mode=mode)(x), want)
    assert torch.allclose(fgraph.jit(outer, mode=mode)(x), eager(WRAPPERS[wrapper](squared), x))


@pytest.mark.parametrize("mode", MODES)
def test_a_user_attribute_on_the_function_is_not_a_jit_field(mode):
    def double(x):
        return x * 2

    double.fn = lambda x: x  # a user's own attribute, named like a Jitted field
    jf = fgraph.jit(double, mode=mode)
    assert jf(torch.tensor(3.0)).item() == 6.0
    assert fgraph.jit(twice_of(jf), mode=mode)(torch.tensor(3.0)).item() == 12.0


@pytest.mark.parametrize("mode", MODES)
def test_jitted_methods_jitted_again_read_their_instance(mode):
    s, x = Scaler(), torch.tensor(2.0)
    assert fgraph.jit(s.jitted, mode=mode)(x).item() == eager(s.jitted, x).item() == 6.0
    assert fgraph.jit(s.plain, mode=mode)(x).item() == eager(s.plain, x).item() == 7.0
    s.w = torch.tensor(5.0)  # a new tensor in the instance: read per call, through the inner jitted method
    assert fgraph.jit(s.plain, mode=mode)(x).item() == 11.0


# -- values that escape a trace (issue #32, 2): a value made while tracing is a fake tensor (no data). Stored outside
# the function, it is an EscapeError at the end of the trace that let it out (the signature is dropped: the next
# call tries again), and at the first jitted call that reads it; jax.jit's UnexpectedTracerError.

_SAVED: dict = {}


def save_global(x):
    _SAVED["t"] = x * 3
    return x * 2


class Recorder:
    """A plain object passed as an argument (a leaf: the caller's own object reaches the function)."""

    def __init__(self):
        self.last = None


class Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.kept = []

    def emit(self, record):
        self.kept.append(record)  # the record, with its args: no formatting


_ESC_LOG = logging.getLogger("tests.escapes")


def escape_routes():
    """name -> (make() -> (function to jit, args), where the error names the value)."""

    def global_dict():
        _SAVED.clear()
        return save_global, (torch.ones(2),)

    def cell():
        box = None

        def f(x):
            nonlocal box
            box = x * 3
            return x * 2

        return f, (torch.ones(2),)

    def attribute_of_an_argument():
        def f(x, rec):
            rec.last = x * 3
            return x * 2

        return f, (torch.ones(2), Recorder())

    def module_attribute():
        class Acts(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin, self.acts = torch.nn.Linear(2, 2), []

            def forward(self, x):
                h = self.lin(x)
                self.acts.append(h)
                return h * 2

        return Acts(), (torch.ones(1, 2),)

    def forward_hook():
        m, acts = torch.nn.Sequential(torch.nn.Linear(2, 2)), []
        m[0].register_forward_hook(lambda mod, args, out: acts.append(out))
        return m, (torch.ones(1, 2),)

    def logger():  # a handler that keeps its records (logging.handlers.MemoryHandler does too), nothing else
        _ESC_LOG.handlers, _ESC_LOG.propagate = [Keep()], False
        _ESC_LOG.setLevel(logging.DEBUG)

        def f(x):
            y = x * 3
            _ESC_LOG.debug("y is %s", y)
            return y * 2

        return f, (torch.ones(2),)

    return {
        "a dict in a global": (global_dict, r"into _SAVED\['t'\];"),
        "a closure cell": (cell, r"into box;"),
        "an attribute of an argument": (attribute_of_an_argument, r"into rec\.last;"),
        "a module attribute": (module_attribute, r"into self\.acts\[\d\];"),
        "a forward hook": (forward_hook, r"into acts\[\d\] \(reached through a forward hook of self\.0\)"),
        "a logger": (logger, r"into _ESC_LOG\.handlers\[0\]\.kept\[\d\]\.args\[0\]"),
    }


ROUTES = escape_routes()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_value_that_escapes_the_trace_is_an_error_naming_where_it_went(mode, route):
    make, where = ROUTES[route]
    fn, args = make()
    j = fgraph.jit(fn, mode=mode)
    for _ in range(2):  # nothing half made stays: the next call traces again, and fails the same way
        with pytest.raises(fgraph.EscapeError, match=where + r".*fake tensor \(shape \[(1, )?2\], float32, no data\)"):
            j(*args)
        assert not j.entries
    with fgraph.disable_jit():  # eager stores real values, as it should
        assert not isinstance(fn(*args), torch._subclasses.FakeTensor)


@pytest.mark.parametrize("mode", MODES)
def test_the_escape_error_names_the_line_that_made_the_value_and_the_fix(mode):
    _SAVED.clear()
    with pytest.raises(fgraph.EscapeError) as e:
        fgraph.jit(save_global, mode=mode)(torch.ones(2))
    line = save_global.__code__.co_firstlineno + 1
    assert f"made while tracing at tests/test_semantics.py:{line} escaped the trace into _SAVED['t']" in str(e.value)
    assert "Fix: return the value from the jitted function instead" in str(e.value)
    assert isinstance(e.value, fgraph.TraceError) and str(e.value).endswith("docs/errors.md#escapeerror")


@pytest.mark.parametrize("mode", MODES)
def test_the_first_use_of_an_escaped_value_is_an_escape_error(mode):
    """Another jitted function that reads an escaped value (lifted from a global, passed as an argument, on the
    replay path too) says so; it is not a capture failure 'the eager function fails the same way'."""
    _SAVED.clear()
    with pytest.raises(fgraph.EscapeError):
        fgraph.jit(save_global, mode=mode)(torch.ones(2))
    fake = _SAVED["t"]
    assert isinstance(fake, torch._subclasses.FakeTensor)
    with pytest.raises(fgraph.EscapeError, match=r"_SAVED\['t'\] is a fake tensor .*escaped an earlier trace"):
        fgraph.jit(lambda x: x + _SAVED["t"], mode=mode)(torch.ones(2))
    box = (fake,)  # a tuple: not lifted, read while tracing
    with pytest.raises(fgraph.EscapeError, match=r"is a fake tensor \(no data\): a value that escaped"):
        fgraph.jit(lambda x: x + box[0], mode=mode)(torch.ones(2))
    add = fgraph.jit(lambda x, y: x + y, batch={"x": Batched(), "y": Batched()}, mode=mode, buckets=[4])
    add(torch.ones(2), torch.ones(2)), add(torch.ones(2), torch.ones(2))  # the replay path knows this layout
    with pytest.raises(fgraph.EscapeError, match=r"y is a fake tensor"):
        add(torch.ones(2), fake)
    _SAVED.clear()


@pytest.mark.parametrize("mode", MODES)
def test_a_function_that_keeps_what_is_not_traced_pays_nothing(mode):
    """Python values, shapes and real tensors stored outside are not escapes; a container argument stored into is
    the trace's own copy (tests/test_footguns.py), not an escape either."""
    shapes, m = [], torch.nn.Sequential(torch.nn.Linear(2, 2))
    m[0].register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    keep = {"w": torch.ones(2)}

    def f(x, state):
        keep["n"] = x.shape[0]
        state["h"] = state["h"] + 1
        return m(x) * keep["w"], state

    j, state = fgraph.jit(f, mode=mode), {"h": torch.zeros(2)}
    got, _ = j(torch.ones(1, 2), state)
    with torch.no_grad():
        assert torch.equal(got, eager(f, torch.ones(1, 2), {"h": torch.zeros(2)})[0])
    assert shapes[0] == (1, 2) and keep["n"] == 1 and state["h"].tolist() == [0.0, 0.0]
