"""Bad input gets a clear error: the function, the argument's key path, what was expected, one fix."""

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched, CaptureError, SignatureError, TraceError
from tests import toys
from tests.toys import jitted, make


def traced(fn, *args, donate=(), **kw):
    """Trace fn through fgraph.jit on args (the first argument batched)."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    f = fgraph.jit(fn, donate=donate, batch={names[0]: Batched()}, mode="PIECEWISE", buckets=[8], **kw)
    return f(*args)


def test_unhashable_static():
    f = jitted()
    params, state, batch = make()
    with pytest.raises(
        SignatureError,
        match=r"fgraph.jit\(step\): static argument routine=\['decode'\] is "
        r"unhashable \(list\)\nFix: pass a hashable value",
    ):
        f(params, state, batch, routine=["decode"])


def test_an_unhashable_python_value_among_the_arguments():
    """A non-tensor leaf is keyed by its value (a new value is a new signature): an unhashable one (a set, or a
    slice before Python 3.12) is an error naming it, not Python's TypeError from a dict lookup."""
    f = fgraph.jit(lambda x, rows: x[sorted(rows)] * 1)
    with pytest.raises(
        SignatureError,
        match=r"fgraph.jit\(<lambda>\): rows=\{0, 2\} is unhashable \(set\), and a Python value that is not a tensor "
        r"is part of the signature\nFix: pass a hashable value",
    ):
        f(torch.ones(4, 3), {0, 2})


def checked(x, table):
    if x.shape[1] != 4:
        raise ValueError(f"expected 4 features, got {x.shape[1]}")
    return x * table["scale"]


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_the_functions_own_exception_comes_through_as_itself(mode):
    """As with jax.jit, an exception the function's own code raises while being traced reaches the caller with
    its type and message (callers may catch it), a note saying fgraph was tracing; nothing is cached, so a
    later good call works. Errors from torch calls stay fgraph TraceErrors (test_item_in_traced_function, ...)."""
    f = fgraph.jit(checked, batch={"x": Batched()}, mode=mode, buckets=[4])
    with pytest.raises(ValueError, match="expected 4 features, got 3") as got:
        f(torch.ones(2, 3), {"scale": torch.ones(())})
    assert any("while fgraph.jit traced it" in n for n in getattr(got.value, "__notes__", []))
    with pytest.raises(KeyError, match="scale"):
        f(torch.ones(2, 4), {"scal": torch.ones(())})
    x = torch.randn(3, 4)
    assert torch.equal(f(x, {"scale": torch.full((), 2.0)}), x * 2)


def test_missing_argument():
    with pytest.raises(SignatureError, match=r"fgraph.jit\(step\): missing a required argument: 'batch'"):
        jitted()(*make()[:2])


def test_item_in_traced_function():
    def f(x):
        return x * x.sum().item()

    with pytest.raises(
        TraceError,
        match=r"fgraph.jit\(f\): .item\(\) \(or .tolist\(\)\) at tests/test_errors.py:\d+ needs the tensor's "
        r"value on the host",
    ):
        traced(f, torch.ones(3, 2))


def test_python_if_on_a_tensor():
    def f(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(
        TraceError,
        match=r"bool\(\) of a tensor \(Python control flow on a tensor value\) at "
        r"tests/test_errors.py:\d+.*\nFix: keep the value on the device \(torch.where",
    ):
        traced(f, torch.ones(3, 2))


def test_print_of_a_tensor():
    def f(x):
        print(x)
        return x + 1

    with pytest.raises(TraceError, match=r"printing a tensor at tests/test_errors.py:\d+"):
        traced(f, torch.ones(3, 2))


def test_cpu_and_tolist():
    with pytest.raises(TraceError, match=r"\.cpu\(\) at"):
        traced(lambda x: x.cpu() + 1, torch.ones(3, 2))
    with pytest.raises(TraceError, match=r"\.item\(\) \(or \.tolist\(\)\) at"):
        traced(lambda x: torch.tensor(x.tolist()), torch.ones(3, 2))


def test_data_dependent_shape():
    with pytest.raises(
        TraceError,
        match=r"\(<lambda>\): aten.nonzero.default at tests/test_errors.py:\d+ has a shape that depends on tensor "
        r"values.*\nFix: use torch.where / masking",
    ):
        traced(lambda x: x.nonzero(), torch.ones(3, 2))


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda x: x[x > 0], "aten.index.Tensor"),  # boolean-mask indexing
        (lambda x: torch.unique(x), r"aten._unique2.default \(output 0\)"),  # one output of a multi-output op
    ],
)
def test_data_dependent_shape_names_the_op_not_the_graph_node(fn, op):
    with pytest.raises(TraceError, match=rf"\(<lambda>\): {op} at tests/test_errors.py:\d+ has a shape that") as e:
        traced(fn, torch.ones(3, 2))
    assert "call_function" not in str(e.value) and "%" not in str(e.value)


