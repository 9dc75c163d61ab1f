"""Python values a trace reads from outside the arguments (a global, a closure cell, a module's attribute, a config
dict's entry, an enum) are guarded, as torch.compile guards them: after one changes, the jitted function gives the
plain function's answer (a new signature, traced again), in every mode, and the cache miss names the value."""

import enum
import logging
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched

pytestmark = pytest.mark.usefixtures("each_device")  # the CPU, and CUDA on the GPU

MODES = ["NONE", "PIECEWISE", "FULL"]
SCALE = 2.0
CFG = {"act": "tanh", "temperature": 1.0}


class Act(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


ACT = Act.TANH


def scaled(x):
    return x * SCALE


def configured(x):
    y = torch.tanh(x) if CFG["act"] == "tanh" else torch.relu(x)
    return y / CFG["temperature"]


def by_enum(x):
    return torch.tanh(x) if ACT is Act.TANH else torch.relu(x)


class Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.temp, self.use_bias = 2.0, False

    def forward(self, x):
        y = x * self.w / self.temp
        return y + 1 if self.use_bias else y


def jit(fn, mode):
    return fgraph.jit(fn, batch={"x": Batched()}, buckets=[4], mode=mode)


def same(f, g, x):
    x = x.to(torch.get_default_device())  # (each_device: the CPU, or CUDA)
    with torch.no_grad():
        torch.testing.assert_close(f(x), g(x), rtol=0, atol=0)


X = torch.tensor([[-1.0, 0.5, 2.0], [0.25, -3.0, 1.0]])


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_global_is_seen(mode):
    global SCALE
    f = jit(scaled, mode)
    try:
        for SCALE in (2.0, 2.0, 3.0, 3, 2.0):  # noqa: B007 (3, an int, apart from 3.0: another trace)
            same(f, scaled, X)
    finally:
        SCALE = 2.0
    assert len(f.entries) == 3


def test_a_global_rebound_to_an_equal_value_stays_on_the_replay_path():
    """The replay path proves a guarded value by identity with the object the trace read, and by type and value when
    that fails: an equal float made anew (`float("2.0")`) is the same signature, served without the slow path."""
    global SCALE
    f = jit(scaled, "FULL")
    try:
        same(f, scaled, X)
        same(f, scaled, X)
        fast, before = f.stats()["total"]["fast"], SCALE
        SCALE = float("2.0")
        assert SCALE is not before
        same(f, scaled, X)
        same(f, scaled, X)
        assert f.stats()["total"]["fast"] == fast + 2 and len(f.entries) == 1
    finally:
        SCALE = 2.0


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_closure_cell_is_seen(mode):
    scale = 2.0

    def g(x):
        return x * scale

    f = jit(g, mode)
    for scale in (2.0, 5.0, 5.0, -1.0):  # noqa: B007 (the cell g reads)
        same(f, g, X)


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_config_entry_is_seen(mode):
    f = jit(configured, mode)
    try:
        for act, t in [("tanh", 1.0), ("relu", 1.0), ("relu", 0.5), ("tanh", 1.0)]:
            CFG.update(act=act, temperature=t)
            same(f, configured, X)
    finally:
        CFG.update(act="tanh", temperature=1.0)


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_enum_is_seen(mode):
    global ACT
    f = jit(by_enum, mode)
    try:
        for ACT in (Act.TANH, Act.RELU, Act.TANH):  # noqa: B007 (the global by_enum reads)
            same(f, by_enum, X)
    finally:
        ACT = Act.TANH


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_module_attribute_is_seen(mode):
    m = Tempered()
    f = fgraph.jit(m, batch={"x": Batched()}, buckets=[4], mode=mode)
    for temp, bias in [(2.0, False), (2.0, False), (4.0, False), (4.0, True)]:
        m.temp, m.use_bias = temp, bias
        same(f, m, X)


def test_the_cache_miss_names_the_changed_value(caplog):
    global SCALE
    f = jit(scaled, "NONE")
    f(X)
    fgraph.config.explain_cache_misses = True
    try:
        SCALE = 7.0
        with caplog.at_level(logging.WARNING, logger="fgraph"):
            f(X)
    finally:
        SCALE, fgraph.config.explain_cache_misses = 2.0, False
    assert "SCALE" in caplog.text and "7.0" in caplog.text, caplog.text
    assert "guarded: SCALE=2.0" in str(fgraph.explain(f))  # each signature lists what its trace baked in


def test_a_function_reading_no_python_value_guards_nothing():
    f = jit(lambda x: x * 2.0, "NONE")
    f(X)
    assert not f.lifted.guards


NAMES = ["A", "B", "C", "D"]
A, B, C, D = 1.0, 2.0, 3, True


def program(x):
    y = x * A + B
    y = y - C if D else y * C
    return torch.tanh(y) if A > B else y


@settings(max_examples=20, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["A", "B", "C"]), st.sampled_from([0.5, 1.0, 2.0, 3, -1])),
            st.tuples(st.just("D"), st.booleans()),
        ),
        max_size=8,
    )
)
def test_random_mutations_of_globals_between_calls_give_eagers_answers(changes):
    """A program reading four globals, mutated at random between calls of one jitted function: every call equals the
    plain function (fails when the guards are removed: a changed global replays the old trace)."""
    saved = {k: globals()[k] for k in NAMES}
    f = jit(program, "PIECEWISE")
    try:
        same(f, program, X)
        for name, value in changes:
            globals()[name] = value
            same(f, program, X)
            same(f, program, X)  # (the replay path too)
    finally:
        globals().update(saved)


