"""jax.jit's contract under random call sequences against eager (hypothesis), for functions that wrap jitted ones,
and for values that escape a trace (tests/test_semantics.py has the rest of the contract)."""

import dataclasses
import functools
import logging

import pytest
import torch

import fgraph
from fgraph import Batched
from tests import toys
from tests.test_semantics import MODES, device  # noqa: F401 (helpers and fixtures of test_semantics.py)

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
    fake = r".*fake tensor \(shape \[(1, )?2\], float32, no data\)"
    with pytest.raises(fgraph.EscapeError, match=where + fake):
        j(*args)
    assert not j.entries
    # nothing half made stays: the next call fails too, naming the same place (a global container the trace stored
    # into grew, so it is scanned again, and the scan finds the escaped value there first)
    place = where.removeprefix("into ").split(";")[0].split(r" \(")[0]
    with pytest.raises(fgraph.EscapeError, match=place + fake):
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
    assert f"made while tracing at tests/test_semantics_sequences.py:{line} escaped the trace into _SAVED['t']" in str(
        e.value
    )
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
