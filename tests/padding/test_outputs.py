"""What a jitted call hands back, as specs against eager (issue #32): one rule for every output, at every depth of
every output container (tuple, list, dict, NamedTuple, dataclass, attrs).

An output that is a non-donated input, a lifted tensor (a closure, global or module parameter the function reads
without taking it) or a view of one is a value: a copy, never the caller's tensor nor its memory. Donated state
handed back (`return logits, state`, an in-place-updated donated tensor `x.add_(1)` returned) is the caller's own
object, as in eager. An output whose memory repeats (`x.sum(0).expand(3, 2)`) or overlaps another output's comes
back with eager's values.
"""

import dataclasses
import logging
from typing import NamedTuple

import attrs
import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched
from tests import toys

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]


class Pair(NamedTuple):
    a: object
    b: object


@dataclasses.dataclass
class Rec:
    a: object
    b: object


@attrs.define
class Att:
    a: object
    b: object


CONTAINERS = {
    "tuple": lambda a, b: (a, b),
    "list": lambda a, b: [a, b],
    "dict": lambda a, b: {"a": a, "b": b},
    "NamedTuple": Pair,
    "dataclass": Rec,
    "attrs": Att,
    "nested": lambda a, b: {"k": [(a,), Pair(b, None)]},
}


def eager(fn, *args):
    with fgraph.disable_jit():
        return fn(*args)


def leaves(tree):
    return pytree.tree_leaves(tree)


def memory(t):
    return t.untyped_storage().data_ptr()


def assert_same_values(got, want):
    assert pytree.tree_structure(got) == pytree.tree_structure(want)
    for g, w in zip(leaves(got), leaves(want)):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        else:
            assert g == w


def assert_copy(t, *callers):
    assert all(t is not c and memory(t) != memory(c) for c in callers)


@pytest.mark.parametrize("container", list(CONTAINERS))
@pytest.mark.parametrize("mode", MODES)
def test_an_input_returned_in_any_container_is_a_copy(mode, container):
    """`(x, x * 2)` hands back a copy of x, as `return x` does, in every container and at any depth; the container
    comes back as itself (a NamedTuple stays one)."""
    make = CONTAINERS[container]

    def f(x):
        return make(x, x * 2)

    j = fgraph.jit(f, mode=mode)
    for k in range(3):
        x = torch.arange(6.0).reshape(3, 2) + k
        got = j(x)
        assert_same_values(got, eager(f, x))
        assert type(got) is type(eager(f, x))
        assert_copy(leaves(got)[0], x)


@pytest.mark.parametrize("container", list(CONTAINERS))
@pytest.mark.parametrize("mode", MODES)
def test_donated_state_returned_in_any_container_is_the_callers_own(mode, container):
    """Donated state handed back, as it was passed or updated in place (`s.add_(1)`), is the caller's own tensor,
    at any depth; a donated argument returned whole in a tuple or NamedTuple is the caller's own object."""
    make = CONTAINERS[container]

    def f(x, state, s):
        return make(state, s.add_(1)), x * 2

    j = fgraph.jit(f, donate=["state", "s"], mode=mode)
    for k in range(3):
        x, state, s = torch.ones(3) * k, {"h": torch.zeros(2)}, torch.zeros(2)
        (out, y) = j(x, state, s)
        want, _ = eager(f, x, {"h": torch.zeros(2)}, torch.zeros(2))
        assert_same_values(out, want)
        assert type(out) is type(want)
        got_state, got_s = leaves(out)[:2]
        assert got_state is state["h"] and got_s is s and torch.equal(s, torch.ones(2))
    if container in ("tuple", "NamedTuple"):  # `return logits, state`
        j = fgraph.jit(lambda x, state: make(x * 2, state), donate=["state"], mode=mode)
        for k in range(3):
            state = {"h": torch.zeros(2)}
            out = j(torch.ones(3) * k, state)
            assert type(out) is type(make(None, None)) and out[1] is state


