"""An argument the replay path reads afresh (it was passed as another object before: a cache generate makes per
call) is proven by identity from its second call as the same object on, as an argument passed again to the slow
path is: every change to it between calls is still seen, every call equals eager, and the object is let go with the
caller's last reference to it."""

import copy
import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from tests.function.test_replay_path import MODES, fast


class Layer:  # plain classes, as transformers' StaticCache and its layers: seen into as donated state
    def __init__(self, seed: int):
        self.k = torch.randn(4, generator=torch.Generator().manual_seed(seed))
        self.n = torch.zeros((), dtype=torch.int64)
        self.scale = 2


class Cache:
    def __init__(self, seed: int, layers: int = 2):
        self.layers = [Layer(seed + i) for i in range(layers)]


def step(x, cache):
    y = x
    for layer in cache.layers:
        layer.k.add_(x)
        layer.n.add_(1)
        y = y + layer.k * layer.scale
    return y, cache


def same(a: Cache, b: Cache) -> bool:
    return len(a.layers) == len(b.layers) and all(
        torch.equal(p.k, q.k) and torch.equal(p.n, q.n) and p.scale == q.scale for p, q in zip(a.layers, b.layers)
    )


CHANGES = {  # each a change to the cache object between calls, made alike to the eager twin
    "call": None,
    "a new cache": None,
    "a tensor attribute replaced": lambda c, k: setattr(c.layers[0], "k", torch.full((4,), float(k))),
    "a tensor replaced in the list's layer": lambda c, k: setattr(c.layers[-1], "n", torch.tensor(k)),
    "a layer appended": lambda c, k: c.layers.append(Layer(k)),
    "a layer replaced": lambda c, k: c.layers.__setitem__(0, Layer(k)),
    "a layer removed": lambda c, k: len(c.layers) > 1 and c.layers.pop(),
    "a static attribute changed": lambda c, k: setattr(c.layers[0], "scale", 3 + k % 2),
    "an attribute added": lambda c, k: setattr(c, "extra", torch.ones(1)),
    "the list replaced": lambda c, k: setattr(c, "layers", list(c.layers)),
    "written in place": lambda c, k: c.layers[0].k.mul_(2),
}


@torch.no_grad()
@settings(max_examples=30, deadline=None)
@given(st.sampled_from(MODES), st.lists(st.sampled_from(list(CHANGES)), min_size=4, max_size=16))
def test_any_changes_to_state_passed_again_equal_eager(mode, ops):
    """Calls on one cache object, on a new one each generate, with any change to it between calls: every output
    and the state after every call equal eager's (each call a new input tensor, as generate passes)."""
    f = fgraph.jit(step, donate=["cache"], mode=mode)
    mine, theirs = Cache(0), Cache(0)
    for k, op in enumerate(["a new cache", "call", "a new cache", "call", "call", *ops]):
        if op == "a new cache":
            mine, theirs = Cache(10 * k), Cache(10 * k)
        elif CHANGES[op] is not None:
            CHANGES[op](mine, k), CHANGES[op](theirs, k)
        x = torch.randn(4, generator=torch.Generator().manual_seed(k))
        got, back = f(x, mine)
        want, _ = step(x, theirs)
        assert back is mine and torch.equal(got, want) and same(mine, theirs), (k, op)


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_state_made_anew_per_generate_is_proven_by_identity_on_its_later_steps(mode):
    """A cache made anew per generate, passed to each of its steps: its first two steps read it afresh, the later
    ones prove it by identity (its reader flattens nothing), and every step equals eager."""
    f = fgraph.jit(step, donate=["cache"], mode=mode)
    for g in range(4):
        mine, theirs = Cache(g), Cache(g)
        reads = []
        if g == 3:
            readers = f.fastpath.readers["cache"]
            for i, r in enumerate(readers):
                readers[i] = lambda v, r=r: reads.append(1) or r(v)
                readers[i].spec = r.spec
        for k in range(5):
            x = torch.randn(4, generator=torch.Generator().manual_seed(k))
            assert torch.equal(f(x, mine)[0], step(x, theirs)[0]) and same(mine, theirs), (g, k)
    assert len(reads) == 2 and fast(f) >= 10