def test_bounds_computed_from_a_size_are_not_called_data_dependent():
    with pytest.raises(
        TraceError,
        match=r"\(<lambda>\): aten.slice.Tensor at tests/test_errors.py:\d+ takes bounds computed from a size, and "
        r"torch cannot derive the size of its result from them\nFix: slice with constant bounds",
    ):
        traced(lambda x: x[x.shape[0] - 2 :] * 1, torch.ones(3, 2))


def test_write_into_a_non_donated_input():
    def f(x, params):
        params["w"].mul_(2)
        return x @ params["w"]

    with pytest.raises(
        TraceError,
        match=r"aten.mul_.Tensor at tests/test_errors.py:\d+ writes in place into "
        r"params\['w'\], which is not donated\nFix: add 'params' to donate=",
    ):
        traced(f, torch.ones(3, 2), {"w": torch.ones(2, 2)})


@pytest.mark.parametrize(
    "change, donate",
    [
        (lambda w: setattr(w, "data", w * 2), ()),
        (lambda w: setattr(w, "data", w * 2), ("w",)),
        (lambda w: w.set_(w * 2), ("w",)),
        (lambda w: w.t_(), ("w",)),
        (lambda w: w.transpose_(0, 1), ("w",)),
        (lambda w: w.unsqueeze_(0), ("w",)),
    ],
    ids=["data", "data-donated", "set_", "t_", "transpose_", "unsqueeze_"],
)
def test_changing_an_inputs_memory_or_strides_in_place_is_refused(change, donate):
    """A graph reads and writes an input's memory as passed: `.data =` (which make_fx does not record), set_ and
    the in-place views would be replayed over the old layout. Value writes into donated state still work."""

    def f(x, w):
        change(w)
        return x @ w.reshape(2, 2)

    with pytest.raises(TraceError, match="changes the memory, shape or strides of w in place"):
        traced(f, torch.ones(3, 2), torch.arange(4.0).reshape(2, 2), donate=donate)

    def scaled(x, w):
        w.mul_(2)
        return x @ w

    w = torch.eye(2)
    assert torch.equal(traced(scaled, torch.ones(3, 2), w, donate=("w",)), 2 * torch.ones(3, 2))
    assert torch.equal(w, 2 * torch.eye(2))


def test_a_donated_tensor_passed_again_as_another_argument_is_named_as_such():
    def upd(state, x, other):  # written through the donated name, read through the other
        state.add_(x.sum(0))
        return x * other

    def upd_other(state, x, other):  # written through the name that is not donated
        other.add_(x.sum(0))
        return x * state

    s, kw = torch.zeros(2), {"donate": ["state"], "batch": {"x": Batched(mixes=True)}, "buckets": [4]}
    with pytest.raises(SignatureError, match=r"other shares memory with state, which the function writes in place"):
        fgraph.jit(upd, **kw)(s, torch.ones(3, 2), s)
    with pytest.raises(
        TraceError, match=r"state \(donated\) and other are the same tensor, and aten.add_.* in place through other"
    ) as e:
        fgraph.jit(upd_other, **kw)(s, torch.ones(3, 2), s)
    assert e.value.fix == "write it through state, or pass it once"
    assert s.tolist() == [0.0, 0.0]  # nothing written: warm-up and capture put the state back


