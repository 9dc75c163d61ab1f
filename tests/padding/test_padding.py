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

import ast
import logging
import pathlib

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
        # x[: n - 1]: an end computed from the size, a prefix too; a running sum depends on earlier rows only
        return offsets[1:] - offsets[:-1], x[:-1] * 2, x[: x.shape[0] - 1] * 3, running_total(x)

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


def test_an_output_whose_size_padding_changes_is_an_error_not_a_torch_crash():
    """The last chunk of `x.split(2)`: 1 row for 3 rows, but the trace at bucket 8 gives 2; no cut is right."""

    def last_pair(x):
        return x.split(2, 0)[-1] * 1

    f = fgraph.jit(last_pair, batch={"x": Batched()}, buckets=[8], mode="NONE")
    with pytest.raises(fgraph.TraceError, match=r"output 0's size along dim 0 in this call is not within the rows"):
        f(torch.ones(3, 2))


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
