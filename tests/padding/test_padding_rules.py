"""Padding, continued (tests/padding/test_padding.py has its rules): the shapes padding meets, options checked at
jit time, host buffers, the property (equal to eager, or fgraph says where padding takes part) and random draws."""

import ast
import logging
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched
from tests.padding.test_padding import DEVICES, MODES, eager  # noqa: F401 (helpers and fixtures of test_padding.py)


# -- shapes ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_non_batch_dims_are_part_of_the_signature(mode, device):
    def scale(x):
        return x * 2 + 1

    f = fgraph.jit(scale, batch={"x": Batched()}, buckets=[8], mode=mode)
    for width in (8, 16, 8):
        x = torch.randn(5, width, device=device)
        assert torch.equal(f(x), eager(scale, x))
    assert len(f.entries) == 2 and sum(e.stats.traces for e in f.entries.values()) == 2


@pytest.mark.parametrize("mode", MODES)
def test_leaves_used_as_one_batch_must_agree(mode):
    def add(x, y):
        return x + y

    f = fgraph.jit(add, batch={"x": Batched(), "y": Batched()}, buckets=[8], mode=mode)
    with pytest.raises(RuntimeError):
        eager(add, torch.ones(3), torch.ones(5))
    for _ in range(2):  # not remembered by the replay path either
        with pytest.raises(fgraph.SignatureError, match=r"x has 3 rows along its batch axis but y has 5"):
            f(torch.ones(3), torch.ones(5))
    assert torch.equal(f(torch.ones(5), torch.ones(5)), torch.full((5,), 2.0))


