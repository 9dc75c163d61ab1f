"""Padding is visible, never silent: every call is padded to a bucket, and a jitted function returns what the
unpadded function returns (eager is the oracle), or fgraph says where padding takes part.

  - outputs are cut back along every dim whose traced size is a batch size, and only those dims
  - leaves the function uses as one batch must agree on their size (SignatureError naming both)
  - non-batch dims of Batched leaves are part of the signature (a new width is a new trace)
  - ops that combine rows along the batch axis are logged once at trace time with the user's line, and listed by
    fgraph.explain, unless declared Batched(mixes=True); the example models report none
  - an output no cut can bring back to the call's rows is a TraceError, never a torch error
  - as a property: random compositions of per-row and row-mixing ops equal eager, or fgraph says where padding
    takes part, or raises its own error
Sizes below are never buckets, so every call is padded.
"""

import logging

import attrs
import pytest
import torch

import fgraph
from fgraph import Batched

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def eager(fn, *args, **kw):
    with fgraph.disable_jit():
        return fn(*args, **kw)


# -- ops that mix rows: each on the line after its def, so the expected source line is co_firstlineno + 1 ------
def centered(x):
    return x - x.mean(0)


def softmax_over_rows(x):
    return torch.softmax(x, 0)


def running_total(x):
    return x.cumsum(0)


def sorted_rows(x):
    return torch.sort(x, 0).values


def gram(x):
    return x.T @ x


def last_row(x):
    return x[-1] * 1


def joined(x):
    return torch.cat([x, x + 1])


def branch_on_size(x):
    return x * 2 if x.shape[0] > 4 else x


def row_at_size(x):  # an index computed from the batch size: torch makes it a number, fixing the size
    return x[x.shape[0] - 1] * 1


def reversed_rows(x):
    return x.index_select(0, torch.arange(x.shape[0] - 1, -1, -1)) * 1


def tail_of_a_table(x):  # rows of a tensor without the batch axis from a start computed from the batch size
    return torch.arange(10.0)[x.shape[0] :].sum() * x


def tiled(x):
    return x.repeat(2, 1)


def transposed_flat(x):
    return x.T.reshape(-1) * 1


def appended(x):
    return torch.nn.functional.pad(x, (0, 0, 0, 1), value=5.0)


def convolved(x):  # a window along the tokens (x as channels x positions)
    return torch.nn.functional.conv1d(x.T[None], torch.ones(3, 3, 3), padding=1)[0].T


def scaled_by_size(x):  # the batch size as a value: the bucket's
    return x * x.shape[0]


def filled_with_size(x):  # the batch size as a scalar argument of an op: the bucket's
    return torch.full_like(x, x.shape[0]) + x


def ramp_to_size(x):
    return torch.linspace(0, x.shape[0], 3)[None] + x


def rolled_by_size(x):  # a shift by the batch size, along another axis
    return x.roll(x.shape[0], 1)


def new_full_of_size(x):  # the batch size as a Scalar argument of an op of another kind (a factory, by shape)
    return x.new_full((2,), x.shape[0])


def size_as_alpha(x):  # ... of a contraction
    return torch.addmm(x, x, torch.eye(3), alpha=x.shape[0])


def index_filled_with_size(x):  # ... of a scatter
    return x.index_fill(1, torch.tensor([0]), x.shape[0])


def halves(x):  # pieces sized from the batch size: the second starts at the bucket's middle row, not the call's
    return x.split([x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])


def last_row_masked(x):
    return torch.where((torch.arange(x.shape[0]) == x.shape[0] - 1)[:, None], 0.0, x)


def normalized_over_rows(x):  # x.T: features x tokens, normalized over the tokens
    return torch.nn.functional.layer_norm(x.T, x.T.shape[-1:]).T


def instance_normalized(x):
    return torch.nn.functional.instance_norm(x.T[None])[0].T


def edge_padded(x):
    return torch.nn.functional.pad(x.T[None], (0, 1), mode="replicate")[0].T


def spectrum(x):
    return torch.fft.rfft(x, dim=0).abs()


def attended(x):  # every token attends to every other: padded ones too
    return torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])[0, 0]


def last_row_by_index(x):  # a negative value in an index tensor counts from the end: a padded row
    return x[torch.tensor([-1])] * 1