def test_donated_alias_is_fine():
    def f(x, state):
        state["k"][: x.shape[0]].copy_(x)  # x arrives padded to its bucket (8 rows, pad 0)
        return x + 1, state

    out, st = traced(f, torch.ones(3, 2), {"k": torch.zeros(16, 2)}, donate=["state"])
    assert st["k"].sum() == 6


def test_oversize_in_strict_mode():
    f = jitted(strict=True, buckets=[4])
    params, state, _ = make()
    with pytest.raises(
        SignatureError,
        match=r"strict=True\): 9 tokens exceed the largest bucket 4\n"
        r"Fix: raise buckets=\[..., N\] or split the batch",
    ):
        f(params, state, {"x": torch.ones(9, 8)}, routine="decode")


def test_structure_change_after_sealing_in_strict_mode():
    f = jitted(strict=True, buckets=[8])
    params, state, batch = make()
    f.capture(params, state, batch, routine="decode", progress=False)
    with pytest.raises(
        SignatureError,
        match=r"signature \(breaks=2, routine='decode', bucket=8\) was not captured; "
        r"closest captured signature \(breaks=2, routine='decode', bucket=8\) differs in the tree "
        r"structure of the arguments\nFix: add it to step.capture",
    ):
        f(params, {**state, "extra": torch.zeros(1)}, batch, routine="decode")


def test_wrong_dtype_after_sealing_names_the_key_path():
    f = jitted(strict=True, buckets=[8])
    params, state, batch = make()
    f.capture(params, state, batch, routine="decode", progress=False)
    with pytest.raises(
        SignatureError,
        match=r"differs in params\['w'\]: float64\[8, 8\]@cpu "
        r"\(captured float32\[8, 8\]@cpu\)",
    ):
        f({"w": params["w"].double()}, state, batch, routine="decode")


def test_batched_leaf_must_be_a_tensor():
    f = fgraph.jit(lambda x: x, batch={"x": Batched()})
    with pytest.raises(SignatureError, match=r"x is declared Batched but is a int"):
        f(3)
    f(torch.ones(3))  # also after a call with a tensor there (the replay path reads its .shape)
    with pytest.raises(SignatureError, match=r"x is declared Batched but is a int"):
        f(3)


def test_batched_axis_out_of_range():
    f = fgraph.jit(lambda x: x + 1, batch={"x": Batched(axis=1)})
    with pytest.raises(SignatureError, match=r"x has shape \[3\], expected a batch axis 1"):
        f(torch.ones(3))


def test_params_on_two_devices():
    f = fgraph.jit(lambda x, p: x @ p["a"] @ p["b"], batch={"x": Batched()})
    with pytest.raises(
        SignatureError,
        match=r"p\['a'\] is on cpu but p\['b'\] is on meta\nFix: put params and state "
        r"on one device",
    ):
        f(torch.ones(3, 2), {"a": torch.ones(2, 2), "b": torch.ones(2, 2, device="meta")})


def test_tensor_in_a_static_field():
    @attrs.define
    class Cfg:
        scale: torch.Tensor = fgraph.field(static=True)

    f = fgraph.jit(lambda x, cfg: x * 2, batch={"x": Batched()})
    with pytest.raises(fgraph.FgraphError, match=r"cfg.scale is a tensor in a static field"):
        f(torch.ones(3), Cfg(torch.ones(1)))


def test_never_capturable_primitive_kept_inside_a_graph():
    def fn(x):
        o = torch.empty_like(x)
        toys.toy_never(o, x)
        return o

    f = fgraph.jit(fn, batch={"x": Batched()}, mode="PIECEWISE", breaks=["toy_scale"], buckets=[4])
    with pytest.raises(
        CaptureError,
        match=r"primitive 'toy_never' \(toy_never syncs with the host; support NEVER\) "
        r"is not in breaks=, so it would run inside a PIECEWISE CUDA graph\nFix: add 'toy_never' to "
        r"breaks=",
    ):
        f(torch.ones(3, 2))


@pytest.mark.parametrize("what", [toys.step, None, 3, jitted().capture])
def test_explain_of_what_is_not_a_jitted_function(what):
    with pytest.raises(fgraph.FgraphError, match=r"expected a function made by fgraph.jit, got \w+\nFix: wrap it"):
        fgraph.explain(what)