@pytest.mark.parametrize("mode", MODES)
def test_independent_leaves_keep_their_own_sizes(mode):
    def both(x, y):
        return x * 2, y + 1

    f = fgraph.jit(both, batch={"x": Batched(), "y": Batched()}, buckets=[8], mode=mode)
    x, y = torch.randn(3, 2), torch.randn(5)
    got, want = f(x, y), eager(both, x, y)
    assert [t.shape for t in got] == [(3, 2), (5,)] and all(map(torch.equal, got, want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_an_output_the_size_of_the_bucket_but_not_of_the_batch_is_not_cut(mode, device):
    def with_table(x, p):
        return x * 2, p["table"] * 1  # table [4, 2]: 4 is the bucket, not the batch

    f = fgraph.jit(with_table, batch={"x": Batched()}, buckets=[4], mode=mode)
    p = {"table": torch.randn(4, 2, device=device)}
    x = torch.randn(3, 2, device=device)
    got, want = f(x, p), eager(with_table, x, p)
    assert [t.shape for t in got] == [(3, 2), (4, 2)] and all(map(torch.equal, got, want))


@pytest.mark.parametrize("mode", MODES)
def test_outputs_are_cut_along_every_batch_dim(mode):
    def shapes(x, lens):
        outer = x[:, None, 0] * x[None, :, 0]  # [N, N]
        return x.T * 1, outer, lens[1:] - lens[:-1], x.reshape(-1) * 1, x[:6] * 1  # [2, N] [N, N] [S] [2N] [min(6, N)]

    spec = {"x": Batched(), "lens": Batched(pad="ramp", extra=1)}
    f = fgraph.jit(shapes, batch=spec, buckets=[8], mode=mode)
    x, lens = torch.randn(5, 2), torch.tensor([0, 2, 5])
    got, want = f(x, lens), eager(shapes, x, lens)
    assert [t.shape for t in got] == [t.shape for t in want] == [(2, 5), (5, 5), (2,), (10,), (5, 2)]
    assert all(map(torch.equal, got, want))


@pytest.mark.parametrize("mode", MODES)
def test_sizes_returned_are_the_calls_not_the_buckets(mode):
    def sizes(x, lens):
        n = x.shape[0]
        return {"n": n, "tokens": n * 2 + 1, "seqs": lens.shape[0] - 1, "half": n / 2, "big": n > 4, "y": x * 2}

    f = fgraph.jit(sizes, batch={"x": Batched(), "lens": Batched(pad="ramp", extra=1)}, buckets=[4, 8], mode=mode)
    for n, s in [(3, 1), (6, 2), (3, 2), (8, 3)]:
        x, lens = torch.randn(n, 2), torch.tensor([0] * s + [n])
        got, want = f(x, lens), eager(sizes, x, lens)
        keys = ("n", "tokens", "seqs", "half", "big")
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
        assert [type(got[k]) for k in keys] == [type(want[k]) for k in keys]
        assert torch.equal(got["y"], want["y"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis", [0, 1])
def test_an_empty_batch_is_eagers_answer_first_or_later(mode, axis):
    """No bucket traces 0 rows: a call with none runs the function eagerly (counted as an "empty" fallback, not
    logged), before any other call and after, and gives eager's shapes and sizes."""

    def f(x):
        return x * 2, x.shape[axis]

    j = fgraph.jit(f, batch={"x": Batched(axis=axis)}, mode=mode, buckets=[1, 2, 4])
    shape = lambda n: (n, 2) if axis == 0 else (2, n)  # noqa: E731
    for n in (0, 1, 0, 3, 0):
        x = torch.randn(*shape(n))
        (y, m), (want_y, want_m) = j(x), f(x)
        assert y.shape == want_y.shape and torch.equal(y, want_y) and m == want_m == n
    assert j.stats()["fallbacks"]["empty"] == 3


def per_row(x, w):
    return torch.tanh(x @ w) * x.norm(dim=1, keepdim=True) + 1


JITTED, WEIGHTS = {}, {w: torch.randn(w, 4, generator=torch.Generator().manual_seed(w)) for w in (3, 5)}


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 16), mode=st.sampled_from(MODES), width=st.sampled_from([3, 5]))
def test_padded_calls_are_bitwise_eager(n, mode, width):
    f = JITTED.setdefault(mode, fgraph.jit(per_row, batch={"x": Batched()}, buckets=[1, 2, 4, 8, 16], mode=mode))
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, width, generator=g), WEIGHTS[width]  # weights are read by address: the same tensors
    got = f(x, w)
    assert got.shape == (n, 4) and torch.equal(got, eager(per_row, x, w))


def running(x, acc):
    """A donated batched accumulator written in place, and a size returned (both against the bucket's padding)."""
    acc.mul_(0.5).add_(torch.tanh(x))
    return acc * 2, x.shape[0] + 1


RUNNING: dict = {}


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(MODES), sizes=st.lists(st.integers(1, 12), min_size=1, max_size=6))
def test_random_sizes_with_written_batched_state_equal_eager(mode, sizes):
    spec = {"x": Batched(), "acc": Batched(pad=1.0)}
    f = RUNNING.setdefault(mode, fgraph.jit(running, donate=["acc"], batch=spec, buckets=[2, 4, 8, 16], mode=mode))
    for k, n in enumerate(sizes):
        g = torch.Generator().manual_seed(k * 31 + n)
        x, acc = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g)
        ref = acc.clone()
        (out, m), (want, wm) = f(x, acc), running(x, ref)
        assert m == wm and torch.equal(out, want) and torch.equal(acc, ref)


# -- options checked at jit time -------------------------------------------------------------------------------
def test_empty_buckets_are_an_error_at_jit_time():
    with pytest.raises(fgraph.SignatureError, match=r"buckets=\[\] leaves no size"):
        fgraph.jit(lambda x: x, batch={"x": Batched()}, buckets=[])


