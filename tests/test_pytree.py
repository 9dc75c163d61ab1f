"""Arguments and results are pytrees: containers, records, user types; errors name key paths."""

import dataclasses
from typing import NamedTuple

import attrs
import pytest
import torch
import torch.utils._pytree as pytree

import fgraph
from fgraph._pytree import flatten_with_paths
from fgraph._signature import path_str
from tests.test_semantics import MODES


@attrs.define
class Layer:
    k: torch.Tensor
    v: torch.Tensor
    page_size: int = fgraph.field(static=True, default=16)


@dataclasses.dataclass
class Cache:
    layers: list
    name: str = dataclasses.field(default="kv", metadata={"static": True})


class Pair(NamedTuple):
    a: torch.Tensor
    b: object


def test_round_trip_with_key_paths():
    t = lambda: torch.zeros(2)
    tree = {
        "state": Cache([Layer(t(), t()), Layer(t(), t(), page_size=32)]),
        "meta": Pair(t(), None),
        "xs": [t(), (t(),)],
    }
    flat, spec = flatten_with_paths(tree)
    paths = [path_str(p) for p, _ in flat]
    assert paths == [
        "state.layers[0].k",
        "state.layers[0].v",
        "state.layers[1].k",
        "state.layers[1].v",
        "meta.a",
        "meta.b",
        "xs[0]",
        "xs[1][0]",
    ]  # None is a leaf: part of the signature by value
    back = pytree.tree_unflatten([x for _, x in flat], spec)
    assert back["state"].layers[1].page_size == 32 and back["state"].name == "kv" and back["meta"].b is None


def test_static_fields_are_structure_not_leaves():
    a, b = Layer(torch.zeros(1), torch.zeros(1), 16), Layer(torch.zeros(1), torch.zeros(1), 32)
    (_, sa), (_, sb) = flatten_with_paths(a), flatten_with_paths(b)
    assert sa != sb  # a different static value is a different signature


def test_user_registered_type():
    class Box:
        def __init__(self, x):
            self.x = x

    pytree.register_pytree_node(
        Box,
        lambda b: ([b.x], None),
        lambda xs, _: Box(xs[0]),
        flatten_with_keys_fn=lambda b: ([(pytree.GetAttrKey("x"), b.x)], None),
    )
    flat, _ = flatten_with_paths({"box": Box(torch.ones(1))})
    assert path_str(flat[0][0]) == "box.x"


def test_registered_record_as_argument_and_result():
    @fgraph.jit(static=["routine"], donate=["cache"])
    def step(cache, routine):
        for layer in cache.layers:
            layer.k.add_(1)
        return cache

    cache = Cache([Layer(torch.zeros(3), torch.zeros(3))])
    out = step(cache, routine="decode")
    assert isinstance(out, Cache) and out.layers[0].k is cache.layers[0].k
    assert cache.layers[0].k.tolist() == [1.0, 1.0, 1.0]  # one call: what warm-up and capture wrote is put back


def test_flattener_is_tree_flatten_or_none_on_another_structure():
    import collections

    import torch.utils._pytree as pt

    from fgraph import register
    from fgraph._pytree import flattener, unflattener

    @register
    @attrs.define
    class Rec:
        a: torch.Tensor
        b: dict
        tag: str = fgraph.field(static=True, default="x")

    NT = collections.namedtuple("NT", "x y")
    t = torch.zeros(1)
    tree = Rec(t, {"k": [t, None, NT(t, t)], "j": (t,)})
    leaves, spec = pt.tree_flatten(tree)
    flat = flattener(spec)
    assert flat(tree) == leaves and len(leaves) == 6  # None is a leaf
    for other in (
        Rec(t, {"k": [t, None, NT(t, t)], "z": (t,)}),  # another dict key
        Rec(t, {"k": [t, None, (t, t)], "j": (t,)}),  # a tuple where a NamedTuple was
        Rec(t, {"k": [t, None, NT(t, [t])], "j": (t,)}),  # a list where a leaf was
        Rec(t, {"k": [t, None], "j": (t,)}),  # a shorter list
        Rec(t, {"k": [t, None, NT(t, t)], "j": (t,)}, tag="y"),  # another static field
        Rec(t, {"j": (t,), "k": [t, None, NT(t, t)]}),  # the keys in another order
        Rec(t, {"k": [t, None, NT(t, t)], "j": [t]}),  # a list where a tuple was
        {"a": t},
    ):
        assert flat(other) is None, other
    back = unflattener(spec)(iter(leaves))
    assert pt.tree_flatten(back)[1] == spec and back.b["k"][2].y is t