@pytest.mark.parametrize("mode", MODES)
def test_a_lifted_tensor_returned_is_a_copy(mode):
    """A closure tensor or a module parameter returned (inside a tuple or not) is a copy with eager's values: it is
    not donated. Donated (donate= names its root), it is the caller's own."""
    w = torch.arange(3.0)

    def f(x):
        return w, x + 1

    got = fgraph.jit(f, mode=mode)(torch.ones(3))
    assert_same_values(got, eager(f, torch.ones(3)))
    assert_copy(got[0], w)
    assert_copy(fgraph.jit(lambda x: w, mode=mode)(torch.ones(3)), w)
    assert fgraph.jit(f, donate=["w"], mode=mode)(torch.ones(3))[0] is w

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.arange(3.0))
            self.register_buffer("n", torch.zeros(3))

        def forward(self, x):
            return self.p, x + 1

    class Counting(M):
        def forward(self, x):
            return (self.p, x + 1), {"n": self.n.add_(1)}

    m = M()
    with torch.no_grad():
        p, y = fgraph.jit(m, mode=mode)(torch.ones(3))
    torch.testing.assert_close(p, m.p.detach(), rtol=0, atol=0)
    assert_copy(p, m.p)
    m = Counting()
    with torch.no_grad():
        (p, y), n = fgraph.jit(m, donate=["self"], mode=mode)(torch.ones(3))
    torch.testing.assert_close(p, m.p.detach(), rtol=0, atol=0)
    assert torch.equal(y, torch.full((3,), 2.0)) and n["n"] is m.n and torch.equal(m.n, torch.ones(3))


def rows_and_their_sum(x):
    """Outputs whose memory repeats or overlaps: an expanded sum, a tensor and views of it, twice the same view."""
    total = x.sum(0)
    y = x * 2
    return total.expand(3, *total.shape), total, (y, y[1:], y[:1].expand(4, -1)), [x[1:], x[1:]]


