"""jit's options and Batched specs are checked where they are declared: a bad one is a SignatureError naming the
option and what it takes (a misspelt option fails the decorator itself), never a TypeError from inside a first call."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched, SignatureError
from tests import toys


def test_static_name_that_is_not_a_parameter():
    with pytest.raises(SignatureError, match=r"static= names 'rotuine', which is not a parameter of step"):
        fgraph.jit(toys.step, static=["rotuine"])


def test_unknown_mode():
    with pytest.raises(SignatureError, match=r"unknown mode 'fast'\nFix: use one of \['NONE', 'PIECEWISE'"):
        fgraph.jit(toys.step, mode="fast")


def test_unknown_break_name():
    with pytest.raises(SignatureError, match=r"breaks= names unknown primitives \['atention'\]"):
        fgraph.jit(toys.step, breaks=["atention"])


def test_an_argument_cannot_be_both_static_and_donated():
    with pytest.raises(SignatureError, match=r"fgraph.jit\(step\): 'state' is named in both static= and donate="):
        fgraph.jit(toys.step, static=["routine", "state"], donate=["state"])


BAD_OPTIONS = [  # fgraph.jit(toys.step, **options) -> what its SignatureError says
    ({"static": 3}, r"static=3 is neither a name nor a list of names\nFix: pass static=\['name', ...\]"),
    ({"donate_argnames": 3}, r"donate_argnames=3 is neither a name nor a list of names"),
    ({"scratch": 3}, r"scratch=3 is neither a name nor a list of names"),
    ({"breaks": 3}, r"breaks=3 is neither a name nor a list of names"),
    (
        {"batch": ["batch"]},
        r"batch=\['batch'\] is not a dict of argument names\nFix: pass batch=\{\"x\": fgraph.Batched",
    ),
    ({"batch": Batched()}, r"batch=Batched\(axis=0.*\) is not a dict of argument names"),
    ({"batch": {"batch": 3}}, r"batch=\{'batch': 3\}: 3 is neither a Batched nor None"),
    ({"batch": {"batch": {"x": "rows"}}}, r"batch=\{'batch': \{'x': 'rows'\}\}: it holds 'rows', which is neither a"),
    ({"static": ["routine"], "batch": {"routine": Batched()}}, r"'routine' is named in both static= and batch="),
    ({"buckets": 8}, r"buckets=8 is not a list of sizes\nFix: give buckets=\[1, 2, 4, ...\]"),
    ({"buckets": ["8", 4]}, r"buckets=\['8', 4\]\nFix: give positive integer sizes"),
    ({"buckets": [None, 4]}, r"buckets=\[None, 4\]\nFix: give positive integer sizes"),
    ({"buckets": [True]}, r"buckets=\[True\]\nFix: give positive integer sizes"),
    ({"buckets": [0, 4]}, r"buckets=\[0, 4\]\nFix: give positive integer sizes"),
    ({"buckets": []}, r"buckets=\[\] leaves no size to pad a call to"),
    ({"mode": "PIECEWIS"}, r"unknown mode 'PIECEWIS'"),
    ({"strict": "yes"}, r"strict='yes' is not a bool\nFix: pass strict=True or False"),
    ({"copy_outputs": "no"}, r"copy_outputs='no' is not a bool"),  # truthy: it would have copied
    ({"routine": "phase"}, r"routine='phase' is not a parameter of step\(params, state, batch, routine='decode'"),
    ({"warmups": "2"}, r"warmups='2' is not a count\nFix: pass a non-negative int"),
    ({"warmups": -1}, r"warmups=-1 is not a count"),
    ({"compile": {"coordinate_descent_tuning": "yes"}}, r"Inductor's coordinate_descent_tuning takes a bool"),
    ({"statik": ["routine"]}, r"fgraph.jit: unknown option 'statik' \(did you mean 'static'\?\)"),
]


@pytest.mark.parametrize("options, says", BAD_OPTIONS, ids=[str(o) for o, _ in BAD_OPTIONS])
def test_a_bad_option_is_a_signature_error_naming_it(options, says):
    with pytest.raises(SignatureError, match=says):
        fgraph.jit(toys.step, **options)


def test_a_misspelt_option_fails_the_decorator_itself():
    with pytest.raises(SignatureError, match=r"unknown option 'donate_args' \(did you mean 'donate_argnames'\?\)"):
        fgraph.jit(donate_args=["state"])


def test_options_that_take_names_take_one_name_too():
    f = fgraph.jit(toys.step, static="routine", donate="state", scratch="state", breaks="toy_scale", buckets=(8, 4, 8))
    assert (f.options.static, f.options.scratch, f.options.breaks, f.options.buckets) == (
        ("routine",),
        ("state",),
        ["toy_scale"],
        (4, 8),
    )


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 600),
    st.floats(),
    st.text(max_size=6),
    st.sampled_from(["routine", "state", "batch", "toy_scale", "decode", "full", Batched(), fgraph.Mode.FULL]),
    st.lists(st.one_of(st.integers(-2, 600), st.sampled_from(["routine", "state", "batch", "x"])), max_size=3),
    st.dictionaries(
        st.sampled_from(["batch", "state", "routine", "debug"]),
        st.one_of(st.just(Batched()), st.none(), st.integers()),
        max_size=2,
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(fgraph.function.OPTIONS + ("statics",)), JUNK, max_size=4))
def test_any_declaration_makes_a_function_or_a_signature_error(options):
    try:
        fgraph.jit(toys.step, **options)
    except SignatureError:
        pass


BAD_BATCHED = [  # Batched(**kw) -> what its SignatureError says
    ({"pad": "zeros"}, r"pad must be a number \(the fill value\), \"ramp\" or a callable"),
    ({"pad": None}, r"pad must be a number \(the fill value\), \"ramp\" or a callable"),
    ({"pad": [0]}, r"pad must be a number \(the fill value\), \"ramp\" or a callable"),
    ({"axis": -1}, r"Batched\(axis=-1, extra=0\): both must be non-negative ints"),
    ({"extra": 1.5}, r"Batched\(axis=0, extra=1.5\): both must be non-negative ints"),
    ({"mixes": "yes"}, r"Batched\(mixes='yes'\): mixes is a bool"),
    ({"pad": lambda x: x}, r"a pad callable is called as pad\(tensor, size\), which it cannot take"),
]


def _kw_id(kw):  # stable across processes (pytest-xdist): a callable by its name, not its address
    return ", ".join(f"{k}={v.__name__ if callable(v) else repr(v)}" for k, v in kw.items())


@pytest.mark.parametrize("kw, says", BAD_BATCHED, ids=[_kw_id(k) for k, _ in BAD_BATCHED])
def test_a_bad_batched_is_a_signature_error(kw, says):
    with pytest.raises(SignatureError, match=says):
        Batched(**kw)