def test_host_tensor_inside_a_device_signature():
    """A host tensor computed from an input, or returned, inside a device signature is a copy per replay, or a host
    value eager hands back: rejected where it is made. (The meta device stands in for CUDA here; batched inputs may
    still come from the host.) Host constants the source fixes are made on the device instead
    (tests/test_semantics_outputs_and_cache.py)."""
    made = {  # fn -> the op the error names
        lambda x, w: (x @ w) * (w.sum().to("cpu") * 2): r"aten._to_copy.default",
        lambda x, w: ((x @ w) * torch.tensor(2.0), torch.tensor(1.0)): r"a constant, as torch.tensor\(...\) makes",
        lambda x, w: ((x @ w) * torch.arange(2).to(w.device), torch.arange(2)): r"aten.arange.default",
    }
    for fn, op in made.items():
        g = fgraph.jit(fn, batch={"x": Batched()}, buckets=[4])
        with pytest.raises(
            TraceError,
            match=rf"a CPU tensor \({op}\) at tests/test_errors.py:\d+ in a meta signature\n"
            r"Fix: create it on the device \(device='meta'\)",
        ):
            g(torch.ones(3, 2), torch.ones(2, 2, device="meta"))


def test_a_returned_host_constant_is_named_and_the_others_still_move():
    """Only the constant the function returns stays on the host (eager returns it there): the error names its line,
    not one the program could have moved."""

    def fn(x, w):
        y = (x @ w) * torch.tensor([2.0, 3.0]).to(w.device)  # moved to the device
        return y, torch.tensor([1.0])  # returned: on the host, as eager

    line = fn.__code__.co_firstlineno + 2
    g = fgraph.jit(fn, batch={"x": Batched()}, buckets=[4])
    with pytest.raises(TraceError, match=rf"a CPU tensor \(a constant, .*\) at tests/test_errors.py:{line} in a meta"):
        g(torch.ones(3, 2), torch.ones(2, 2, device="meta"))


def padded(spec, x, y=None, params=None):
    """A call of a jitted function of the batched leaves x and y (and unbatched params)."""
    batch = {"x": spec} if y is None else {"x": spec, "y": spec}
    return fgraph.jit(lambda x, y=None, p=None: x * 2, batch=batch, buckets=[4])(x, y, p=params)


BAD_CALLS = {  # a call -> what its SignatureError says
    "fewer rows than extra": (
        lambda: padded(Batched(extra=5), torch.ones(3)),
        r"x has 3 rows along axis 0, fewer than the 5 extra rows its Batched\(extra=5\) declares",
    ),
    "ramp of a 2-D leaf": (
        lambda: padded(Batched(pad="ramp"), torch.ones(3, 2)),
        r"x has shape \[3, 2\], but Batched\(pad='ramp'\) continues a 1-D array of offsets along its axis",
    ),
    "a fill value the dtype cannot hold": (
        lambda: padded(Batched(pad=float("nan")), torch.ones(3, dtype=torch.int32)),
        r"x is int32, which cannot hold its Batched\(pad=nan\)",
    ),
    "a pad callable's wrong shape": (
        lambda: padded(Batched(pad=lambda t, size: torch.zeros(2)), torch.ones(3)),
        r"Batched\(pad=.*<lambda>\) returned shape \[2\] for 4 rows along axis 0, not the padded leaf's shape \[4\]",
    ),
    "a sparse tensor": (
        lambda: padded(Batched(), torch.ones(3).to_sparse()),
        r"x is a sparse_coo tensor; fgraph traces and captures dense \(strided\) tensors\nFix: pass x.to_dense\(\)",
    ),
    "batched leaves on two devices": (
        lambda: padded(Batched(), torch.ones(3), torch.ones(3, device="meta")),
        r"y is on meta, but the call runs on cpu\nFix: put it on cpu, or on the host",
    ),
    "a batched leaf on another device than the params": (
        lambda: padded(Batched(), torch.ones(3, device="meta"), params=torch.ones(1)),
        r"x is on meta, but the call runs on cpu",
    ),
}