class Span:
    """A user type registered the common way: register_pytree_node without a flatten_with_keys_fn."""

    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi


pytree.register_pytree_node(Span, lambda s: ([s.lo, s.hi], None), lambda xs, _: Span(*xs))


def test_a_node_registered_without_key_paths_is_keyed_by_index():
    flat, spec = flatten_with_paths({"span": Span(torch.zeros(1), {"w": torch.zeros(2)})})
    assert [path_str(p) for p, _ in flat] == ["span[0]", "span[1]['w']"]  # torch raises a ValueError here
    back = pytree.tree_unflatten([x for _, x in flat], spec)["span"]
    assert isinstance(back, Span) and back.hi["w"].shape == (2,)


@pytest.mark.parametrize("mode", MODES)
def test_a_node_registered_without_key_paths_in_and_out(mode):
    def f(span, x):
        return Span(span.lo * x, {"y": span.hi + x})

    j = fgraph.jit(f, batch={"x": fgraph.Batched()}, mode=mode, buckets=[4])
    span = Span(torch.full((1, 2), 2.0), torch.ones(2))
    for x in (torch.arange(6.0).reshape(3, 2), torch.ones(2, 2)):
        got = j(span, x)
        with fgraph.disable_jit():
            want = j(span, x)
        assert isinstance(got, Span)
        torch.testing.assert_close(got.lo, want.lo, rtol=0, atol=0)
        torch.testing.assert_close(got.hi["y"], want.hi["y"], rtol=0, atol=0)
    assert "out[1]['y']: float32[4, 2]" in str(fgraph.explain(j, span, x))


def test_errors_name_a_keyless_node_by_index():
    f = fgraph.jit(lambda span: span.lo + span.hi)
    with pytest.raises(fgraph.FgraphError, match=r"span\[1\] requires grad and grad mode is on"):
        f(Span(torch.zeros(2), torch.zeros(2, requires_grad=True)))
    with pytest.raises(fgraph.FgraphError, match=r"span\[0\] is a sparse_coo tensor"):
        f(Span(torch.zeros(2).to_sparse(), torch.zeros(2)))


@fgraph.register
@attrs.define
class Scaled:
    w: torch.Tensor
    k: object = fgraph.field(static=True)


@pytest.mark.parametrize("mode", MODES)
def test_dict_keys_and_static_fields_are_keyed_by_type_and_value(mode):
    """1, 1.0 and True compare equal, as do 0.0 and -0.0: as statics are, a dict key or a record's static field is
    its own signature by type and value, on the slow path and the replay path alike (each called again and again)."""
    x, w = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    by_key, by_field = (
        fgraph.jit(lambda x, d: sum(v * k for k, v in d.items()), mode=mode),
        fgraph.jit(lambda x, c: x * c.k + c.w, mode=mode),
    )
    for k in [1, 1, 1.0, 1.0, True, 1, 1.0, -0.0, 0.0, 0.0, -0.0]:
        got, want = by_key(x, {k: x}), sum(v * kk for kk, v in {k: x}.items())
        assert got.dtype == want.dtype and torch.equal(got, want)
        got, want = by_field(x, Scaled(w, k)), x * k + w
        assert got.dtype == want.dtype and torch.equal(got, want)
