"""jax.jit's contract, as specs against eager: a jitted function gives the answer the plain function would, for any
inputs of the same kind, in every mode, whatever the caller did between calls (issue #20, dispatch half).

Inputs are values: a non-static tensor may be a new tensor on any call (read in place when it is the captured one,
else copied, counted in stats()). Nothing is stale: a leaf replaced inside a container, a longer list, a changed
static field are seen. Threads get their own results. A failed or interrupted capture leaves nothing behind.
Outputs are copies by default. Retraces are bounded and loud. stats() counts every signature.
"""

import logging
import threading

import attrs
import pytest
import torch

import fgraph
from fgraph import Batched
from fgraph.capture import _entry as E
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
    from fgraph.function import guard_for

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
