"""Slots: donated state passed anew each call (a cache transformers' generate makes per generate) is adopted: its
contents move into fgraph's buffer once and the caller's tensor is set onto the buffer, so later calls read and
write it in place. Only a tensor nothing else sees the memory of is adopted; every call and every state, kept or
not, equals eager's."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph

MODES = ["PIECEWISE", "FULL"]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return request.param


def grow(x, state):
    """Writes its donated state (state["h"] += x) and returns what it read: x [4], state {"h": [4]} -> [4]."""
    state["h"].add_(x)
    return state["h"] * 2


def new_state(device, v: float) -> dict:
    return {"h": torch.full((4,), float(v), device=device)}


def twin(state: dict) -> dict:
    return {k: t.clone() for k, t in state.items()}


def adopted(f) -> int:
    return f.stats()["total"]["adopted"]


def on_buffer(mode, device):
    """A jitted `grow` whose state slot is fgraph's buffer by now (three new states: captured, captured again, moved
    onto it), its input, and the last state (adopted)."""
    f = fgraph.jit(grow, donate=["state"], mode=mode)
    x = torch.arange(4.0, device=device)
    for i in range(3):
        last = new_state(device, i)
        f(x, last)
    return f, x, last


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_state_passed_anew_is_adopted_then_read_in_place(mode, device):
    f = fgraph.jit(grow, donate=["state"], mode=mode)
    x = torch.arange(4.0, device=device)
    for i in range(6):
        mine = new_state(device, i)
        theirs = twin(mine)
        assert torch.equal(f(x, mine), grow(x, theirs)) and torch.equal(mine["h"], theirs["h"])
    # the first state is captured, the second captured again in place, the third moves into fgraph's buffer: from
    # then on each new state is adopted (one copy), never copied in and back out per call
    assert adopted(f) == 4 and f.stats()["total"]["copies"] == 0
    for _ in range(3):  # the same state again: in place
        assert torch.equal(f(x, mine), grow(x, theirs)) and torch.equal(mine["h"], theirs["h"])
    assert adopted(f) == 4 and f.stats()["total"]["copies"] == 0


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_states_kept_alive_keep_their_contents_and_work_again(mode, device):
    """The tensor the buffer held before gets a copy of its contents when the next one is adopted."""
    f = fgraph.jit(grow, donate=["state"], mode=mode)
    x = torch.arange(4.0, device=device)
    kept = [(s, twin(s)) for s in (new_state(device, 10.0 * i) for i in range(5))]
    for mine, theirs in kept:
        assert torch.equal(f(x, mine), grow(x, theirs))
    for mine, theirs in [*kept, *reversed(kept)]:  # each one again, in turn
        assert all(torch.equal(m["h"], t["h"]) for m, t in kept)
        assert torch.equal(f(x, mine), grow(x, theirs))
    assert all(torch.equal(m["h"], t["h"]) for m, t in kept)


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_a_state_with_a_view_of_it_is_copied_not_adopted(mode, device):
    """A view of the caller's tensor would go stale if the tensor moved onto the buffer: it is copied in and back."""
    f, x, _ = on_buffer(mode, device)
    before = adopted(f)
    mine = new_state(device, 5.0)
    view, theirs = mine["h"][1:], twin(mine)
    assert torch.equal(f(x, mine), grow(x, theirs))
    assert torch.equal(view, theirs["h"][1:]) and torch.equal(mine["h"], theirs["h"])
    assert adopted(f) == before and f.stats()["total"]["copies"] == 1


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_a_view_of_the_adopted_state_keeps_it_on_the_buffer(mode, device):
    """The buffer's holder is not moved off it while a view of it is alive: the next new state is copied instead."""
    f, x, held = on_buffer(mode, device)
    view, held_twin = held["h"][1:], twin(held)
    mine = new_state(device, 7.0)
    theirs = twin(mine)
    assert torch.equal(f(x, mine), grow(x, theirs)) and torch.equal(mine["h"], theirs["h"])
    assert torch.equal(held["h"], held_twin["h"]) and torch.equal(view, held_twin["h"][1:])
    assert f.stats()["total"]["copies"] == 1


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_another_graph_reads_in_place_is_never_adopted(mode, device):
    """Its graph read its memory by address: moving the tensor onto a buffer would leave that graph reading freed
    memory."""
    f, x, _ = on_buffer(mode, device)
    read = fgraph.jit(lambda state: state["h"] + 1, mode=mode)
    before = adopted(f)
    mine = new_state(device, 3.0)
    assert torch.equal(read(mine), mine["h"] + 1)  # captured reading mine["h"] in place
    theirs = twin(mine)
    assert torch.equal(f(x, mine), grow(x, theirs)) and torch.equal(mine["h"], theirs["h"])
    assert adopted(f) == before
    assert torch.equal(read(mine), theirs["h"] + 1)


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_an_adopted_state_restrided_in_place_is_read_as_it_reads_now(mode, device):
    """`t_()` keeps a tensor's address and swaps its strides: the graphs, which read the buffer's layout, would read it
    transposed. It is copied in and back as it reads now, and moved off the buffer without losing its layout."""
    f = fgraph.jit(grow, donate=["state"], mode=mode)
    x = torch.arange(4.0, device=device).reshape(2, 2)
    for i in range(3):
        mine = {"h": torch.arange(4.0, device=device).reshape(2, 2) * (i + 1)}
        theirs = twin(mine)
        f(x, mine), grow(x, theirs)
    mine["h"].t_(), theirs["h"].t_()
    for _ in range(2):
        assert torch.equal(f(x, mine), grow(x, theirs)) and torch.equal(mine["h"], theirs["h"])
        assert mine["h"].stride() == theirs["h"].stride() == (1, 2)