@pytest.mark.parametrize("call", list(BAD_CALLS))
def test_a_call_that_does_not_fit_is_a_signature_error(call):
    fn, says = BAD_CALLS[call]
    with pytest.raises(SignatureError, match=says):
        fn()


ANY_VALUE = st.one_of(
    st.none(),
    st.integers(-1, 3),
    st.floats(-2, 2, width=32),
    st.text(max_size=2),
    st.lists(st.integers(0, 2), max_size=2),
    st.builds(
        torch.ones,
        st.lists(st.integers(0, 9), max_size=3).map(tuple),
        dtype=st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool]),
    ),
)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["params", "params.w", "state", "state.count", "batch", "batch.x", "routine", "breaks"]), ANY_VALUE
)
def test_a_call_with_any_wrong_value_fails_as_eager_does_or_with_an_fgraph_error(where, value):
    """Eager is the oracle: where it raises, the jitted call raises that exception (the function's own) or an
    fgraph error, or fgraph said at trace time that padding is visible (`x @ w` of a 1-D x is valid at the bucket's
    8 rows only: eager refuses 1 row, the padded call does not); where eager returns, the jitted call returns the
    same or raises an fgraph error."""

    def arguments():
        params, state, batch = make()
        kw = {"params": params, "state": state, "batch": batch, "routine": "decode", "breaks": 2}
        top, _, key = where.partition(".")
        if key:
            kw[top] = {**kw[top], key: value}
        else:
            kw[top] = value
        return kw

    try:
        with fgraph.disable_jit():
            want = toys.step(**arguments())
    except Exception as e:
        want = e
    f = jitted(buckets=[8], mode="PIECEWISE")
    try:
        got = f(**arguments())
    except fgraph.FgraphError:
        return
    except Exception as e:
        assert type(e) is type(want), f"eager: {want!r}, jitted: {e!r}"
        return
    visible = any(e.traced.mixing for e in f.entries.values())  # padding findings, as explain lists them
    assert visible or not isinstance(want, Exception), f"eager raised {want!r}, the jitted call returned"
    if visible:
        return
    torch.testing.assert_close(got[0], want[0])


def test_capture_refuses_what_it_could_not_use():
    f = jitted(buckets=[4, 8])
    params, state, batch = make()
    bad = {  # capture(..., **kw) -> what its SignatureError says
        "buckets=[16]": ({"buckets": [16]}, r"capture: buckets \[16\] are not among step's buckets \[4, 8\], so no"),
        "buckets=8": ({"buckets": 8}, r"capture: buckets=8 is not a list of sizes"),
        "buckets=[0]": ({"buckets": [0]}, r"capture: buckets=\[0\]\nFix: give positive integer sizes"),
        "buckets=[]": ({"buckets": []}, r"capture: buckets=\[\] leaves no size to pad a call to"),
        "routine=[]": ({"routine": []}, r"capture: routine=\[\] gives no value to capture, so nothing would be"),
        "an unknown keyword": ({"rotuine": ["decode"]}, r"got an unexpected keyword argument 'rotuine'"),
    }
    for kw, says in bad.values():
        with pytest.raises(SignatureError, match=says):
            f.capture(params, state, batch, progress=False, **kw)
    with pytest.raises(SignatureError, match=r"static argument routine=\['decode'\] is passed by position, where"):
        f.capture(params, state, batch, ["decode"], progress=False)
    assert not f.sealed and not f.entries


_names = iter(f"fz_bad{i}" for i in range(1000))


def out_only(out: torch.Tensor, x: torch.Tensor) -> None:
    out.copy_(x)


