"""The replay path serves jitted modules, methods, `**kwargs` functions and arguments passed as new objects each
call, and proves what it skips: every way research code changes a module's tensors between calls is seen, and the
call equals eager (removing any one of LiftedView's proofs fails one case here)."""

import gc
import logging
import weakref

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched, FgraphError

MODES = ["NONE", "PIECEWISE", "FULL"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4)])
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        h = self.lin(x) * self.scale
        for layer in self.layers:
            h = layer(h)
        if hasattr(self, "extra"):
            h = h + self.extra
        return h * 3 if self.training else h


def fast(f) -> int:
    return f.stats()["total"]["fast"]


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_a_jitted_module_is_served_by_the_replay_path(mode):
    m = Net().eval()
    f = fgraph.jit(m, batch={"x": Batched()}, mode=mode, buckets=[4])
    for _ in range(5):
        assert torch.equal(f(X), m(X))
    assert fast(f) == 4  # one slow call teaches it
    m.lin.weight.mul_(2)  # in place: the graphs read it where it is
    assert torch.equal(f(X), m(X)) and fast(f) == 5


CHANGES = {  # each a change to the module between calls, and the proof that sees it
    "data swapped under a parameter": lambda m: setattr(m.lin.weight, "data", torch.randn(4, 4)),  # data_ptr
    "dtype round trip": lambda m: m.double().float(),  # .to(): new memory under the same Parameters (data_ptr)
    "parameter assigned": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.randn(4, 4))),  # identity
    "parameter dict written": lambda m: m.lin._parameters.__setitem__("bias", nn.Parameter(torch.randn(4))),
    "buffer assigned": lambda m: setattr(m, "scale", torch.tensor(5.0)),  # identity
    "submodule replaced": lambda m: setattr(m, "lin", nn.Linear(4, 4)),  # the registration hooks
    "layer appended": lambda m: m.layers.append(nn.Linear(4, 4)),  # the registration hooks
    "layer deleted": lambda m: m.layers and m.layers.__delitem__(-1),  # no hook: the submodule dicts' sizes
    "submodule deleted": lambda m: m.layers and delattr(m.layers, str(len(m.layers) - 1)),  # the dict kept: its size
    "parameter registered": lambda m: m.register_parameter("extra", nn.Parameter(torch.ones(4))),
    "train mode": lambda m: m.train(),  # the training flags
    "one submodule in train mode": lambda m: m.lin.train(),
    "training flag assigned": lambda m: setattr(m, "training", True),  # not through train(): the flag itself
}


@torch.no_grad()
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("mode", MODES)
def test_every_change_to_a_modules_tensors_is_seen(mode, change):
    m = Net().eval()
    f = fgraph.jit(m, batch={"x": Batched()}, mode=mode, buckets=[4])
    f(X), f(X)
    before = fast(f)
    CHANGES[change](m)
    for x in (X, X[:2], X, X):  # another N too: its slow call must leave no entry of the old module in use for N=3
        torch.testing.assert_close(f(x), m(x), msg=change)  # (a padded matmul rounds as BLAS does at its size)
    assert fast(f) - before <= 2  # the change's call went the slow way; the calls after it are replayed again


@torch.no_grad()
def test_deleting_a_parameter_is_seen():
    m = Net().eval()
    m.register_parameter("extra", nn.Parameter(torch.ones(4)))
    f = fgraph.jit(m, batch={"x": Batched()}, mode="FULL", buckets=[4])
    f(X), f(X)
    del m.extra
    assert torch.equal(f(X), m(X))


class Moded(Net):
    """A module whose training flag is a property (not an instance attribute, where the proof reads it first)."""

    @property
    def training(self):
        return self._mode

    @training.setter
    def training(self, mode):
        object.__setattr__(self, "_mode", mode)


@torch.no_grad()
def test_a_training_flag_held_by_a_property_is_proven():
    m = Moded().eval()
    f = fgraph.jit(m, batch={"x": Batched()}, mode="FULL", buckets=[4])
    f(X), f(X)
    assert fast(f) == 1
    m.train()
    assert torch.equal(f(X), m(X)) and torch.equal(m(X), Net().eval()(X) * 3)


class Scaled:
    def __init__(self):
        self.w = torch.randn(4, 4)

    def apply(self, x):
        return x @ self.w