def test_full_decode_only_needs_the_static_routine_argument():
    with pytest.raises(fgraph.SignatureError, match="FULL_DECODE_ONLY needs the static routine argument 'routine'"):
        fgraph.jit(lambda x: x * 2, mode="FULL_DECODE_ONLY")
    with pytest.raises(fgraph.SignatureError, match="does not make it static"):
        fgraph.jit(lambda x, routine="decode": x * 2, mode="FULL_DECODE_ONLY")
    f = fgraph.jit(lambda x, routine: x * 2, static=["routine"], mode="FULL_DECODE_ONLY", batch={"x": Batched()})
    f(torch.ones(3), routine="decode")
    assert next(iter(f.entries.values())).mode is fgraph.Mode.FULL


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])  # (NONE compiles nothing; FULL_AND_PIECEWISE is these two)
def test_compiled_single_tensor_output_is_cut_like_uncompiled(mode):
    def dense(x, w):
        return torch.tanh(x @ w)

    # two buckets of one trace: the second signature compiles the same piece after the first did (compile_fx
    # rewrites the module it is given, so each compiles a copy)
    f = fgraph.jit(dense, batch={"x": Batched()}, buckets=[4, 8], mode=mode, compile=True)
    w = torch.randn(4, 4)
    for n in (3, 7, 3):
        x = torch.randn(n, 4)
        got = f(x, w)
        assert isinstance(got, torch.Tensor) and got.shape == (n, 4)
        torch.testing.assert_close(got, eager(dense, x, w))
    assert len(f.cache.traces) == 1 and len(f.entries) == 2


# -- host buffers name their device ----------------------------------------------------------------------------
FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "randn", "rand", "randint", "linspace", "eye"}


def test_every_tensor_fgraph_makes_names_its_device():
    """torch.set_default_device("cuda") (common in research code) must not move fgraph's host buffers: a pinned
    mirror made without device="cpu" is a CUDA tensor, which cannot be pinned."""
    root = pathlib.Path(fgraph.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and node.func.attr in FACTORIES
                and not any(k.arg == "device" for k in node.keywords)
            ):
                missing.append(f"{path.relative_to(root)}:{node.lineno}")
    assert missing == []


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_default_device_cuda_runs_every_mode(mode):
    from tests import toys

    params, state, batch = toys.make(n=5)  # made on the CPU (a CPU generator), then moved
    params, state = {"w": params["w"].cuda()}, {"count": state["count"].cuda()}
    torch.set_default_device("cuda")
    try:
        f = toys.jitted(mode=mode, buckets=[1, 8])
        for n in (5, 1, 5):
            x = batch["x"][:n]  # host inputs: fgraph pads them into its pinned mirrors and copies them over
            out, _ = f(params, state, {"x": x})
            want, _ = eager(toys.step, params, {"count": torch.zeros((), dtype=torch.int64)}, {"x": x.cuda()})
            assert out.device.type == "cuda" and out.shape == (n, 8)
            torch.testing.assert_close(out, want)
        assert state["count"].item() == 3
    finally:
        torch.set_default_device(None)


def test_a_batch_axis_counted_from_the_end_is_an_error_where_it_is_declared():
    """One Batched may cover leaves of different ranks, so a negative axis would name different dims."""
    with pytest.raises(fgraph.SignatureError, match=r"Batched\(axis=-1, extra=0\): both must be non-negative ints"):
        Batched(axis=-1)
    with pytest.raises(fgraph.SignatureError, match="non-negative"):
        Batched(extra=-1)