def previous_rows(x):  # row i reads row i - 1; row 0 reads row -1, the padded end
    return x[torch.arange(x.shape[0]) - 1] * 1


def written_a_row_up(x):  # row i written to row i - 1: row 0's to row -1, the padded end
    return torch.zeros_like(x).index_put_((torch.arange(x.shape[0]) - 1,), x)


def shifted_into_place(x):  # out[: N - 1] = x[1:] by an index: its padded rows (row numbers) write row N - 1
    return torch.zeros_like(x).index_put_((torch.arange(x.shape[0] - 1),), x[1:])


MIXING = {
    centered: "aten.mean",
    softmax_over_rows: "aten._softmax",
    sorted_rows: "aten.sort",
    gram: "aten.mm",
    last_row: "aten.select",
    joined: "aten.cat",
    branch_on_size: "branch",
    row_at_size: "branch",
    reversed_rows: "aten.arange",
    tail_of_a_table: "aten.slice",
    tiled: "aten.repeat",
    transposed_flat: "aten._unsafe_view",
    appended: "aten.constant_pad_nd",
    convolved: "aten.convolution",
    scaled_by_size: "aten.mul",
    filled_with_size: "aten.full_like",
    ramp_to_size: "aten.linspace",
    rolled_by_size: "aten.roll",
    new_full_of_size: "aten.new_full",
    size_as_alpha: "aten.addmm",
    index_filled_with_size: "aten.index_fill",
    halves: "aten.split_with_sizes",
    last_row_masked: "aten.eq",
    normalized_over_rows: "aten.native_layer_norm",
    instance_normalized: "aten._native_batch_norm_legit",
    edge_padded: "aten.replication_pad1d",
    spectrum: "aten._fft_r2c",
    attended: "aten._scaled_dot_product_flash_attention_for_cpu",
    last_row_by_index: "aten.index",
    previous_rows: "aten.index",
    written_a_row_up: "aten.index_put_",
    shifted_into_place: "aten.index_put_",
}


def where(fn) -> str:
    return f"test_padding.py:{fn.__code__.co_firstlineno + 1}"


@pytest.mark.parametrize("fn", list(MIXING), ids=lambda f: f.__name__)
def test_ops_mixing_the_batch_axis_are_logged_once_with_their_line(fn, caplog):
    f = fgraph.jit(fn, batch={"x": Batched()}, buckets=[8], mode="PIECEWISE")
    x = torch.randn(5, 3)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(x)
        f(torch.randn(6, 3))
    logged = [r.getMessage() for r in caplog.records if "padding is visible" in r.getMessage()]
    assert len(logged) == 1, logged
    assert f"{MIXING[fn]} at " in logged[0] and where(fn) in logged[0]
    text = str(fgraph.explain(f))
    assert "padding visible: " + MIXING[fn] in text and where(fn) in text


@pytest.mark.parametrize("mode", MODES)
def test_a_prefix_cut_by_a_negative_end_is_the_calls_own_and_not_reported(mode, caplog):
    """`offsets[1:] - offsets[:-1]` (lengths from cumulative offsets) and `x[:-1]`: a negative end keeps a prefix,
    whose rows are the call's once the output is cut back; a running sum along the tokens depends only on the rows
    before each. A negative start or index (`x[-1]`) is reported."""

    def lengths(x, offsets):
        # x[: n - 1]: an end computed from the size, a prefix too; a running sum depends on earlier rows only; the
        # piece after a constant-sized one starts at a real row
        rest = x.split([1, x.shape[0] - 1])[1] * 4
        return offsets[1:] - offsets[:-1], x[:-1] * 2, x[: x.shape[0] - 1] * 3, running_total(x), rest

    f = fgraph.jit(lengths, batch={"x": Batched(), "offsets": Batched(pad="ramp", extra=1)}, buckets=[8], mode=mode)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for n, offsets in [(5, [0, 2, 5]), (3, [0, 1, 2, 3]), (6, [0, 6])]:
            x, off = torch.randn(n, 2), torch.tensor(offsets)
            got, want = f(x, off), eager(lengths, x, off)
            assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want)), (n, offsets)
    assert "padding is visible" not in caplog.text


