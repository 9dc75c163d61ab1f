"""The host work around a replayed call does only what the call needs, and each shortcut holds exactly where its
check says: a one-piece program replays its graph alone, copies go by a plan made once per copied set, and the
replay path's alias check re-reads the written tensors' storages whenever they are other tensors."""

import pytest
import torch

import fgraph
from fgraph import Batched

ONE_PIECE = {  # a one-piece program, and whether its top level returns its piece's outputs as they are
    "outputs as they are": (lambda x: (x * 2, x + 1), True),
    "an input among them": (lambda x: (x * 2, x), True),  # (the input is handed back outside the program)
    "in a dict": (lambda x: {"b": x + 1, "a": x * 2}, True),
    "one tensor": (lambda x: x * 2, False),
    "an output twice": (lambda x: ((y := x * 2), y), False),
    "a constant beside it": (lambda x: (x * 2, 3), False),
}


def eager(fn, *args):
    with fgraph.disable_jit():
        return fn(*args)


def same(a, b) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


@torch.no_grad()
@pytest.mark.parametrize("case", ONE_PIECE)
def test_a_one_piece_program_replays_its_graph_alone_exactly_when_it_returns_the_pieces_outputs(case):
    fn, alone = ONE_PIECE[case]
    f = fgraph.jit(fn, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    f(torch.randn(3, 4))
    (entry,) = f.entries.values()
    top, ran = entry.module, []
    entry.module = lambda *a: ran.append(1) or top(*a)
    for k, n in enumerate((3, 3, 2, 4)):
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(k))
        assert same(f(x), eager(fn, x)), case
    assert f.stats()["total"]["replays"] == 5
    assert (entry.sole is not None) is alone and len(ran) == (0 if alone else 4)  # the top level ran, or not


def step(x, cache):
    for layer in cache:
        layer["k"].add_(x)
        layer["n"].add_(1)
    return x * 2


def twin(cache):
    return [{k: t.clone() for k, t in layer.items()} for layer in cache]


@torch.no_grad()
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_copies_follow_every_new_copied_set_and_skip_a_leaf_that_is_its_buffer(mode):
    """A cache made anew per call, which views pin (so it is not adopted), is copied in and back by a plan of its
    copied positions: a position copied from a later call on makes a new plan, and a leaf that is fgraph's own buffer
    is neither copied nor counted."""
    f = fgraph.jit(step, donate=["cache"], mode=mode)
    x, counters, pins = torch.ones(4), [torch.tensor(i) for i in range(3)], []
    for k in range(4):  # new keys each call (copied from their second move on), the same counters
        mine = [{"k": torch.full((4,), float(k + i)), "n": counters[i]} for i in range(3)]
        pins.append([t[...] for layer in mine for t in layer.values()])
        theirs = twin(mine)
        assert torch.equal(f(x, mine), step(x, theirs)) and same(mine, theirs)
    (entry,) = f.entries.values()
    assert len(entry.slots.copied) == 3
    for k in range(3):  # now new counters too: copied from their second move on, beside the keys
        mine = [{"k": torch.full((4,), float(k + i)), "n": torch.tensor(k * i)} for i in range(3)]
        pins.append([t[...] for layer in mine for t in layer.values()])
        theirs = twin(mine)
        assert torch.equal(f(x, mine), step(x, theirs)) and same(mine, theirs)
    (entry,) = f.entries.values()
    slots = entry.slots
    assert len(slots.copied) == 6
    mine = [{"k": torch.full((4,), float(i)), "n": torch.tensor(i)} for i in range(3)]
    pins.append([t[...] for layer in mine for t in layer.values()])
    theirs = twin(mine)
    first = next(k for k in slots.copied if entry.paths[slots.ix[k]] == "cache[0]['k']")
    buf = slots.targets[first]
    buf.copy_(mine[0]["k"])
    mine[0]["k"] = buf  # fgraph's buffer itself, passed in: written in place, as eager writes the caller's tensor
    before = f.stats()["total"]["copied_bytes"]
    assert torch.equal(f(x, mine), step(x, theirs)) and same(mine, theirs)
    assert f.stats()["total"]["copied_bytes"] - before == 2 * 4 * 4 + 3 * 8  # the other keys and the counters


def write(x, s):
    s["h"].add_(1)
    return x * 2


@torch.no_grad()
def test_a_fresh_tensor_over_memory_the_program_writes_is_refused_after_the_written_tensors_change():
    """The replay path keeps the storages a program writes per entry while the same written tensors are passed; a
    state passed as other tensors is read again, so a fresh input over its memory is refused as the slow path
    refuses it (a stale set would let the program write under a tensor it also reads)."""
    f = fgraph.jit(write, donate=["s"], mode="PIECEWISE")
    h = torch.zeros(4)
    for _ in range(3):
        f(torch.ones(4), {"h": h})  # the state passed as new dicts: read afresh by the replay path
    fast = f.stats()["total"]["fast"]
    for _ in range(2):
        h = torch.zeros(4)  # other written tensors
        f(torch.ones(4), {"h": h}), f(torch.ones(4), {"h": h})
    assert f.stats()["total"]["fast"] > fast
    with pytest.raises(fgraph.SignatureError):
        f(h[:4], {"h": h})