@pytest.mark.parametrize("copy_outputs", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_outputs_whose_memory_repeats_or_overlaps_have_eagers_values(mode, copy_outputs):
    """`x.sum(0).expand(3, 2)` (stride 0), outputs that are views of one tensor, and views of an input at an offset,
    on every call (new values each time, padded or not): eager's values, never the caller's memory."""
    j = fgraph.jit(
        rows_and_their_sum, batch={"x": Batched(mixes=True)}, mode=mode, buckets=[4, 8], copy_outputs=copy_outputs
    )
    for k, n in enumerate([3, 4, 3, 6]):
        x = torch.arange(n * 2.0).reshape(n, 2) * (k + 1)
        got = j(x)
        assert_same_values(got, eager(rows_and_their_sum, x))
        for t in leaves(got[3]):
            assert_copy(t, x)


def spread_through_a_break(x):
    """An expanded value that one graph piece hands to the next, across an eager break."""
    e = x.sum(0).expand(4, -1)
    o = torch.empty(4, x.shape[1])
    toys.toy_scale(o, e.contiguous(), 0.5)
    return o + e


@pytest.mark.parametrize("mode", MODES)
def test_an_expanded_value_between_graph_pieces_is_eagers(mode):
    """A piece's output that is expanded (stride 0) is refreshed on every replay like any other: eager's values."""
    j = fgraph.jit(spread_through_a_break, mode=mode)
    for k in range(3):
        x = torch.arange(6.0).reshape(3, 2) * (k + 1)
        assert_same_values(j(x), eager(spread_through_a_break, x))


# -- the property: random output pytrees ---------------------------------------------------------------------------
# leaf kinds: what the function returns there, and whether the rule makes it the caller's own ("s") or a copy
LEAVES = {
    "x": lambda x, s, w, y: x,
    "x offset": lambda x, s, w, y: x[1:, 1:3],
    "x.T": lambda x, s, w, y: x.T,
    "x expanded": lambda x, s, w, y: x[0].expand(3, -1),
    "w": lambda x, s, w, y: w,
    "w view": lambda x, s, w, y: w[1:],
    "s": lambda x, s, w, y: s,
    "s.add_": lambda x, s, w, y: s.add_(1),
    "s view": lambda x, s, w, y: s[1:],
    "s expanded": lambda x, s, w, y: s[0].expand(3, -1),
    "new": lambda x, s, w, y: x * 2 + w,
    "new expanded": lambda x, s, w, y: (x + w).sum(0).expand(3, -1),
    "shared": lambda x, s, w, y: y,
    "shared view": lambda x, s, w, y: y[1:],
    "shared expanded": lambda x, s, w, y: y[:1].expand(2, -1),
}
RECORDS = {"NamedTuple": Pair, "dataclass": Rec, "attrs": Att}
SEQUENCES = {"tuple": tuple, "list": list, "dict": lambda xs: {f"k{i}": v for i, v in enumerate(xs)}}

trees = st.recursive(
    st.sampled_from(sorted(LEAVES)).map(lambda k: ("leaf", k)),
    lambda kids: st.one_of(
        st.tuples(st.sampled_from(sorted(SEQUENCES)), st.lists(kids, min_size=1, max_size=3)),
        st.tuples(st.sampled_from(sorted(RECORDS)), st.lists(kids, min_size=2, max_size=2)),
    ),
    max_leaves=6,
)


def program(spec):
    w = torch.arange(8.0).reshape(2, 4) - 3.5  # a closure tensor: lifted, not donated

    def build(node, x, s, y):
        kind, what = node
        if kind == "leaf":
            return LEAVES[what](x, s, w, y)
        kids = [build(k, x, s, y) for k in what]
        return RECORDS[kind](*kids) if kind in RECORDS else SEQUENCES[kind](kids)

    def f(x, s):
        return build(spec, x, s, x * 3)

    return f, w


def kinds(spec):
    kind, what = spec
    return [what] if kind == "leaf" else [k for kid in what for k in kinds(kid)]


@settings(max_examples=40, deadline=None)
@given(spec=trees, mode=st.sampled_from(MODES), copy_outputs=st.booleans())
def test_any_output_pytree_follows_the_one_rule(spec, mode, copy_outputs):
    """Random output pytrees mixing inputs, a closure tensor, views of inputs, expanded, shared and new tensors, in
    random containers: values equal eager's on a capturing call and on replays, and identity follows the rule:
    donated state (`s`, `s.add_(1)`) is the caller's own tensor, every input, lifted tensor or view of one a copy."""
    f, w = program(spec)
    j = fgraph.jit(f, donate=["s"], mode=mode, copy_outputs=copy_outputs)
    s, ref = torch.zeros(2, 4), torch.zeros(2, 4)
    for k in range(3):
        x = torch.arange(8.0).reshape(2, 4) * (k + 1)
        got = j(x, s)
        assert_same_values(got, eager(f, x, ref))
        assert torch.equal(s, ref)
        for kind, t in zip(kinds(spec), leaves(got)):
            if kind in ("s", "s.add_"):
                assert t is s, kind
            elif kind.startswith(("x", "w")) or copy_outputs:
                assert_copy(t, x, w, s)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_the_one_rule_and_wrapped_jitted_functions_on_cuda(mode):
    """The CUDA cases, in captured graphs: an input in a tuple is a copy, a lifted tensor in a tuple is a copy, an
    expanded output has eager's values, and a function wrapping a jitted one runs the wrapper (functools.wraps)."""
    import functools

    x = torch.arange(6.0, device="cuda").reshape(3, 2)
    w = torch.arange(3.0, device="cuda")
    pair, with_w = fgraph.jit(lambda x: (x, x * 2), mode=mode), fgraph.jit(lambda x: (w, x + 1), mode=mode)
    expanded = fgraph.jit(lambda x: x.sum(0).expand(3, 2), mode=mode)
    for _ in range(3):  # trace and capture, then replays
        got = pair(x)
        assert_same_values(got, (x, x * 2))
        assert_copy(got[0], x)
        lifted = with_w(x)
        assert_same_values(lifted, (w, x + 1))
        assert_copy(lifted[0], w)
        assert torch.equal(expanded(x), x.sum(0).expand(3, 2))
    jf = fgraph.jit(lambda t: t * t, mode=mode)

    @functools.wraps(jf)
    def twice(t):
        return jf(t) * 2

    t = torch.tensor(3.0, device="cuda")
    assert fgraph.jit(twice, mode=mode)(t).item() == 18.0
    assert fgraph.jit(torch.func.grad(jf), mode=mode)(t).item() == 6.0


TREES = st.recursive(
    st.sampled_from(["t", "e", "n"]),  # a tensor, an expanded one (its memory repeats), a non-tensor
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple)),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(TREES, st.integers(0, 2**16))
def test_a_cpu_replay_writes_every_output_where_it_was_recorded(tree, seed):
    """The CPU's stand-in for a graph replay writes each fresh output into the recorded one's memory, whatever
    nesting its outputs have (a flat tuple, as a graph module returns, or nested ones of the same length)."""
    from fgraph.capture import refiller

    g = torch.Generator().manual_seed(seed)

    def make(shape):
        def leaf(kind):
            if kind == "n":
                return 7
            return torch.randn(3, generator=g) if kind == "t" else torch.randn(1, generator=g).expand(3)

        return pytree.tree_map(leaf, shape)

    recorded, fresh = make(tree), make(tree)
    memory = [(t.data_ptr(), t.stride()) for t in pytree.tree_leaves(recorded) if isinstance(t, torch.Tensor)]
    refiller(recorded)(fresh)
    for old, new in zip(pytree.tree_leaves(recorded), pytree.tree_leaves(fresh)):
        assert old is new if not isinstance(old, torch.Tensor) else torch.equal(old, new)
    assert memory == [(t.data_ptr(), t.stride()) for t in pytree.tree_leaves(recorded) if isinstance(t, torch.Tensor)]