@torch.no_grad()
def test_state_proven_by_identity_is_let_go_with_the_callers_last_reference():
    f = fgraph.jit(step, donate=["cache"], mode="FULL")
    refs = []
    for g in range(4):
        cache = Cache(g)
        for _ in range(4):
            f(torch.ones(4), cache)
        refs.append(weakref.ref(cache))
    assert "cache" in f.fastpath.layouts and f.fastpath.layouts["cache"].weak  # the last one, proven by identity
    del cache
    gc.collect()
    assert all(r() is None for r in refs) and "cache" not in f.fastpath.layouts


class Node:  # a plain object seen into
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _contents(x) -> list:
    """Every object a tree holds, node by node in a walk (names, values, items): what a guard must see changed."""
    if isinstance(x, dict):
        return [x, len(x), *x, *[y for v in x.values() for y in [v, *_contents(v)]]]
    if isinstance(x, Node):
        d = vars(x)
        return [x, len(d), *d, *[y for v in d.values() for y in [v, *_contents(v)]]]
    if isinstance(x, list):
        return [x, len(x), *[y for v in x for y in [v, *_contents(v)]]]
    return []


def _nodes(x) -> list:
    return [y for y in _contents(x) if isinstance(y, (dict, list, Node))]


EDITS = st.sampled_from(["none", "append", "pop", "replace", "move", "setattr", "delattr", "same int", "new node"])


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.just("t"),
        lambda kids: st.one_of(
            st.lists(kids, max_size=3),
            st.dictionaries(st.sampled_from("abc"), kids, max_size=3),
            st.dictionaries(st.sampled_from("xyz"), kids, max_size=3).map(lambda d: Node(**d)),
        ),
        max_leaves=8,
    ),
    st.lists(st.tuples(EDITS, st.integers(0, 30)), max_size=3),
)
def test_a_guard_holds_exactly_while_every_node_holds_the_same_objects(shape, edits):
    """guard_for's check, against a walk of the tree: true exactly while every node (list, dict, object seen into)
    holds the same objects in the same places: an item moved from one node to the next, which keeps the walk's total
    size, is seen as well."""
    from fgraph._pytree import flatten_with_paths, see_into
    from fgraph.function import guard_for

    def build(s):
        if s == "t":
            return torch.zeros(1)
        if isinstance(s, list):
            return [build(v) for v in s]
        if isinstance(s, Node):
            return Node(**{k: build(v) for k, v in vars(s).items()})
        return {k: build(v) for k, v in s.items()}

    tree = Node(root=build(shape), n=2)
    see_into(tree)
    guard = guard_for(tree, flatten_with_paths(tree)[1])
    before = _contents(tree)
    for how, k in edits:
        nodes = [x for x in _nodes(tree) if x is not tree]
        lists = [x for x in nodes if isinstance(x, list)]
        objs = [x for x in [tree, *nodes] if isinstance(x, Node)]
        if how == "append" and lists:
            lists[k % len(lists)].append(torch.ones(1))
        elif how == "pop" and lists and lists[k % len(lists)]:
            lists[k % len(lists)].pop()
        elif how == "replace" and lists and lists[k % len(lists)]:
            lists[k % len(lists)][0] = torch.ones(1)
        elif how == "move" and len(lists) > 1 and lists[k % len(lists)]:  # the last item to the next list's front
            a, b = lists[k % len(lists)], lists[(k + 1) % len(lists)]
            b.insert(0, a.pop())
        elif how == "setattr":
            objs[k % len(objs)].x = torch.ones(1)
        elif how == "delattr" and vars(o := objs[k % len(objs)]):
            delattr(o, next(iter(vars(o))))
        elif how == "same int":
            tree.n = 2  # the same object: nothing changed
        elif how == "new node" and hasattr(tree, "root"):  # the same contents in a new container
            tree.root = copy.copy(tree.root)
    after = _contents(tree)
    same = len(before) == len(after) and all(a is b for a, b in zip(before, after))
    assert (guard is None or guard(tree)) == same
