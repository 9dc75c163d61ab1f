"""Research code as it is written: methods, modules, closures, composition, errors at fgraph's boundary. Each
pattern works and equals eager, or raises an fgraph error with the key path and the fix."""

import copy
import functools
import gc
import logging
import re
import typing
import weakref

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched, FgraphError, SignatureError, TraceError

MODES = ["NONE", "PIECEWISE", "FULL"]


class Affine(nn.Module):
    def __init__(self, d=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(d, d)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, shift: float = 0.0):
        return self.lin(x) * self.scale + shift


def entries(f):
    return list(f.entries.values())


# -- methods and modules ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_jit_of_a_module_reads_its_parameters_in_place(mode):
    m = Affine()
    f = fgraph.jit(m, batch={"x": Batched()}, mode=mode, buckets=[4, 8])
    assert f.name == "Affine" and str(f.signature) == "(x, shift: float = 0.0)"  # forward's, not (*args, **kw)
    for n in (3, 4, 7, 3):
        x = torch.randn(n, 4)
        assert torch.equal(f(x), m(x))
    m.lin.weight.mul_(-1)  # updated in place: read in place, like any params
    x = torch.randn(3, 4)
    assert torch.equal(f(x), m(x))
    assert torch.equal(f(x, shift=1.5), m(x, 1.5))
    assert sum(e.stats.traces for e in entries(f)) == 2  # one trace per shift value (a Python leaf), buckets shared
    assert entries(f)[0].paths[1:] == ["shift", "self.lin.weight", "self.lin.bias", "self.scale"]


JITTED_AFFINE = {}


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8), mode=st.sampled_from(MODES), w=st.floats(-2, 2), shift=st.sampled_from([0.0, 1.0]))
@torch.no_grad()
def test_a_jitted_module_equals_eager_for_any_batch_and_weights(n, mode, w, shift):
    """Property: any batch size (padded to its bucket), any in-place weights, either shift: the module's answer."""
    m, f = JITTED_AFFINE.get(mode) or JITTED_AFFINE.setdefault(mode, _affine_jitted(mode))
    m.lin.weight.fill_(w)
    x = torch.randn(n, 4)
    assert torch.equal(f(x, shift=shift), m(x, shift))
    assert sum(e.stats.traces for e in entries(f)) <= 2 * 3  # per shift: buckets >= 2 share a trace, bucket 1 its own


def _affine_jitted(mode):
    m = Affine()
    return m, fgraph.jit(m, batch={"x": Batched()}, mode=mode, buckets=[1, 4, 8])


@pytest.mark.parametrize("mode", MODES)
def test_a_module_called_with_grad_mode_on_is_inference_and_a_backward_through_it_is_refused(mode):
    """Parameters that require grad are read as data: outputs equal eager's and, as eager's, require grad, but a
    backward through them (training through a jitted module) is an fgraph error naming the fix, not torch's "element
    0 of tensors does not require grad". Under no_grad the outputs are plain tensors."""
    m = Affine()
    m.train()
    f = fgraph.jit(m, batch={"x": Batched()}, mode=mode, buckets=[4])
    x = torch.randn(3, 4)
    y = f(x)
    assert torch.equal(y, m(x)) and y.requires_grad
    with pytest.raises(fgraph.FgraphError, match=r"(?s)a backward through the output of a jitted call.*torch\.no_grad"):
        y.sum().backward()
    assert m.lin.weight.grad is None
    with torch.no_grad():
        assert not f(x).requires_grad


def test_jit_of_a_bound_forward_equals_eager():
    m = Affine()
    f = fgraph.jit(m.forward, batch={"x": Batched()}, mode="FULL", buckets=[4])
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(f(x), m(x))