def test_a_string_formatted_from_a_batch_size_is_refused_and_other_strings_come_back():
    """A string is handed back as traced, where a batch size is a symbol ("s26"): one spelling a size would never be
    the call's, so it is a TraceError naming its key path; a string that is no size comes back as it is."""
    spelled = fgraph.jit(lambda x: (x + 1, {"n": f"{x.shape[0]} rows"}), batch={"x": Batched()})
    with pytest.raises(fgraph.TraceError, match=r"output \[1\]\['n'\] is a string made from a batch size"):
        spelled(torch.ones(3, 2))
    plain = fgraph.jit(lambda x: (x + 1, "s1 rows"), batch={"x": Batched()})
    assert plain(torch.ones(3, 2))[1] == "s1 rows"


def branch_on_size(x):
    return x * 2 if x.shape[0] > 4 else x * 3


ASSUMING = {  # functions whose trace at bucket 8 assumes something of N, and the N in 1..8 that break it
    "branch": (branch_on_size, {1, 2, 3, 4}),
    "len": (lambda x: (x * 2, len(x)), set(range(1, 8))),  # len() pins N to the bucket's
    "unbind": (lambda x: x.unbind(0), set(range(1, 8))),  # as many outputs as rows
    "tensor_split": (lambda x: x.tensor_split(2)[0] * 1, {1, 3, 5, 7}),  # its pieces' sizes, traced for an even N
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(ASSUMING))
def test_a_call_breaking_what_its_trace_assumed_of_n_runs_eagerly_with_eagers_answer(name, mode, caplog):
    """A trace holds at the buckets it serves; a call of N rows padded up to one is answered by its graphs only where
    every assumption the trace took about the batch size (its guards: the function's branches, len(), an op's own
    shape rules) holds at N too. Elsewhere eager takes another branch: that call runs eagerly, counted and logged
    once, with the fix. A size that keeps them is served by the replay path once one slow call has checked it."""
    fn, breaking = ASSUMING[name]
    f = fgraph.jit(fn, batch={"x": Batched()}, buckets=[8], mode=mode)
    sizes = (8, 5, 3, 5, 6, 8, 3, 8)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for n in sizes:
            x = torch.arange(2.0 * n).reshape(n, 2)
            got, want = f(x), eager(fn, x)
            assert len(leaves(got)) == len(leaves(want)), (n, got, want)
            assert_same_values(got, want)
    s = f.stats()
    assert s["fallbacks"]["branch"] == sum(n in breaking for n in sizes)
    assert "rows breaks what its bucket 8's trace assumed" in caplog.text and "add " in caplog.text
    assert s["total"]["fast"] >= 1  # (the third call of 8 at least)