@torch.no_grad()
def test_a_tensor_attribute_of_a_methods_object_is_proven_by_identity():
    obj = Scaled()
    f = fgraph.jit(obj.apply, batch={"x": Batched()}, mode="FULL", buckets=[4])
    f(X), f(X)
    assert fast(f) == 1
    obj.w = torch.randn(4, 4)
    assert torch.equal(f(X), obj.apply(X)) and torch.equal(f(X), obj.apply(X))


def test_grad_mode_on_the_replay_path_refuses_a_backward_as_the_slow_path_does():
    m = Net().eval()  # its parameters require grad
    f = fgraph.jit(m, batch={"x": Batched()}, mode="FULL", buckets=[4])
    f(X)
    out = f(X)
    assert fast(f) == 1 and out.requires_grad
    with pytest.raises(FgraphError, match="backward through the output of a jitted call"):
        out.sum().backward()


def scaled(x, **kw):
    return x * kw["s"] + kw.get("t", 0)


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_a_kwargs_function_is_served_by_the_replay_path(mode):
    f = fgraph.jit(scaled, batch={"x": Batched()}, mode=mode, buckets=[4])
    s = torch.tensor(3.0)
    for _ in range(4):
        assert torch.equal(f(X, s=s), scaled(X, s=s))
    assert fast(f) == 2  # each call's **kw is a new dict: the second call learns to read it afresh
    t = torch.ones(4)
    assert torch.equal(f(X, s=s, t=t), scaled(X, s=s, t=t))  # another keyword: another structure
    assert torch.equal(f(X, s=torch.tensor(5.0)), scaled(X, s=torch.tensor(5.0)))  # a new tensor each call
    assert torch.equal(f(X, s=torch.tensor(7.0)), scaled(X, s=torch.tensor(7.0)))


def step(p, x, state):
    state["h"].add_(p["b"] @ p["w"])
    return torch.relu(x @ p["w"] + p["b"]) @ p["w"].T, state


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}


ARGS = st.sampled_from(["same", "new dict", "new tensors", "transposed weight", "new state", "new state tensor"])


@torch.no_grad()
@settings(max_examples=25, deadline=None)
@given(st.sampled_from(MODES), st.lists(st.tuples(ARGS, st.integers(1, 4)), min_size=2, max_size=10))
def test_any_sequence_of_new_and_passed_again_arguments_equals_eager(mode, calls):
    """Each call passes its arguments again (the same objects) or anew (a new dict over the same tensors, new
    tensors, a weight in another memory layout, a new state dict over the same tensor or a new one): every result
    and every state write equals eager's, whichever path served it."""
    f = fgraph.jit(step, donate=["state"], batch={"x": Batched()}, mode=mode, buckets=[2, 4])
    p, state, ref = _params(0), {"h": torch.zeros(4)}, {"h": torch.zeros(4)}
    for k, (how, n) in enumerate(calls):
        if how == "new dict":
            p = dict(p)
        elif how == "new tensors":
            p = {name: t.clone() + 0.5 for name, t in p.items()}
        elif how == "transposed weight":
            p = {**p, "w": p["w"].T.contiguous().T}
        elif how == "new state":
            state = dict(state)
        elif how == "new state tensor":
            state, ref = {"h": state["h"].clone()}, {"h": ref["h"].clone()}
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(k))
        got, back = f(p, x, state)
        want, _ = step(p, x, ref)
        assert back is state and torch.equal(state["h"], ref["h"]), (k, how)
        torch.testing.assert_close(got, want, msg=(k, how))  # (a padded matmul rounds as BLAS does at its size)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_a_signature_replayed_after_another_saw_a_reload_reads_the_new_tensors(mode):
    """Bucket 4's graphs were captured over the old weight; bucket 2's call sees the new one first. Bucket 4's next
    call is proven by the new view, which it was not verified with: every address is checked, and it recaptures."""
    m = Net().eval()
    f = fgraph.jit(m, batch={"x": Batched()}, mode=mode, buckets=[2, 4])
    small, big = X[:2], torch.cat([X, X[:1]])
    for _ in range(2):
        f(small), f(big)
    m.lin.weight = nn.Parameter(torch.randn(4, 4))
    assert torch.equal(f(small), m(small))
    assert torch.equal(f(big), m(big))


class State:  # a plain class: seen into as donated state
    def __init__(self):
        self.h = torch.zeros(4)


def step_on(p, x, state):
    state.h.add_(p["b"])
    return x @ p["w"], state