@pytest.mark.parametrize("mode", MODES)
def test_causal_attention_over_the_batch_axis_is_the_calls_own_and_not_reported(mode, caplog):
    def causal(x):
        q = x[None, None]
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)[0, 0]

    f = fgraph.jit(causal, batch={"x": Batched(pad=1.0)}, buckets=[8], mode=mode)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for n in (3, 5, 8):
            x = torch.randn(n, 4)
            torch.testing.assert_close(f(x), eager(causal, x))
    assert "padding is visible" not in caplog.text


@pytest.mark.parametrize("fn", list(MIXING), ids=lambda f: f.__name__)
def test_declared_mixing_is_silent(fn, caplog):
    f = fgraph.jit(fn, batch={"x": Batched(mixes=True)}, buckets=[8], mode="NONE")
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(torch.randn(5, 3))
    assert "padding is visible" not in caplog.text
    assert "padding visible" not in str(fgraph.explain(f))


@pytest.mark.parametrize("mode", MODES)
def test_the_reported_mixing_is_real(mode, caplog):
    """What the log says, shown against eager: x - x.mean(0) over a padded axis is not the unpadded answer."""
    f = fgraph.jit(centered, batch={"x": Batched()}, buckets=[8], mode=mode)
    x = torch.randn(5, 3) + 1
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        assert not torch.allclose(f(x), eager(centered, x))
    assert "padding is visible: aten.mean at " in caplog.text and where(centered) + ":" in caplog.text


# scatters by a batched index into a tensor with the batch axis: each on the line after its def. The index's padded
# rows hold its pad (0: row 0, a real row) or what the trace made of it, and write padded rows of x where they point
def put_by_index(x, idx):  # out[idx] = x
    return torch.zeros_like(x).index_put_((idx,), x)


def copied_by_index(x, idx):
    return torch.zeros_like(x).index_copy_(0, idx, x)


def added_by_index(x, idx):
    return torch.zeros_like(x).index_add_(0, idx, x)


def scattered_by_index(x, idx):
    return torch.zeros_like(x).scatter_(0, idx[:, None].expand(-1, x.shape[1]), x)


def filled_by_index(x, idx):  # (index_fill_ takes -1 as the last row: a padded index row pointing there is not)
    return x.index_fill(0, idx - 1, 0.0)


def put_by_unknown_index(x, idx):  # an index computed from padded rows of x: what it holds there is not known
    return torch.zeros_like(x).index_put_((x[:, 0].gt(0).long(),), x)


def last_rows_by_offsets(x, idx):  # each sequence's last row gets a value of its own: the padded ones write too
    return torch.zeros_like(x).index_put_((idx[1:] - 1,), x[: idx.shape[0] - 1])


def second_last_flags(x, idx):  # offsets - 2: the padded ones point at the call's last row too
    return torch.zeros(x.shape[0]).index_put_((idx[1:] - 2,), torch.tensor(1.0))


OFFSETS = Batched(pad="ramp", extra=1)
SCATTERS = {  # fn -> (op, spec of idx)
    put_by_index: ("aten.index_put_", Batched()),
    copied_by_index: ("aten.index_copy_", Batched()),
    added_by_index: ("aten.index_add_", Batched()),
    scattered_by_index: ("aten.scatter_", Batched()),
    filled_by_index: ("aten.index_fill", Batched(pad=1)),
    put_by_unknown_index: ("aten.index_put_", Batched()),
    last_rows_by_offsets: ("aten.index_put_", OFFSETS),
    second_last_flags: ("aten.index_put_", OFFSETS),
}


def index_args(spec, n):
    """x [n, 3] and an index of its rows: the reversed rows, or ramp offsets [0, 2, n] of two sequences."""
    idx = torch.tensor([0, 2, n]) if spec.pad == "ramp" else torch.arange(n).flip(0) + (spec.pad == 1)
    return torch.randn(n, 3), idx


@pytest.mark.parametrize("fn", list(SCATTERS), ids=lambda f: f.__name__)
def test_scatters_whose_padded_index_rows_reach_real_rows_are_logged_once_with_their_line(fn, caplog):
    op, spec = SCATTERS[fn]
    f = fgraph.jit(fn, batch={"x": Batched(pad=0.5), "idx": spec}, buckets=[8], mode="PIECEWISE")
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(*index_args(spec, 5))
        f(*index_args(spec, 6))
    logged = [r.getMessage() for r in caplog.records if "padding is visible" in r.getMessage()]
    assert len(logged) == 1 and f"{op} at " in logged[0] and where(fn) in logged[0], logged
    assert "scatters along the batch axis by an index whose padded rows" in logged[0]
    assert "padding visible: " + op in str(fgraph.explain(f)) and where(fn) in str(fgraph.explain(f))


