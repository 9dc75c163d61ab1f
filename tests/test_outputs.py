"""What a jitted call hands back, as specs against eager (issue #32): one rule for every output, at every depth of
every output container (tuple, list, dict, NamedTuple, dataclass, attrs).

An output that is a non-donated input, a lifted tensor (a closure, global or module parameter the function reads
without taking it) or a view of one is a value: a copy, never the caller's tensor nor its memory. Donated state
handed back (`return logits, state`, an in-place-updated donated tensor `x.add_(1)` returned) is the caller's own
object, as in eager. An output whose memory repeats (`x.sum(0).expand(3, 2)`) or overlaps another output's comes
back with eager's values.
"""

import dataclasses
from typing import NamedTuple

import attrs
import pytest
import torch
import torch.utils._pytree as pytree

import fgraph

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