@torch.no_grad()
def test_an_argument_passed_as_a_new_object_each_call_is_not_kept_alive():
    """The layout of the last slow call's object is let go once the replay path serves another one: an old KV cache
    or state object is freed with the caller's last reference to it."""
    f = fgraph.jit(step_on, donate=["state"], batch={"x": Batched()}, mode="FULL", buckets=[4])
    p, refs = _params(0), []
    for _ in range(5):
        state = State()
        assert f(p, X, state)[1] is state
        refs.append(weakref.ref(state))
    del state
    gc.collect()
    # slow: the first call, the second (another object: learns to read it afresh), the third (another tensor at
    # the state's address: copied from then on); the last two replayed
    assert fast(f) == 2 and all(r() is None for r in refs)


@torch.no_grad()
def test_state_passed_anew_with_a_view_of_it_is_copied_and_says_how_to_stop_it(caplog):
    """A donated tensor other than the captured one, every call, that cannot be adopted (a view of it is kept): copied
    in and back out, counted, and logged once with the fix when a call copies more than 4 MiB."""

    def grow(x, state):
        state["h"].add_(1)
        return x * 2

    f = fgraph.jit(grow, donate=["state"], batch={"x": Batched()}, mode="FULL", buckets=[4])
    views = []
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for _ in range(4):
            state = {"h": torch.zeros((1 << 20) + 1)}  # over 4 MiB of float32
            views.append(state["h"][:1])
            assert torch.equal(f(X, state), X * 2) and bool((state["h"] == 1).all()) and views[-1].item() == 1
    assert f.stats()["total"]["copies"] == 2  # the first call reads in place, the second captures again
    assert f.stats()["total"]["copied_bytes"] == 2 * ((1 << 20) + 1) * 4  # the float32 state, copied in per call
    assert f.stats()["total"]["adopted"] == 0
    copies = [r.getMessage() for r in caplog.records if "MiB of inputs per call" in r.getMessage()]
    assert len(copies) == 1 and "pass the same tensors each call" in copies[0]


@torch.no_grad()
@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(MODES),
    st.lists(st.one_of(st.sampled_from([*CHANGES, "eval"]), st.integers(1, 4)), min_size=3, max_size=14),
)
def test_any_sequence_of_calls_and_module_changes_equals_eager(mode, ops):
    """Calls at any N between any of the changes above (and back to eval): every call equals the module's own."""
    m = Net().eval()
    f = fgraph.jit(m, batch={"x": Batched()}, mode=mode, buckets=[2, 4])
    for k, op in enumerate(ops):
        if isinstance(op, str):
            m.eval() if op == "eval" else CHANGES[op](m)
            continue
        x = torch.randn(op, 4, generator=torch.Generator().manual_seed(k))
        torch.testing.assert_close(f(x), m(x), msg=str(ops[: k + 1]))  # (a padded matmul rounds at its size)


class Sliced(nn.Module):
    """transformers' decoder loop: `self.layers[:n]` makes a new ModuleList (its layers registered into it) a call."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        return x


@torch.no_grad()
def test_a_registration_outside_the_jitted_modules_leaves_the_replay_path_on():
    m = Sliced().eval()
    f = fgraph.jit(m, batch={"x": Batched()}, buckets=[4])
    f(X), f(X)
    before = fast(f)
    Sliced()(X), nn.Linear(4, 4)  # another module's eager forward (a new list sliced) and a new module
    assert torch.equal(f(X), m(X)) and fast(f) == before + 1


@torch.no_grad()
def test_torch_compile_beside_a_jitted_module_does_not_recompile():
    """Dynamo traces torch's registration hooks inside compiled code: fgraph's hook must leave it nothing to guard on,
    or every eager registration anywhere recompiles the compiled function (transformers' own compiled decode hit its
    recompile limit beside a jitted model)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    jitted = Sliced().eval()
    f = fgraph.jit(jitted, batch={"x": Batched()}, buckets=[4])
    f(X), f(X)
    m = Sliced().eval()
    compiled = torch.compile(m, backend=backend)
    for _ in range(3):
        torch.testing.assert_close(compiled(X), m(X))
        jitted.layers.append(nn.Linear(4, 4))  # a registration fgraph watches: it ends the jitted module's proof
        f(X)
    assert len(graphs) == 1


