"""jax.jit's contract, continued (tests/test_semantics.py has inputs, staleness, threads and failures): outputs are
values safe to keep, constants the function makes are part of the program, retraces are bounded and loud, one cache
serves every jit object of a function and its options, and stats and explain count what happened."""

import collections
import contextlib
import dataclasses
import gc
import logging
import weakref

import attrs
import pytest
import torch

import fgraph
from fgraph import Batched
from fgraph.function import _shared
from tests.test_semantics import MODES, device, layer, params, rand  # noqa: F401 (helpers and fixtures of test_semantics.py)


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


def host_arrays(x):
    """[n, 4] -> [n, 4], [n, 2]: CPU tensors of any size the source fixes, moved to x's device as eager code moves
    them (a copy per eager call), and a host index a CUDA op takes as it is."""
    scale = torch.tensor([1.0, 2.0, 3.0, 4.0]) * torch.tensor([[0.5], [2.0]])[1]  # a host op on constants alone
    cols = torch.arange(4).flip(0)[:2]  # a host factory and ops on it
    return x * scale.to(x.device) + torch.linspace(0, 1, 4).to(x.device), x[:, cols]


@pytest.mark.parametrize("fn", [host_constants, host_arrays])
@pytest.mark.parametrize("mode", MODES)
def test_cpu_constants_made_inside_are_part_of_the_program(mode, fn, device):
    """As jax.jit embeds constants: on CUDA the constants are made on the device inside the program, FULL graphs
    included, and the answers are eager's."""
    j = fgraph.jit(fn, batch={"x": Batched()}, mode=mode, buckets=[4])
    for k in range(3):
        x = rand(device, 3, 4, seed=k)
        got = j(x)
        with fgraph.disable_jit():
            want = j(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert j.stats()["total"]["traces"] == 1


def on_meta(fn, mode, monkeypatch):
    """fn jitted and called on a meta [3, 4] (shapes, dtypes and devices checked against eager's); its lowering."""
    monkeypatch.setattr(fgraph.config, "inputs_in_graph", False)  # (FULL graphs cannot copy meta memory in)
    j = fgraph.jit(fn, mode=mode)
    x = torch.ones(3, 4, device="meta")
    got = j(x)
    with fgraph.disable_jit():
        want = j(x)
    assert [(g.shape, g.dtype, g.device) for g in got] == [(w.shape, w.dtype, w.device) for w in want]
    return j.lower(x)


@pytest.mark.parametrize("mode", MODES)
def test_cpu_scalar_constants_are_embedded_in_a_device_program(mode, monkeypatch):
    """The meta device stands in for CUDA (no values: shapes, dtypes and devices are eager's; the program makes each
    constant on the device). Other CPU tensors stay refused (tests/test_errors.py)."""
    text = on_meta(host_constants, mode, monkeypatch).as_text()
    for made in ("[], 2.0, dtype = torch.float32", "[], 0.5, device", "[], 3, dtype = torch.int64", "[], True"):
        assert f"aten.full.default({made}" in text, made
    assert "device(type='meta')" in text and "get_attr" not in text and "_tensor_constant" not in text


@pytest.mark.parametrize("mode", MODES)
def test_cpu_constants_of_any_size_are_embedded_in_a_device_program(mode, monkeypatch):
    """The same for tensors of any size: each constant's values are moved to the device once, at trace time, and
    factories and ops on constants alone run there, so no host tensor is left in the program."""
    lowered = on_meta(host_arrays, mode, monkeypatch)
    gm = lowered.graph_module
    consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    assert consts and all(c.device.type == "meta" for c in consts if isinstance(c, torch.Tensor))
    assert "device(type='cpu')" not in lowered.as_text()


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


def test_declared_buckets_met_by_calls_are_neither_warned_nor_capped(caplog, monkeypatch):
    """Calls padded to ten declared buckets make ten signatures of one family (one trace, two with bucket 1's):
    the buckets bound them, so they count as one signature against the warning and the cap, and none runs eagerly."""
    monkeypatch.setattr(fgraph.config, "max_signatures", 2)
    buckets = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56]
    j = fgraph.jit(lambda x: x * 2, batch={"x": Batched()}, mode="PIECEWISE", buckets=buckets)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for below in [0, *buckets[:-1]]:  # a size past the bucket below: padded to the next
            x = torch.arange(float(below + 1))
            assert torch.equal(j(x), x * 2)
    assert not [r for r in caplog.records if "signatures made by calls" in r.getMessage()]
    assert len(j.entries) == len(buckets) and not any(j.stats()["fallbacks"].values())
    j(torch.ones(3, 2))  # another family (a new unbatched size): the second signature counted, at the cap
    assert j(torch.ones(3, 3)).shape == (3, 3) and j.stats()["fallbacks"]["cap"] == 1


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


@pytest.mark.parametrize("mode", ["NONE", "FULL"])
def test_a_nan_scalar_is_one_signature_however_often_it_is_passed(mode):
    """nan != nan, and a float's hash is its id when it is a nan: each new nan object must not be a new signature
    (64 of them, and the function would run eagerly from then on)."""
    f = fgraph.jit(lambda x, s: x * s, mode=mode)
    for _ in range(5):
        assert f(torch.ones(2), float("nan")).isnan().all()
    assert len(f.entries) == 1 and f.stats()["total"]["traces"] == 1
    assert f(torch.ones(2), 2.0).tolist() == [2.0, 2.0] and len(f.entries) == 2