@pytest.mark.parametrize("fn", list(SCATTERS), ids=lambda f: f.__name__)
def test_declared_scatters_are_silent(fn, caplog):
    spec = attrs.evolve(SCATTERS[fn][1], mixes=True)
    f = fgraph.jit(fn, batch={"x": Batched(mixes=True), "idx": spec}, buckets=[8], mode="NONE")
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(*index_args(spec, 5))
    assert "padding is visible" not in caplog.text


def permuted_rows(x, perm):
    out = torch.zeros_like(x)
    out[perm] = x  # (line 2 of the def)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_the_reported_index_patterns_are_real(mode, caplog):
    """What the log says, against eager: `x[torch.tensor([-1])]` reads a padded row, and `out[perm] = x` with perm
    padded by 0 writes padded rows of x into row 0 (the last write of a row wins)."""
    f = fgraph.jit(last_row_by_index, batch={"x": Batched(pad=0.5)}, buckets=[8], mode=mode)
    g = fgraph.jit(permuted_rows, batch={"x": Batched(pad=0.5), "perm": Batched()}, buckets=[8], mode=mode)
    x, perm = torch.randn(5, 3), torch.tensor([4, 0, 3, 1, 2])
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        assert torch.equal(f(x), torch.full((1, 3), 0.5)) and torch.equal(eager(last_row_by_index, x), x[-1:])
        got, want = g(x, perm), eager(permuted_rows, x, perm)
    assert torch.equal(got[1:], want[1:]) and torch.equal(got[0], torch.full((3,), 0.5))
    assert "aten.index at " in caplog.text and where(last_row_by_index) in caplog.text
    line = permuted_rows.__code__.co_firstlineno + 2
    assert f"aten.index_put_ at tests/padding/test_padding.py:{line}:" in caplog.text


# index patterns padding does not leak through: the check follows what padding puts in the index (a ramp of
# offsets, row numbers) and what the trace makes of it, and stays silent
def last_token_flags(x, offsets):  # each sequence's last token, from ramp-padded offsets (one value written)
    last = torch.zeros(x.shape[0], dtype=torch.bool)
    last[offsets[1:] - 1] = True
    return torch.where(last[:, None], x, 0.0)


def last_token_filled(x, offsets):
    return torch.zeros(x.shape[0]).index_fill_(0, offsets[1:] - 1, 1.0)[:, None] * x


def last_tokens(x, offsets):  # read: the offsets are the caller's values
    return x[offsets[1:] - 1] * 1


def rows_in_place(x, offsets):  # row numbers: each padded row writes itself
    return torch.zeros_like(x).index_copy_(0, torch.arange(x.shape[0]), x * 2)


def one_hot(x, offsets):  # along the features: each index row writes its own row
    return torch.zeros(x.shape[0], 4).scatter_(1, (x[:, :1] > 0).long(), 1.0)


def previous_or_first(x, offsets):  # max(i, 1) - 1 >= 0: never counts from the end
    return x[torch.arange(x.shape[0]).clamp(min=1) - 1] * 1


def constant_rows(x, offsets):  # non-negative constants, and a negative one along a dim without the batch axis
    return x[torch.tensor([0, 1])][:, torch.tensor([-1])] * 1


SILENT = [last_token_flags, last_token_filled, last_tokens, rows_in_place, one_hot, previous_or_first, constant_rows]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", SILENT, ids=lambda f: f.__name__)
def test_index_patterns_padding_does_not_reach_are_silent_and_eager(fn, mode, caplog):
    """Among the calls, 8 tokens of two sequences fill the bucket while the sequences are padded: their offsets all
    hold 8, so the padded `offsets[1:] - 1` point at row 7, the last real token, as the last sequence's does."""
    f = fgraph.jit(fn, batch={"x": Batched(pad=0.5), "offsets": OFFSETS}, buckets=[8], mode=mode)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for n, offsets in [(5, [0, 2, 5]), (8, [0, 3, 8]), (3, [0, 1, 2, 3])]:
            x, off = torch.randn(n, 3), torch.tensor(offsets)
            got, want = f(x, off), eager(fn, x, off)
            assert got.shape == want.shape and torch.equal(got, want), (n, offsets)
    assert "padding is visible" not in caplog.text