@torch.no_grad()
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])  # (NONE captures nothing: nothing to copy)
def test_copies_of_mixed_dtypes_go_one_dtype_to_a_foreach_call(mode, monkeypatch):
    """CUDA fuses a foreach copy into multi-tensor kernels only when its lists hold one dtype; else it copies tensor by
    tensor. A cache made anew per call (bfloat16 keys, an int64 counter per layer, as transformers' StaticCache) is
    copied one foreach call per dtype, and every call still equals eager. (The CPU copies tensor by tensor whatever
    the dtypes, so there it is one call: the spec groups as on CUDA.)"""
    from fgraph.capture import _buffers

    monkeypatch.setattr(_buffers, "_fuses", lambda t: True)
    dtypes = []
    real = torch._foreach_copy_

    def spy(dst, src, **kw):
        dtypes.append({t.dtype for t in (*dst, *src)})
        return real(dst, src, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", spy)

    def step_mixed(x, cache):
        for layer in cache:
            layer["k"].add_(x)
            layer["n"].add_(1)
        return x * 2, cache

    def make(seed):  # two layers: bfloat16 keys and an int64 counter each
        g = torch.Generator().manual_seed(seed)
        return [{"k": torch.randn(4, generator=g).bfloat16(), "n": torch.tensor(seed + i)} for i in range(2)]

    f = fgraph.jit(step_mixed, donate=["cache"], mode=mode)
    for k in range(5):
        mine, theirs, x = make(k), make(k), torch.randn(4, generator=torch.Generator().manual_seed(9 + k)).bfloat16()
        assert torch.equal(f(x, mine)[0], step_mixed(x, theirs)[0])
        assert all(torch.equal(a[n], b[n]) for a, b in zip(mine, theirs) for n in "kn")
    assert f.stats()["total"]["copies"] > 0
    assert dtypes and all(len(d) == 1 for d in dtypes), dtypes


@torch.no_grad()
def test_the_replay_path_compares_no_tree_structures(monkeypatch):
    """An argument passed again is keyed by the very layout object its entry was stored with: the lookup is an
    identity check, not a walk of its tree structure (a 24-layer cache's TreeSpec compared node by node per call)."""
    import torch.utils._pytree as pytree

    f = fgraph.jit(step, donate=["state"], batch={"x": Batched()}, mode="FULL", buckets=[2, 4])
    p, state = _params(0), {"h": torch.zeros(4)}
    for x in (X, X, X[:2]):  # the second token count's slow call stores its entry beside the first's layouts
        f(p, x, state)
    compared = []
    eq = pytree.TreeSpec.__eq__
    monkeypatch.setattr(pytree.TreeSpec, "__eq__", lambda a, b: compared.append(1) or eq(a, b))
    before = fast(f)
    for x in (X[:2], X, X[:2]):
        f(p, x, state)
    assert fast(f) == before + 3 and not compared


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_a_lazy_modules_first_call_makes_its_parameters_eagerly(mode, caplog):
    """nn.LazyLinear makes its weight in its first forward: that call runs eagerly (logged, counted as `init`),
    and the calls after it are traced with the weight it made, equal to the module's own."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2)).eval()
    f = fgraph.jit(m, batch={"input": Batched()}, mode=mode, buckets=[4])
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for k, n in enumerate((3, 3, 2, 3, 3)):
            x = torch.randn(n, 5, generator=torch.Generator().manual_seed(k))
            torch.testing.assert_close(f(x), m(x))  # (a padded matmul rounds as BLAS does at its size)
    assert f.stats()["fallbacks"]["init"] == 1 and f.stats()["total"]["traces"] == 1 and fast(f) >= 1
    assert any("lazy module's parameter" in r.getMessage() for r in caplog.records)


def test_a_lazy_module_under_strict_is_a_signature_error():
    f = fgraph.jit(nn.LazyLinear(2), strict=True)
    with pytest.raises(fgraph.SignatureError, match="lazy module's parameter.*\n.*run the module once"):
        f(torch.randn(3, 5))


@pytest.mark.parametrize("mode", ["NONE", "FULL"])
def test_the_replay_path_refuses_what_python_refuses(mode):
    """A keyword-only parameter passed by position, one passed twice, an unknown keyword, a missing one: each is
    Python's TypeError (as a SignatureError), never served by the signature an earlier, valid call made."""

    def f(x, w, *, s=1.0):
        return x * w * s

    j = fgraph.jit(f, mode=mode)
    x, w = torch.ones(3), torch.full((3,), 2.0)
    for _ in range(3):  # the replay path learns the valid call
        torch.testing.assert_close(j(x, w, s=3.0), f(x, w, s=3.0))
    assert j.stats()["total"]["fast"] > 0
    for bad in [lambda: j(x, w, 3.0), lambda: j(x, w, w=w), lambda: j(x, w, t=1), lambda: j(x, s=3.0)]:
        with pytest.raises(fgraph.SignatureError, match="call it as f"):
            bad()
