"""fgraph/_fx.py's graph passes: `share_repeats` computes a repeated pure value once, and nothing else."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from fgraph._fx import share_repeats

aten = torch.ops.aten


def traced(fn, *args):
    return make_fx(fn)(*args)


def calls(gm, op) -> int:
    return sum(n.target is op for n in gm.graph.nodes)


def merged_and_equal(fn, *args) -> tuple[int, torch.fx.GraphModule]:
    """share_repeats on fn's graph: (nodes merged, the graph), its answer checked against fn's on fresh copies."""
    gm = traced(fn, *[a.clone() for a in args])
    n = share_repeats(gm)
    want_args, got_args = [a.clone() for a in args], [a.clone() for a in args]
    want, got = fn(*want_args), gm(*got_args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_args, want_args, rtol=0, atol=0)  # (and what it wrote in place)
    return n, gm


def test_a_mask_converted_to_a_bias_at_every_layer_is_converted_once():
    def layers(mask, x):  # (what F.scaled_dot_product_attention makes of a boolean mask, once per layer)
        for _ in range(3):
            x = x + torch.where(mask, 0.0, float("-inf")).clamp(min=-1e4)
        return x

    n, gm = merged_and_equal(layers, torch.rand(2, 5) > 0.5, torch.randn(2, 5))
    assert calls(gm, aten.where.self) == 1 and calls(gm, aten.clamp.default) == 1
    assert calls(gm, aten.add.Tensor) == 3  # (each layer's add reads a different x)
    assert n >= 4


def test_a_shared_value_is_made_as_early_as_what_it_reads_allows():
    # (so that every part of a graph cut later finds it made: an MoE layer's index arange, first made after a cut)
    def layers(mask, x):
        for _ in range(2):
            x = x.sin() * 2
            idx = torch.arange(5)  # (reads nothing)
            x = x + torch.where(mask, 0.0, -1.0)[:, idx]  # (reads the mask, then the arange)
            x = x * x.sum()  # (not shared: each layer's reads its own x)
            x = x + (x.sum() + torch.where(mask, 0.0, -1.0).sum())
        return x

    n, gm = merged_and_equal(layers, torch.rand(2, 5) > 0.5, torch.randn(2, 5))
    order = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    first_work = order.index(aten.sin.default)
    assert n >= 3 and order.count(aten.arange.start) + order.count(aten.arange.default) == 1
    assert {aten.where.self, aten.index.Tensor} <= set(order[:first_work])  # (made before the first layer's work)


def test_a_value_read_again_after_an_in_place_write_is_read_again():
    def step(buf, x):
        before = buf * 2
        buf.add_(x)
        return before + buf * 2

    n, gm = merged_and_equal(step, torch.zeros(3), torch.ones(3))
    assert n == 0 and calls(gm, aten.mul.Tensor) == 2


def test_a_view_read_again_after_its_buffer_is_written_is_read_again():
    def step(buf, x):
        row = buf[0]  # (the trace reads the same view node before and after the write)
        before = row * 2
        buf.add_(x)
        return before + row * 2

    n, gm = merged_and_equal(step, torch.zeros(2, 3), torch.ones(3))
    assert n == 0 and calls(gm, aten.mul.Tensor) == 2


def test_two_fresh_buffers_each_written_stay_two():
    def step(x):
        a, b = torch.zeros(3), torch.zeros(3)
        a.add_(x)
        b.sub_(x)
        return a, b

    n, gm = merged_and_equal(step, torch.ones(3))
    assert n == 0 and calls(gm, aten.zeros.default) == 2


def test_random_values_are_drawn_each_time():
    def step(x):
        return x + torch.rand(3), x + torch.rand(3)

    gm = traced(step, torch.ones(3))
    assert share_repeats(gm) == 0 and calls(gm, aten.rand.default) == 2


@pytest.mark.parametrize("view", [False, True], ids=["itself", "through a view"])
def test_two_outputs_stay_two_tensors(view):
    def step(x):
        return ((x * 2).view(3, 1), (x * 2).view(3, 1)) if view else (x * 2, x * 2)

    n, gm = merged_and_equal(step, torch.ones(3))
    a, b = gm(torch.ones(3))
    assert n == 0 and a.data_ptr() != b.data_ptr()


def test_arguments_equal_in_value_but_not_in_type_or_sign_stay_apart():
    def step(x, y):
        return (x + 1) * (x + 1.0), (y * 0.0).sum() + (y * -0.0).sum()  # int + 1 is int; int + 1.0 is float

    n, gm = merged_and_equal(step, torch.arange(3), -torch.ones(3))
    assert n == 0 and calls(gm, aten.add.Tensor) == 3


# a random program over three buffers (an input written in place; two made alike in the program) and a mask: each
# step reads or writes one of them (or reads nothing), often the same step as before, so that repeats and writes
# interleave, and shared values move up past writes
STEPS = {
    "double": lambda env: env.__setitem__("out", env["out"] + env["buf"] * 2),
    "row": lambda env: env.__setitem__("out", env["out"] + env["buf"][0]),
    "bias": lambda env: env.__setitem__("out", env["out"] + torch.where(env["mask"], 0.0, -1.0)),
    "index": lambda env: env.__setitem__("out", env["out"] * torch.arange(3.0)),  # (reads nothing: made first)
    "scaled": lambda env: env.__setitem__("out", env["out"] + env["made"] * 0.5),
    "write": lambda env: env["buf"].add_(1.0),
    "write_row": lambda env: env["buf"][1].mul_(-1.0),
    "write_made": lambda env: env["made"].sub_(env["out"]),
    "scaled_other": lambda env: env.__setitem__("out", env["out"] + env["other"] * 0.5),
    "write_other": lambda env: env["other"].add_(env["out"]),
}


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=12))
def test_a_random_program_of_repeats_and_writes_gives_the_same_answer_with_its_repeats_shared(steps):
    def program(buf, mask):
        env = {"buf": buf, "mask": mask, "out": torch.zeros(2, 3), "made": torch.ones(2, 3), "other": torch.ones(2, 3)}
        for s in steps:
            STEPS[s](env)
        return env["out"], env["made"], env["other"]

    merged_and_equal(program, torch.randn(2, 3), torch.rand(2, 3) > 0.5)


def test_two_constant_tensors_that_print_alike_stay_apart():
    a, b = torch.zeros(2000), torch.zeros(2000)
    b[1000] = 1.0  # (in the middle: both print as tensor([0., 0., 0.,  ..., 0., 0., 0.]))
    assert repr(a) == repr(b)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    p, q = graph.call_function(aten.add.Tensor, (x, a)), graph.call_function(aten.add.Tensor, (x, b))
    graph.output(graph.call_function(aten.add.Tensor, (p, q)))
    gm = torch.fx.GraphModule({}, graph)
    assert share_repeats(gm) == 0 and calls(gm, aten.add.Tensor) == 3