def test_a_branch_fixing_the_batch_size_is_logged_and_outputs_still_cut(caplog):
    def at_eight(x):
        return x * 2 if x.shape[0] == 8 else x + 1

    f = fgraph.jit(at_eight, batch={"x": Batched()}, buckets=[8], mode="NONE")
    x = torch.ones(5)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        assert f(x).shape == (5,)  # eager: x + 1; the trace took the bucket's branch, which the log says
    assert "padding is visible: branch at " in caplog.text and where(at_eight) + ":" in caplog.text


@pytest.mark.parametrize("buckets, logged", [([1, 8], False), ([8], True)])
def test_a_branch_every_call_takes_alike_is_not_reported(buckets, logged, caplog):
    """`if N > 1` (Hugging Face's masks have one): with bucket 1 traced on its own, every call reaching the symbolic
    trace has N > 1, as eager does; without bucket 1, a single row padded to 8 takes the other branch."""

    def more_than_one(x):
        return x * 2 if x.shape[0] > 1 else x

    f = fgraph.jit(more_than_one, batch={"x": Batched()}, buckets=buckets, mode="NONE")
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for n in (5, 1, 3):
            got = f(torch.ones(n, 2))
            assert torch.equal(got, eager(more_than_one, torch.ones(n, 2))) or logged
    assert ("padding is visible: branch at " in caplog.text) == logged


def test_a_function_first_called_at_bucket_1_is_checked_at_its_first_symbolic_trace(caplog):
    """Bucket 1 is traced with static shapes (nothing to find: one row pads nothing); the next bucket's trace is
    symbolic and is checked."""
    f = fgraph.jit(centered, batch={"x": Batched()}, buckets=[1, 8], mode="NONE")
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(torch.randn(1, 3))
        assert "padding is visible" not in caplog.text
        f(torch.randn(5, 3))
    assert "padding is visible: aten.mean at " in caplog.text and where(centered) + ":" in caplog.text


def test_per_row_work_is_not_reported(caplog):
    def per_row(x, w, idx):
        h = torch.nn.functional.rms_norm(x @ w, (3,))  # reductions along the feature dim
        rows = x[0 : x.shape[0]] + torch.arange(x.shape[0])[:, None]  # the whole axis; positions from 0
        rows = rows + torch.arange(10.0)[: x.shape[0], None]  # a table's first N rows: row i for token i
        pairs = torch.stack([x, x], 1).reshape(-1, 3)[::2]  # rows interleaved per token, then taken back
        rows = rows + pairs + torch.nn.functional.pad(x, (0, 0, 1, 0))[1:] + x.reshape(-1).view(-1, 3)
        return torch.softmax(h, -1) + w[idx, 0][:, None] + x[0] + x[:, 1:].sum(-1, keepdim=True) + rows

    f = fgraph.jit(per_row, batch={"x": Batched(), "idx": Batched()}, buckets=[8], mode="PIECEWISE")
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(torch.randn(5, 3), torch.randn(3, 3), torch.tensor([0, 2, 1, 1, 0]))
    assert "padding is visible" not in caplog.text


# writes through a view as long as the batch into a tensor without the batch axis: each on the line after its def
def assigned(state, x):
    state[: x.shape[0]] = x


def added(state, x):
    state[: x.shape[0]] += x


def narrowed(state, x):
    state.narrow(0, 0, x.shape[0]).mul_(x)