class Scaled(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.w = nn.Parameter(torch.full((4, 4), float(k)))

    @fgraph.jit(batch={"x": Batched()}, mode="FULL", buckets=[4])
    def apply(self, x):
        return x @ self.w


@torch.no_grad()
def test_a_jitted_method_is_bound_per_instance():
    a, b = Scaled(1), Scaled(2)
    x = torch.randn(3, 4)
    assert torch.equal(a.apply(x), x @ a.w) and torch.equal(b.apply(x), x @ b.w)  # each its own tensors
    assert a.apply is a.apply and a.apply is not b.apply and isinstance(Scaled.apply, fgraph.Jitted)
    assert len(a.apply.entries) == len(b.apply.entries) == 1
    c = copy.deepcopy(a)  # a copy (an EMA model, say) binds its own: its tensors are not a's
    c.w.data.fill_(5.0)
    assert torch.equal(c.apply(x), x @ c.w) and torch.equal(a.apply(x), x @ a.w) and c.apply is not a.apply
    ref = weakref.ref(b)
    del b
    gc.collect()
    assert ref() is None  # the instance, its jitted method and its graphs are freed together


class Plain:
    """Not a module: the method reads a tensor attribute of `self`."""

    def __init__(self, w):
        self.w = w

    @fgraph.jit(mode="NONE")
    def f(self, x):
        return x @ self.w


class Slotted:
    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w

    f = Plain.f.fn  # the same method body
    f = fgraph.jit(f, mode="NONE")


def test_a_method_of_a_plain_object_reads_its_tensor_attributes():
    p, q, r = Plain(torch.eye(4)), Plain(2 * torch.eye(4)), Slotted(3 * torch.eye(4))
    x = torch.randn(2, 4)
    assert torch.equal(p.f(x), x) and torch.equal(q.f(x), 2 * x) and torch.equal(r.f(x), 3 * x)
    assert entries(r.f)[0].paths == ["x", "self.w"]


class Recurrent(nn.Module):
    """A module-held buffer written each call (like a module-held KV cache): read, then overwritten (the warm-up
    and capture runs write it too, with all-padding inputs: donated state must be written idempotently)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("last", torch.zeros(4))

    def forward(self, x):
        out = x * 2 + self.last
        self.last.copy_(x.sum(0))
        return out


def test_module_buffer_mutation_is_a_clear_error_naming_the_buffer():
    f = fgraph.jit(Recurrent(), mode="FULL")
    with pytest.raises(TraceError, match=r"writes in place into self\.last, which is not donated") as e:
        f(torch.ones(2, 4))
    assert "add 'self' to donate=[...]" in e.value.fix


@pytest.mark.parametrize("mode", MODES)
def test_module_buffers_donated_are_updated_in_place_like_eager(mode):
    m, ref = Recurrent(), Recurrent()
    f = fgraph.jit(m, donate="self", batch={"x": Batched()}, mode=mode, buckets=[2])  # (zero pad rows add 0)
    for k in range(3):
        x = torch.full((2, 4), float(k))
        assert torch.equal(f(x), ref(x))
    assert torch.equal(m.last, ref.last)


def test_batchnorm_in_training_mode_is_an_error_naming_its_statistics():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    with pytest.raises(TraceError, match=r"writes in place into self\.1\.(running_mean|num_batches_tracked)") as e:
        fgraph.jit(m)(torch.randn(5, 4))
    assert "add 'self' to donate=[...]" in e.value.fix and "model.eval()" in e.value.fix


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_in_training_donated_updates_its_statistics_once_per_call(mode):
    """native_batch_norm writes its running statistics without saying so in its schema: fgraph knows (a table of
    such ops), so warm-up and capture put them back and each call updates them once, as eager does."""
    m = nn.BatchNorm1d(2).train()
    ref = copy.deepcopy(m)
    f = fgraph.jit(m, donate="self", mode=mode)
    with torch.no_grad():
        for k in range(3):
            x = torch.randn(5, 2, generator=torch.Generator().manual_seed(k))
            assert torch.equal(f(x), ref(x))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                assert torch.equal(getattr(m, name), getattr(ref, name)), (k, name)


def test_batch_norm_on_buffers_not_donated_is_an_error():
    class Stats(nn.Module):  # F.batch_norm on its own buffers: no add_ of a counter to give the write away
        def __init__(self):
            super().__init__()
            self.register_buffer("rm", torch.zeros(2))
            self.register_buffer("rv", torch.ones(2))

        def forward(self, x):
            return nn.functional.batch_norm(x, self.rm, self.rv, training=True, momentum=0.1)

    with pytest.raises(TraceError, match=r"native_batch_norm.* writes in place into self\.rm, which is not donated"):
        fgraph.jit(Stats(), mode="PIECEWISE")(torch.randn(5, 2))


def fills_in_scale(fn):  # like transformers' @merge_with_config_defaults: a keyword left out, filled in
    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if kwargs.get("scale") is None and not args:
            kwargs["scale"] = 3.0
        return fn(x, *args, **kwargs)

    return wrapper


@fills_in_scale
def scaled(x, scale=None):
    return x * scale


@pytest.mark.parametrize("mode", MODES)
def test_a_decorator_that_fills_in_a_keyword_sees_it_as_a_keyword(mode):
    """fgraph calls the function with its arguments by keyword where it can: BertModel.forward's decorator adds
    `use_cache` to the keywords, and a `use_cache` passed by position too was 'multiple values' jitted."""
    f = fgraph.jit(scaled, batch={"x": Batched()}, mode=mode, buckets=[4])
    x = torch.ones(3, 2)
    assert torch.equal(f(x), scaled(x)) and torch.equal(f(x, scale=2.0), scaled(x, scale=2.0))


def test_batchnorm_in_eval_mode_through_jit():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    f = fgraph.jit(m, mode="PIECEWISE")
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(f(x), m(x))


@pytest.mark.parametrize("mode", MODES)
def test_train_and_eval_after_a_call_are_seen(mode):
    """Dropout traces differently in training: model.eval() after a call made in training (and back), or one
    submodule switched, is a new signature, never the other mode's replay."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4)).train()
    f = fgraph.jit(m, batch={"input": Batched()}, buckets=[4], mode=mode)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for training in (True, False, True, False):
            m.train(training)
            got = f(x)
            if not training:
                assert torch.equal(got, m(x))  # no dropout
        m[1].train()  # only the dropout
        f(x)
    described = sorted(e.sig.describe() for e in f.entries.values())
    assert described == ["(<training>=('self',), bucket=4)", "(<training>=('self.1',), bucket=4)", "(bucket=4)"]
    # Python values Dropout.forward reads, guarded in every signature (listed apart from its description)
    assert all(e.sig.guards() == [("self.1.p", 0.5), ("self.1.inplace", False)] for e in f.entries.values())


# -- closures ----------------------------------------------------------------------------------------------------
W = torch.randn(4, 4)


def uses_global(x):
    return x @ W


def test_closed_over_and_global_tensors_are_lifted_and_read_in_place():
    v = torch.randn(4)

    def f(x):
        return uses_global(x) + v

    jf = fgraph.jit(f, mode="FULL")
    x = torch.randn(3, 4)
    assert torch.equal(jf(x), f(x))
    v.add_(1), W.mul_(2)  # in place: the graph reads them where they are
    assert torch.equal(jf(x), f(x))
    assert entries(jf)[0].paths == ["x", "v", "W"]


def test_a_global_rebound_to_a_new_tensor_is_read_anew():
    """A global the function reads, rebound to another tensor: the replay path's proof of its lifted tensors reads
    each where it lives and sees another object (removing the slots' identity check in LiftedView.proven makes
    this fail)."""
    global W
    old = W
    try:
        jf = fgraph.jit(uses_global, mode="NONE")
        x = torch.randn(3, 4)
        assert torch.equal(jf(x), x @ W)
        W = torch.randn(4, 4)
        assert torch.equal(jf(x), x @ W)
        assert torch.equal(jf(x), x @ W)
    finally:
        W = old


@fgraph.jit(batch={"x": Batched()}, mode="FULL", buckets=[4])
def reads_a_later_global(x):
    return x @ LATER


LATER = torch.randn(4, 4)  # assigned after the decorator ran: found at the first call


def test_a_global_assigned_after_the_decorator_is_lifted():
    x = torch.randn(3, 4)
    assert torch.equal(reads_a_later_global(x), x @ LATER) and torch.equal(reads_a_later_global(x), x @ LATER)
    assert entries(reads_a_later_global)[0].paths == ["x", "LATER"]


def test_a_closed_over_module_is_lifted():
    model = Affine(seed=3)

    def f(x):
        return model(x).relu()

    jf = fgraph.jit(f, batch={"x": Batched()}, mode="FULL", buckets=[4])
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(jf(x), f(x))


CONFIG = {"w": torch.randn(4, 4), "layers": [torch.randn(4)]}


def test_tensors_in_dicts_and_lists_and_a_partials_arguments_are_lifted():
    def f(x):
        return x @ CONFIG["w"] + CONFIG["layers"][0]

    def step(params, x):
        return x @ params["w"]

    params = {"w": torch.randn(4, 4)}
    jf, js = fgraph.jit(f, mode="FULL"), fgraph.jit(functools.partial(step, params), mode="FULL")
    x = torch.randn(3, 4)
    assert torch.equal(jf(x), f(x)) and torch.equal(js(x), step(params, x))
    CONFIG["w"].add_(1), params["w"].add_(1)
    assert torch.equal(jf(x), f(x)) and torch.equal(js(x), step(params, x))
    assert entries(jf)[0].paths == ["x", "CONFIG['w']", "CONFIG['layers'][0]"]
    assert js.name == "step" and entries(js)[0].paths == ["x", "params['w']"]


PAIR = (torch.randn(4, 4),)


def test_a_tensor_fgraph_cannot_lift_is_an_error_naming_it():
    def f(x):
        return x @ PAIR[0]

    with pytest.raises(
        TraceError,
        match=r"the global `PAIR\[0\]` \(float32\[4, 4\]\) at .*test_research.py:\d+ "
        r"is read by the function but is not one of its inputs",
    ) as e:
        fgraph.jit(f, mode="NONE")(torch.randn(2, 4))
    assert "pass the global `PAIR[0]` as an argument" in e.value.fix
    assert "FakeTensor" not in str(e.value)


# -- composition -------------------------------------------------------------------------------------------------
SCALE = torch.tensor(3.0)


@fgraph.jit(mode="FULL")
def inner(x):
    return x * SCALE


def test_a_jitted_function_called_while_another_traces_is_inlined():
    outer = fgraph.jit(lambda x: inner(x) + 1, batch={"x": Batched()}, mode="FULL", buckets=[4])
    x = torch.randn(3, 2)
    assert torch.equal(outer(x), x * SCALE + 1)
    assert not inner.entries and len(outer.entries) == 1
    assert torch.equal(inner(x), x * SCALE)  # and on its own it is jitted as usual


def test_varargs_kwargs_and_positional_only():
    def f(x, /, *rest, k=1.0, **extra):
        return x * k + sum(rest) + sum(extra.values())

    jf = fgraph.jit(f, mode="PIECEWISE")
    x, y = torch.randn(3), torch.randn(3)
    for args, kw in [((x,), {}), ((x, y, y), {"k": 2.0, "b": x}), ((x, y, y), {"k": 2.0, "b": x})]:
        assert torch.equal(jf(*args, **kw), f(*args, **kw))
    assert len(jf.entries) == 2 and [e.stats.calls for e in entries(jf)] == [1, 2]
    assert entries(jf)[1].paths == ["x", "rest[0]", "rest[1]", "k", "extra['b']"]


def test_jit_of_torch_func_grad():
    def loss(w, x):
        return ((x @ w) ** 2).sum()

    g = fgraph.jit(torch.func.grad(loss), mode="FULL")
    w, x = torch.randn(4, 2), torch.randn(3, 4)
    assert torch.allclose(g(w, x), torch.func.grad(loss)(w, x))


def test_a_tensor_as_a_static_argument_is_an_error():
    f = fgraph.jit(lambda x, t: x * t, static_argnames="t")
    with pytest.raises(SignatureError, match=r"static argument 't' is \(or holds\) a tensor") as e:
        f(torch.ones(2), torch.ones(2))
    assert "remove 't' from static=" in e.value.fix


def test_jax_spellings_static_argnames_and_donate_argnames():
    def f(x, state, n):
        state.copy_(x.sum())
        return x * n

    jf = fgraph.jit(f, static_argnames=["n"], donate_argnames="state", mode="FULL")
    assert jf.options.static == ("n",) and jf.options.donate == ("state",)
    s = torch.zeros(())
    assert torch.equal(jf(torch.ones(2), s, n=3), torch.full((2,), 3.0)) and s.item() == 2.0


# -- errors at the boundary --------------------------------------------------------------------------------------
def test_a_shape_error_names_the_line_the_inputs_and_the_batch_axis(capfd):
    def f(x, w):
        return x @ w

    jf = fgraph.jit(f, batch={"x": Batched()}, buckets=[8])
    with pytest.raises(TraceError) as e:
        jf(torch.randn(3, 4), torch.randn(5, 4))
    msg = str(e.value)
    assert re.search(r"fgraph.jit\(f\): RuntimeError at .*test_research.py:\d+ in ", msg), msg
    assert "`x` float32[(batch axis of `x`), 4], `w` float32[5, 4]" in msg
    assert "got [(batch axis of `x`), 4] X [5, 4]" in msg and not re.search(r"\bs\d+\b", msg)
    assert "fgraph.disable_jit()" in e.value.fix
    assert e.value.__cause__ is None  # torch's own error: one switch away (tests/test_tracebacks.py)
    assert "failed while attempting to run meta" not in capfd.readouterr().err  # no fake-tensor logging


def test_vmap_and_grad_over_a_jitted_call_are_fgraph_errors():
    f = fgraph.jit(lambda x: (x * 2).sum())
    with pytest.raises(FgraphError, match=r"called under a torch.func transform"):
        torch.vmap(f)(torch.randn(3, 2))
    with pytest.raises(FgraphError, match=r"called under a torch.func transform"):
        torch.func.grad(f)(torch.randn(3))


def test_torch_compile_over_a_jitted_call_runs_it_as_one_opaque_call_of_fgraphs_graphs():
    f = fgraph.jit(lambda x: x * 2 + 1)
    x = torch.randn(3)
    torch._dynamo.reset()
    outer = torch.compile(lambda x: f(x).relu())
    for _ in range(3):
        torch.testing.assert_close(outer(x), (x * 2 + 1).relu())
    torch.testing.assert_close(torch.compile(f)(x), x * 2 + 1)
    assert f.stats()["total"]["traces"] == 1 and f.stats()["total"]["calls"] == 4  # (fgraph served every call)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"fgraph.jit function runs fgraph's own CUDA graphs.*fullgraph=True"):
        torch.compile(lambda x: f(x).relu(), fullgraph=True)(x)


def test_autograd_through_a_jitted_call_is_an_fgraph_error():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(FgraphError, match=r"x requires grad and grad mode is on") as e:
        fgraph.jit(lambda x: x * 2)(x)
    assert "torch.no_grad()" in e.value.fix
    with torch.no_grad():
        assert torch.equal(fgraph.jit(lambda x: x * 2)(x), x * 2)


@pytest.mark.parametrize("mode", MODES)
def test_autograd_wanted_after_calls_that_wanted_none_is_an_fgraph_error(mode):
    """The replay path refuses it too: a call under grad mode with a tensor that requires grad, after calls of the
    same layout under no_grad or with tensors that did not, is never answered with outputs that carry no autograd
    history (eager's would: their gradients would be silently missing)."""
    f = fgraph.jit(lambda p, x: x @ p["w"], batch={"x": Batched()}, mode=mode, buckets=[4])
    p, x = {"w": torch.randn(4, 4)}, torch.randn(3, 4)
    f(p, x), f(p, x)
    with pytest.raises(FgraphError, match=r"x requires grad and grad mode is on"):
        f(p, x.clone().requires_grad_())
    q = {"w": torch.randn(4, 4, requires_grad=True)}
    with torch.no_grad():
        f(q, x), f(q, x)
    with pytest.raises(FgraphError, match=r"p\['w'\] requires grad and grad mode is on"):
        f(q, x)
    with torch.no_grad():  # still served as before
        assert torch.equal(f(q, x.clone().requires_grad_()), x @ q["w"])


# -- inspection --------------------------------------------------------------------------------------------------
def test_lower_as_text_and_explain_avals():
    def f(params, x):
        return torch.tanh(x @ params["w"])

    jf = fgraph.jit(f, batch={"x": Batched()}, buckets=[4])
    params, x = {"w": torch.randn(4, 4)}, torch.randn(3, 4)
    text = jf.lower(params, x).as_text()
    assert "def forward(self, params_w, x):" in text and "torch.ops.aten.tanh.default" in text
    assert "# x: float32[4, 4]@cpu (Batched)" in text and "# out: float32[4, 4]" in text
    assert not jf.entries  # lowering traces, never captures
    jf(params, x)
    assert (
        "    params['w']: float32[4, 4]@cpu\n    x: float32[4, 4]@cpu (Batched)\n  outputs: 1\n    out: float32[4, 4]"
        in (str(fgraph.explain(jf)))
    )


def test_jit_has_typed_overloads_for_both_forms():
    hints = [typing.get_type_hints(o)["return"] for o in typing.get_overloads(fgraph.jit)]
    assert hints[0] is fgraph.Jitted and typing.get_origin(hints[1]) is not None


def test_no_torch_assertion_reaches_the_user(caplog):
    """A closure over a tensor inside a tuple, a data-dependent branch, a bad reshape: all fgraph errors."""
    held = (torch.ones(4),)

    def a(x):
        return x + held[0]

    def b(x):
        return x if x.sum() > 0 else -x

    def c(x):
        return x.view(5, -1)

    for fn in (a, b, c):
        with caplog.at_level(logging.WARNING), pytest.raises(FgraphError):
            fgraph.jit(copy.copy(fn))(torch.ones(3, 4))