# -- the property: equal to eager, or fgraph says where padding takes part -------------------------------------
W3 = torch.linspace(-1, 1, 9).reshape(3, 3)
ROW_OPS = {  # (n, 3) -> (n, 3), each row on its own
    "affine": lambda x: x * 2 + 1,
    "matmul": lambda x: x @ W3,
    "softmax_features": lambda x: torch.softmax(x, -1),
    "flip_features": lambda x: x.flip(-1),
    "pad_front": lambda x: torch.nn.functional.pad(x, (0, 0, 1, 0))[1:],
    "interleave_and_back": lambda x: torch.stack([x, x + 1], 1).reshape(-1, 3)[1::2],
    "scatter_rows": lambda x: torch.zeros_like(x).index_copy_(0, torch.arange(x.shape[0]), x),
}
MIXING_OPS = {  # (n, 3) -> (m, 3), rows combined or moved along the batch axis
    "centered": lambda x: x - x.mean(0),
    "cumsum": lambda x: x.cumsum(0),
    "sort": lambda x: torch.sort(x, 0).values,
    "flip": lambda x: x.flip(0),
    "roll": lambda x: x.roll(1, 0),
    "gram": lambda x: x @ (x.T @ x),
    "drop_last": lambda x: x[:-1],
    "tile": lambda x: x.repeat(2, 1),
    "stacked": lambda x: torch.stack([x, -x]).reshape(-1, 3),
    "pad_end": lambda x: torch.nn.functional.pad(x, (0, 0, 0, 1), value=5.0),
    "conv": lambda x: torch.nn.functional.conv1d(x.T[None], torch.ones(3, 3, 3), padding=1)[0].T,
    "last_pair": lambda x: x.split(2, 0)[-1],
    "previous_rows": lambda x: x[torch.arange(x.shape[0]) - 1],
    "last_by_index": lambda x: x[torch.tensor([-1, 0])],
}


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    ops=st.lists(st.sampled_from(sorted(ROW_OPS) + sorted(MIXING_OPS)), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    mode=st.sampled_from(["NONE", "FULL"]),
)
def test_random_compositions_equal_eager_or_say_where_padding_takes_part(ops, sizes, mode):
    """Any composition of per-row and row-mixing ops, called with sizes that are rarely buckets: every result equals
    eager's, or fgraph logged "padding is visible" for the function, or it raised an fgraph error. Never a silent
    difference, never a torch error."""
    table = {**ROW_OPS, **MIXING_OPS}

    def composed(x):
        for name in ops:
            x = table[name](x)
        return x * 1

    f = fgraph.jit(composed, batch={"x": Batched(pad=0.5)}, buckets=[1, 4, 8], mode=mode)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda r: logged.append(r.getMessage())
    logging.getLogger("fgraph").addHandler(handler)
    try:
        for n in sizes:
            x = torch.linspace(-2, 3, n * 3).reshape(n, 3)
            try:
                got = f(x)
            except fgraph.FgraphError:
                return
            try:
                want = eager(composed, x)
            except RuntimeError:  # an op undefined at this size (a convolution over 0 rows): nothing to compare
                continue
            said = any("padding is visible" in m for m in logged)
            assert said or (got.shape == want.shape and torch.allclose(got, want)), (ops, n)
    finally:
        logging.getLogger("fgraph").removeHandler(handler)


# -- random draws: an op whose arguments turn its randomness off draws nothing ------------------------------------
def eval_mode_noise(q, x):
    """nanoGPT in eval: attention with dropout_p=0; dropout and rrelu with training off."""
    att = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0, is_causal=True)
    kept, _ = torch.ops.aten.native_dropout(x, 0.5, False)
    return att, kept + torch.nn.functional.rrelu(x, training=False)


@pytest.mark.parametrize("mode", MODES)
def test_randomness_turned_off_by_its_arguments_is_not_a_random_draw(mode, caplog):
    j = fgraph.jit(eval_mode_noise, batch={"x": Batched()}, mode=mode, buckets=[4])
    q, x = torch.randn(1, 2, 3, 4), torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        got = j(q, x)
    for g, w in zip(got, eager(eval_mode_noise, q, x)):
        torch.testing.assert_close(g, w)
    assert "random generator" not in caplog.text
    assert "random:" not in str(fgraph.explain(j, q, x))


def training_noise(q, x):
    att = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    kept, _ = torch.ops.aten.native_dropout(x, 0.0, True)  # p=0 but training: the generator still advances
    return att, kept + torch.nn.functional.rrelu(x, training=True)


def test_real_random_draws_stay_reported(caplog):
    j = fgraph.jit(training_noise, batch={"x": Batched()}, mode="NONE", buckets=[4])
    q, x = torch.randn(1, 2, 3, 4), torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        j(q, x)
    logged = [r.getMessage() for r in caplog.records if "random generator" in r.getMessage()]
    assert len(logged) == 3  # attention's dropout, native_dropout, rrelu: one per line
    assert str(fgraph.explain(j, q, x)).count("random:") == 3