WRITES = {assigned: "aten.copy_", added: "aten.add_", narrowed: "aten.mul_"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("write", list(WRITES), ids=lambda f: f.__name__)
def test_a_write_through_a_slice_as_long_as_the_batch_is_logged_and_real(write, mode, caplog):
    """`state[: x.shape[0]] = x` spans the bucket's rows: the padded rows write rows of the state eager leaves alone.
    Logged with the op and line, and it is what happens (the state differs from eager's past the call's rows)."""

    def step(state, x):
        write(state, x)
        return state * 1

    f = fgraph.jit(step, donate=["state"], batch={"x": Batched(pad=0.5)}, buckets=[8], mode=mode)
    ours, theirs, x = torch.arange(8.0) + 2, torch.arange(8.0) + 2, torch.full((5,), 3.0)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(ours, x)
    eager(step, theirs, x)
    assert torch.equal(ours[:5], theirs[:5]) and not torch.equal(ours[5:], theirs[5:])
    logged = [r.getMessage() for r in caplog.records if "padding is visible" in r.getMessage()]
    assert len(logged) == 1 and f"{WRITES[write]} at " in logged[0] and where(write) in logged[0], logged
    assert "writes a slice as long as the batch into state: padded rows write too" in logged[0]


@pytest.mark.parametrize("mode", ["NONE", "FULL"])
def test_an_output_that_shrinks_as_the_batch_grows_is_a_trace_error(mode):
    """`table[x.shape[0]:]` has 8 - N rows: padded to a bucket it is shorter than the call's and holds other rows,
    so no cut gives eager's answer."""

    def rest_of_table(table, x):
        return table[x.shape[0] :] * 1

    f = fgraph.jit(rest_of_table, batch={"x": Batched()}, buckets=[8], mode=mode)
    with pytest.raises(
        fgraph.TraceError,
        match=r"output 0 at tests/padding/test_padding.py:\d+ has 8 - Min\(8, x.shape\[0\]\) rows along dim 0, "
        r"fewer as the batch grows.*\nFix: take its rows from a start that does not depend on the batch size",
    ):
        f(torch.arange(8.0), torch.ones(3))


def test_an_output_whose_size_padding_changes_is_eagers_or_an_error_not_a_torch_crash():
    """The last chunk of `x.split(2)`: 1 row for 3 rows, but the trace at bucket 8 gives 2; no cut is right. The
    trace assumed 4 chunks (N in 7..8): a call of 3 breaks that, so it runs eagerly. Where a trace assumed nothing
    a call breaks (`mixes=True` declares the split intended), it is a TraceError."""

    def last_pair(x):
        return x.split(2, 0)[-1] * 1

    x = torch.arange(6.0).reshape(3, 2)
    f = fgraph.jit(last_pair, batch={"x": Batched()}, buckets=[8], mode="NONE")
    assert torch.equal(f(x), last_pair(x)) and f.stats()["fallbacks"]["branch"] == 1
    f = fgraph.jit(last_pair, batch={"x": Batched(mixes=True)}, buckets=[8], mode="NONE")
    with pytest.raises(fgraph.TraceError, match=r"output 0's size along dim 0 in this call is not within the rows"):
        f(x)


def test_writes_into_declared_scratch_or_into_batched_tensors_are_not_reported(caplog):
    def step(state, x):
        state[: x.shape[0]] = x  # state is scratch: declared to take what padded rows write
        out = torch.zeros_like(x)
        out[: x.shape[0]] = x * 2  # a tensor with the batch axis: its padded rows are cut from the output
        return out

    f = fgraph.jit(step, donate=["state"], scratch=["state"], batch={"x": Batched()}, buckets=[8], mode="NONE")
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(torch.zeros(8), torch.ones(5))
    assert "padding is visible" not in caplog.text


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_example_models_report_no_padding(kind, routine, caplog):
    """Attention and MoE are breaks with their own padding contract; embeddings index by token; norms, RoPE, MLPs
    and the LM head are per token: nothing in the models' steps combines rows along the batch axis."""
    from benchmarks.common import decode_batch
    from examples import llama, qwen2_moe
    from fgraph.ops import attention as A

    if kind == "llama":
        cfg = llama.preset("tiny")
        params, step = llama.init_params(cfg, torch.float32, "cpu"), llama.make_step(cfg, "torch", 32)
    else:
        cfg = qwen2_moe.preset("tiny-moe")
        params, step = qwen2_moe.init_params(cfg, torch.float32, "cpu"), qwen2_moe.make_step(cfg, "torch", 32)
    cache = llama.init_cache(cfg, 1 + 5 * 2, 16, torch.float32, "cpu")
    batch, _ = decode_batch(cfg.vocab_size, 5, 16, 16, 32)
    spec = llama.Batch(Batched(pad=0), Batched(pad=0), A.metadata_batching())
    f = fgraph.jit(step, static=["routine"], donate=["cache"], batch={"batch": spec}, buckets=[8])
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        e = fgraph.explain(f, params, cache, batch, routine=routine).entries[0]
    assert e.traced.mixing == [] and "padding is visible" not in caplog.text