def mix(x, state):
    """Two donated tensors, both written: state {"a": [4], "b": [4]} -> [4]."""
    state["a"].add_(x)
    state["b"].mul_(2)
    return state["a"] - state["b"]


@torch.no_grad()
@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_on_one_buffer_passed_for_another_slot_is_read_as_it_was(mode, device):
    """A tensor adopted for one slot (pinned there by a view), passed for the other slot beside a new one for its
    own: each buffer gets what the call passed for it, not what another copy just wrote."""
    f = fgraph.jit(mix, donate=["state"], mode=mode)
    x = torch.arange(4.0, device=device)
    for i in range(3):
        mine = {"a": torch.full((4,), float(i), device=device), "b": torch.full((4,), -float(i), device=device)}
        theirs = twin(mine)
        f(x, mine), mix(x, theirs)
    view = mine["a"][1:]  # pins it on its buffer
    mine = {"a": torch.full((4,), 9.0, device=device), "b": mine["a"]}
    theirs = {"a": torch.full((4,), 9.0, device=device), "b": theirs["a"]}
    assert torch.equal(f(x, mine), mix(x, theirs))
    assert torch.equal(mine["a"], theirs["a"]) and torch.equal(mine["b"], theirs["b"])
    assert torch.equal(view, theirs["b"][1:])


@torch.no_grad()
@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(MODES),
    st.lists(
        st.tuples(st.sampled_from(["new", "again", "view", "write", "drop"]), st.integers(0, 3)),
        min_size=3,
        max_size=16,
    ),
)
def test_any_sequence_of_states_equals_eager(mode, ops):
    """New states, states passed again, views taken of them, writes by the caller between calls, states let go: every
    call's answer and every state still held equal eager's."""
    f = fgraph.jit(grow, donate=["state"], mode=mode)
    x = torch.arange(4.0)
    pool, views = [], []  # (mine, theirs); (view of mine, the same view of theirs)
    for k, (op, i) in enumerate(ops):
        if op == "new" or not pool:
            pool.append((new_state("cpu", float(k)), new_state("cpu", float(k))))
            i = len(pool) - 1
        i %= len(pool)
        mine, theirs = pool[i]
        if op == "view":
            views.append((mine["h"][i % 4 :], theirs["h"][i % 4 :]))
        elif op == "write":
            mine["h"].mul_(-1), theirs["h"].mul_(-1)
        elif op == "drop" and len(pool) > 1:
            del pool[i]
            continue
        assert torch.equal(f(x, mine), grow(x, theirs)), ops[: k + 1]
        assert all(torch.equal(m["h"], t["h"]) for m, t in pool), ops[: k + 1]
        assert all(torch.equal(m, t) for m, t in views), ops[: k + 1]


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_a_buffer_shared_by_signatures_is_vacated_before_another_tensor_is_copied_in(mode):
    """Three state dicts in turn over two signatures: C adopted onto fgraph's shared buffer, then A moved into that
    buffer by the other signature. C moves off it first, with its contents, as eager leaves C alone."""

    def step(x, s, k):
        s["a"].add_(x[0])
        return x * k

    f = fgraph.jit(step, mode=mode, donate=["s"], static=["k"], batch={"x": fgraph.Batched()}, buckets=[2, 8])
    A, B, C = ({"a": torch.zeros(3)} for _ in range(3))
    f(torch.full((8, 3), 1.0), A, 2.0)  # (k=2.0, bucket 8) reads A in place
    f(torch.full((8, 3), 1.0), B, 2.0)  # another tensor there: captured again over B
    f(torch.full((2, 3), 10.0), A, 1)  # (k=1, bucket 2) reads A in place
    f(torch.full((8, 3), 100.0), C, 2.0)  # a third: copied slot, C adopted onto the shared buffer
    f(torch.full((2, 3), 100.0), C, 1)  # (k=1) captured again over C, on that buffer
    f(torch.full((2, 3), 1000.0), A, 1)  # (k=1) A moves into the shared buffer: C must keep its 200
    assert C["a"].tolist() == [200.0] * 3 and A["a"].tolist() == [1011.0] * 3 and B["a"].tolist() == [1.0] * 3