BIG = {f"k{i}": float(i) for i in range(100)}


def reads_big(x):
    return x * BIG["k3"]


def test_a_container_too_large_to_guard_is_said_once_listed_by_explain_and_refused_under_strict(caplog):
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f = jit(reads_big, "NONE")
        f(X)
        f(X)
    assert caplog.text.count("`BIG` holds too many Python values") == 1
    assert "not guarded: BIG" in str(fgraph.explain(f))
    with pytest.raises(fgraph.TraceError, match="strict=True.*BIG"):
        fgraph.jit(reads_big, batch={"x": Batched()}, buckets=[4], strict=True)(X)


REBOUND_WS = [torch.ones(2)]
REBOUND_CFG = {"s": 2.0}


def reads_rebindable(x):
    return x * REBOUND_WS[0] * REBOUND_CFG["s"]


@pytest.mark.parametrize("mode", MODES)
def test_a_global_container_rebound_to_a_new_one_is_read_anew(mode):
    """A global list or dict rebound to a new one after calls: the tensors and guarded values are read from the new
    containers (the replay path's proof holds each container where it was found), as eager reads them."""
    global REBOUND_WS, REBOUND_CFG
    REBOUND_WS, REBOUND_CFG = [torch.ones(2)], {"s": 2.0}
    j, x = fgraph.jit(reads_rebindable, mode=mode), torch.ones(2)
    j(x), j(x)
    try:
        REBOUND_WS = [torch.full((2,), 5.0)]
        assert j(x).tolist() == reads_rebindable(x).tolist() == [10.0, 10.0]
        REBOUND_CFG = {"s": 3.0}
        assert j(x).tolist() == j(x).tolist() == [15.0, 15.0]
    finally:
        REBOUND_WS, REBOUND_CFG = [torch.ones(2)], {"s": 2.0}


@pytest.mark.parametrize("mode", MODES)
def test_a_closure_cell_rebound_to_a_new_list_is_read_anew(mode):
    ws = [torch.ones(2)]

    def f(x):
        return x * ws[0]

    j, x = fgraph.jit(f, mode=mode), torch.ones(2)
    j(x), j(x)
    ws = [torch.full((2,), 4.0)]  # noqa: F841 (read by f through its cell)
    assert j(x).tolist() == j(x).tolist() == [4.0, 4.0]


@pytest.mark.parametrize("mode", MODES)
def test_a_partials_keywords_are_read_as_they_are_at_each_call(mode):
    import functools

    def f(x, w, s=1.0):
        return x * w * s

    p = functools.partial(f, w=torch.full((2,), 2.0), s=2.0)
    j, x = fgraph.jit(p, mode=mode), torch.ones(2)
    assert j(x).tolist() == [4.0, 4.0]
    p.keywords["w"] = torch.full((2,), 5.0)
    assert j(x).tolist() == p(x).tolist() == [10.0, 10.0]
    p.keywords["s"] = 3.0
    assert j(x).tolist() == j(x).tolist() == [15.0, 15.0]


class Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.lin(x))


class Scaled(torch.nn.Module):
    scale = 2.0  # a class attribute: an instance may set its own later

    def __init__(self):
        super().__init__()
        self.lin, self.perm = torch.nn.Linear(4, 4), [3, 2, 1, 0]

    def forward(self, x):
        return self.lin(x)[:, self.perm] * self.scale

    @fgraph.jit
    def step(self, x):  # a jitted method reads what it names, whatever forward names
        return self.lin(x) * self.offset


class Child(Scaled):
    def forward(self, x):  # the base's forward reads `scale`
        return super().forward(x) + 1