BAD_PRIMITIVES = {  # fgraph.primitive(...) of `out_only` (or of what it decorates) -> what its FgraphError says
    "a name taken": (lambda: fgraph.primitive("toy_scale")(out_only), r"'toy_scale'\): a primitive of this name is"),
    "no name": (lambda: fgraph.primitive(out_only), r"the first argument is the primitive's name, got <function"),
    "a class decorated": (lambda: fgraph.primitive(next(_names))(int), r"decorates <class 'int'>, which is not a Py"),
    "a name that is no identifier": (lambda: fgraph.primitive("my-op")(out_only), r"is not a Python identifier"),
    "a support string": (
        lambda: fgraph.primitive(next(_names), support="ALWAYS")(out_only),
        r"support='ALWAYS' is neither a fgraph.Support nor a rule of one argument",
    ),
    "a plan that is no function": (
        lambda: fgraph.primitive(next(_names), plan=True)(out_only),
        r"plan=True is not a function of one argument",
    ),
    "no annotations": (
        lambda: fgraph.primitive(next(_names))(lambda out, x: None),
        r"torch cannot make an op of <lambda>\(out, x\): .*Parameter out must have a type annotation",
    ),
    "mutates_args naming no parameter": (
        lambda: fgraph.primitive(next(_names), mutates_args=["outt"])(out_only),
        r"torch cannot make an op of out_only\(out: torch.Tensor, x: torch.Tensor\) -> None: .*outt",
    ),
    "a support rule returning junk": (
        lambda: padded_through(fgraph.primitive(next(_names), support=lambda args: "never")(out_only)),
        r"its support rule returned 'never' for arguments \{\}\nFix: return a fgraph.Support",
    ),
    "a tensor result without a shape rule": (
        lambda: padded_through(fgraph.primitive(next(_names))(returns)),
        r"returns tensors but has no shape rule, so it cannot be traced\nFix: give it one: @returns.register_fake",
    ),
}


def returns(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def padded_through(op):
    """A FULL-mode call of a function around the break `op`."""

    def fn(x):
        o = torch.empty_like(x)
        r = op(o, x)
        return o if r is None else r

    return fgraph.jit(fn, batch={"x": Batched()}, mode="FULL", buckets=[4])(torch.ones(3))


@pytest.mark.parametrize("case", list(BAD_PRIMITIVES))
def test_a_primitive_set_up_wrongly_is_an_fgraph_error(case):
    fn, says = BAD_PRIMITIVES[case]
    with pytest.raises(fgraph.FgraphError, match=says):
        fn()


def test_switches_and_helpers_given_the_wrong_kind():
    with pytest.raises(fgraph.FgraphError, match=r"fgraph.config has no switch 'max_signaturs'\nFix: the switches"):
        fgraph.config.max_signaturs = 8
    with pytest.raises(fgraph.FgraphError, match=r"config.max_signatures = '8': max_signatures is a count"):
        fgraph.config.max_signatures = "8"
    with pytest.raises(fgraph.FgraphError, match=r"config.log_captures = 1: log_captures is a bool"):
        fgraph.config.log_captures = 1
    with pytest.raises(fgraph.FgraphError, match=r"fgraph.repeated: expected a function, got None"):
        fgraph.repeated(None)
    with pytest.raises(fgraph.FgraphError, match=r"fgraph.field\(static='yes'\): static is a bool"):
        fgraph.field(static="yes")
    with pytest.raises(fgraph.FgraphError, match=r"fgraph.register\(Batched\(.*\)\): expected an attrs class or a"):
        fgraph.register(Batched())
    assert fgraph.config.max_signatures == 64 and fgraph.config.log_captures is False


def test_a_python_operation_a_batch_size_symbol_does_not_take_is_a_trace_error():
    """divmod(n, 3) of a size works eagerly; while tracing, n is a symbol that divmod does not take: a TraceError
    naming the line and the size's own operators, not Python's bare TypeError."""
    f = fgraph.jit(lambda x: divmod(x.shape[0], 3), batch={"x": Batched()}, buckets=[4], mode="PIECEWISE")
    with pytest.raises(fgraph.TraceError, match=r"divmod\(\).*test_errors\.py:\d+: a batch size is a symbol") as e:
        f(torch.ones(3, 2))
    assert "n // k, n % k instead of divmod(n, k)" in e.value.fix
    hashed = fgraph.jit(lambda x: {x.shape[0]: x}[x.shape[0]], batch={"x": Batched()}, buckets=[4], mode="PIECEWISE")
    with pytest.raises(fgraph.TraceError, match=r"unhashable.*test_errors\.py:\d+: a batch size is a symbol"):
        hashed(torch.ones(3, 2))