@pytest.mark.parametrize("mode", MODES)
def test_module_attributes_are_guarded_wherever_the_code_that_reads_them_is(mode):
    """A submodule replaced by one with other values (LayerNorm's eps), a class attribute an instance overrides, a
    base class's forward (super().forward), a jitted method's own names, a list attribute changed in place or
    rebound: each read anew, as eager reads it."""
    x = torch.randn(2, 4)
    with torch.no_grad():
        m = Normed()
        f = fgraph.jit(m, mode=mode)
        f(x), f(x)
        m.norm = torch.nn.LayerNorm(4, eps=10.0)
        assert torch.equal(f(x), m(x))
        for cls in (Scaled, Child):
            m = cls()
            f = fgraph.jit(m, mode=mode)
            f(x), f(x)
            m.scale = 5.0
            assert torch.equal(f(x), m(x))
            m.perm[0], m.perm[3] = 0, 3
            assert torch.equal(f(x), m(x))
            m.perm = [1, 0, 2, 3]
            assert torch.equal(f(x), m(x)) and torch.equal(f(x), m(x))
        m = Scaled()
        m.offset = 2.0
        m.step(x), m.step(x)
        m.offset = 3.0
        with fgraph.disable_jit():
            want = m.step(x)
        assert torch.equal(m.step(x), want)


def test_class_attributes_of_a_plain_object_and_classmethods_are_guarded():
    """A jitted method of a plain object (not a module) reads a class attribute: a change to the class's, or an
    instance's own set later, is another signature, as a module's are. A classmethod's class, and an object that
    holds its own bound method (`self.cb = self.g`), are scanned once (no endless walk)."""
    x = torch.ones(3, 2)

    class Plain:
        scale = 2.0

        @fgraph.jit(batch={"x": Batched()})
        def f(self, x):
            return x * self.scale

    p = Plain()
    assert torch.equal(p.f(x), x * 2)
    Plain.scale = 5.0
    assert torch.equal(p.f(x), x * 5)
    p.scale = 7.0
    assert torch.equal(p.f(x), x * 7)

    class WithClassmethod:
        scale = 2.0

        @classmethod
        def c(cls, x):
            return x * cls.scale

    c = fgraph.jit(WithClassmethod.c, batch={"x": Batched()})
    assert torch.equal(c(x), x * 2)
    WithClassmethod.scale = 5.0
    assert torch.equal(c(x), x * 5)

    class Callback:
        def __init__(self):
            self.cb, self.k = self.g, 3.0

        def g(self, x):
            return x * self.k

        def f(self, x):
            return self.cb(x)

    a = Callback()
    f = fgraph.jit(a.f, batch={"x": Batched()})
    assert torch.equal(f(x), x * 3)
    a.k = 4.0
    assert torch.equal(f(x), x * 4)


OPS = {"act": lambda x: x * 2}
LST = [1.0, 2.0]
OPTIONS = frozenset({"double"})


def _times_two(x):
    return x * 2


helper = _times_two


@pytest.mark.parametrize("mode", MODES)
def test_a_rebound_helper_function_and_a_resized_container_are_seen(mode):
    """A global function rebound to another (`helper = other`, `OPS["act"] = lambda ...`) is guarded by identity;
    a global list or dict is guarded by its length too, so an item appended, popped or added is another signature
    (a list shorter than when traced is read without an internal error)."""
    global helper
    calls = [lambda x: helper(x), lambda x: OPS["act"](x), lambda x: x * sum(LST)]
    jitted = [jit(g, mode) for g in calls]
    try:
        for f, g in zip(jitted, calls):
            same(f, g, X)
        helper, OPS["act"] = (lambda x: x * 3), (lambda x: x * 5)
        LST.append(3.0)
        for f, g in zip(jitted, calls):
            same(f, g, X)
        LST[:] = [1.0]
        same(jitted[2], calls[2], X)
    finally:
        helper, OPS["act"], LST[:] = _times_two, (lambda x: x * 2), [1.0, 2.0]


def test_a_value_no_guard_compares_is_listed_by_explain_and_refused_under_strict():
    def by_option(x):
        return x * (2.0 if "double" in OPTIONS else 3.0)

    f = jit(by_option, "PIECEWISE")
    same(f, by_option, X)
    assert "not guarded: OPTIONS" in str(fgraph.explain(f))
    strict = fgraph.jit(by_option, batch={"x": Batched()}, buckets=[4], strict=True)
    with pytest.raises(fgraph.TraceError, match="OPTIONS"):
        strict(X)


SETTINGS = types.ModuleType(
    "settings"
)  # the user's own module, as `import settings` gives (a file outside installed packages)
SETTINGS.SCALE = 2.0


@pytest.mark.parametrize("mode", MODES)
def test_an_attribute_of_the_users_own_module_is_guarded(mode):
    """`settings.SCALE` read from the user's module `settings` is guarded as a global is: changed, it is another
    signature. (Modules of torch and installed packages are not scanned: their attributes are code, not settings.)"""

    def scaled_by_module(x):
        return x * SETTINGS.SCALE

    f = jit(scaled_by_module, mode)
    same(f, scaled_by_module, X)
    SETTINGS.SCALE = 3.0
    try:
        same(f, scaled_by_module, X)
    finally:
        SETTINGS.SCALE = 2.0
