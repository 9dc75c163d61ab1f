"""Padded rows never index out of bounds on the device: an index whose padded rows point past the tensor it
indexes is refused at trace time, before the program runs anywhere (on CUDA such a read is a device-side assert
that ends the process's CUDA context; on the CPU an IndexError in the first run).

  - per-row data left out of batch= (an attention mask beside padded input ids), read row by row by the padded
    batch axis: a SignatureError naming its key path and the fix (declare it Batched), raised by the trace
  - a table indexed by the batch axis's row numbers serves the buckets within its rows; a larger bucket gets a
    trace of its own, which refuses it (never a run that reads past the table)
  - a Batched pad that is no valid index where the function indexes by it, or that the function's arithmetic
    turns into none: a SignatureError naming the leaf and its pad
  - an input that merely has the call's N rows, and every index that stays in bounds, is served as eager
"""

import pytest
import torch

import fgraph
from fgraph import Batched, SignatureError, TraceError
from fgraph.function import Cache


def eager(fn, *args, **kw):
    with fgraph.disable_jit():
        return fn(*args, **kw)


@pytest.fixture
def runs(monkeypatch):
    """The signatures that reached a run on real tensors (warm-up, capture, the CPU's first run)."""
    made = []
    capture = Cache.capture

    def counted(self, entry, call):
        made.append(call.sig.bucket)
        return capture(self, entry, call)

    monkeypatch.setattr(Cache, "capture", counted)
    return made


def rows_of(x, m):  # m's rows read by the batch axis's row numbers, as transformers reads an attention mask
    return x * m[torch.arange(x.shape[0], device=x.device)]


def test_an_undeclared_input_read_by_the_padded_axis_is_refused_before_anything_runs(runs):
    x, m = torch.ones(3, 2), torch.full((3, 2), 2.0)
    f = fgraph.jit(rows_of, batch={"x": Batched()}, buckets=[4, 8])
    with pytest.raises(SignatureError) as e:
        f(x, m)
    assert "m [3, 2] is not declared Batched, but its dim 0 has 3 rows" in e.value.what
    assert "padded to the bucket 4" in e.value.what and "the padded rows read row 3, out of bounds" in e.value.what
    assert "device-side assert" in e.value.what and "test_bounds.py" in e.value.what  # the user's line
    assert e.value.fix.startswith("declare it Batched(axis=0): batch={..., 'm': fgraph.Batched(axis=0)}")
    assert runs == [] and e.value.__cause__ is None and not f.entries  # the trace refused it: nothing ran
    f = fgraph.jit(rows_of, batch={"x": Batched(), "m": Batched()}, buckets=[4, 8])  # the fix
    assert torch.equal(f(x, m), eager(rows_of, x, m)) and runs == [4]


@torch.no_grad()
def test_an_hf_attention_mask_left_out_of_batch_is_refused_by_the_trace(runs):
    pytest.importorskip("transformers")
    from examples import hf_generate as G

    model = G.tiny("llama")
    f = fgraph.jit(model, batch={"input_ids": Batched()}, buckets=[4, 8])
    ids = torch.randint(0, 128, (3, 6), generator=torch.Generator().manual_seed(1))
    with pytest.raises(SignatureError) as e:
        f(input_ids=ids, attention_mask=torch.ones(3, 6, dtype=torch.long), use_cache=False)
    assert "attention_mask [3, 6] is not declared Batched, but its dim 0 has 3 rows" in e.value.what
    assert "masking_utils.py" in e.value.what  # where transformers reads the mask by the batch's rows
    assert "'attention_mask': fgraph.Batched(axis=0)" in e.value.fix
    assert runs == [] and not isinstance(e.value.__cause__, fgraph.RunError)


def position_table(x, pe):  # a table of positions read by row number: fine while the bucket fits in it
    return x + pe[torch.arange(x.shape[0], device=x.device)]


def test_a_table_serves_the_buckets_within_its_rows_and_refuses_a_larger_one(runs):
    pe = torch.arange(12.0).view(6, 2)
    f = fgraph.jit(position_table, batch={"x": Batched()}, buckets=[2, 4, 8])
    for n in (3, 4, 2):
        x = torch.randn(n, 2)
        assert torch.equal(f(x, pe), eager(position_table, x, pe))
    assert runs == [4, 2] and f.stats()["total"]["traces"] == 1  # bucket 2 reuses bucket 4's trace
    x = torch.randn(5, 2)  # eager is fine (5 rows of 6); padded to 8, the padded rows would read rows 6 and 7
    with pytest.raises(TraceError) as e:
        f(x, pe)
    assert "indexes dim 0 of the pe [6, 2] (6 rows) by row numbers of the padded batch axis" in e.value.what
    assert "at the bucket 8 the padded rows read row 7, out of bounds" in e.value.what
    assert "not declared Batched" not in e.value.what  # pe has 6 rows, not the call's 5: not per-row data
    assert "clamp the index to 5" in e.value.fix and "keep buckets within 6 rows" in e.value.fix
    assert runs == [4, 2]  # bucket 4's trace was not reused for 8, and bucket 8's refused before a run


def lookup(ids, table):
    return table[ids]


def shifted_lookup(ids, table):
    return table.index_select(0, ids + 4)


def test_a_pad_that_is_no_index_is_refused_with_its_key_path(runs):
    table = torch.randn(4, 2)
    ids = torch.tensor([0, 3, 1])
    f = fgraph.jit(lookup, batch={"ids": Batched(pad=7)}, buckets=[4])
    with pytest.raises(SignatureError) as e:
        f(ids, table)
    assert "the padded rows of ids hold its pad 7; aten.index at" in e.value.what
    assert "uses as indices into dim 0 of the table [4, 2] (4 rows): out of bounds" in e.value.what
    assert "pad ids with a value that is a valid index there, in [-4, 4)" in e.value.fix and runs == []
    g = fgraph.jit(lookup, batch={"ids": Batched(pad=0)}, buckets=[4])  # the default pad: row 0, a valid one
    assert torch.equal(g(ids, table), eager(lookup, ids, table))
    # the function's own arithmetic turns the pad into the index: said so, with the leaf's key path
    h = fgraph.jit(shifted_lookup, batch={"ids": Batched(pad=0)}, buckets=[4])
    with pytest.raises(SignatureError) as e:
        h(ids - 4, table)
    assert "the padded rows of ids hold its pad 0; the function turns that pad into the index 4" in e.value.what
    assert "aten.index_select" in e.value.what and "in [0, 4)" in e.value.fix
    assert "after the function's arithmetic" in e.value.fix
    k = fgraph.jit(shifted_lookup, batch={"ids": Batched(pad=-4)}, buckets=[4])  # a pad it turns into row 0
    assert torch.equal(k(ids - 4, table), eager(shifted_lookup, ids - 4, table))


def test_an_input_with_the_calls_rows_that_is_not_indexed_by_the_batch_axis_is_served():
    f = fgraph.jit(lambda x, m: (x + 1, m[torch.tensor([0, 2])] * 2), batch={"x": Batched()}, buckets=[4])
    x, m = torch.ones(3, 2), torch.arange(6.0).view(3, 2)
    got = f(x, m)
    assert torch.equal(got[0], x + 1) and torch.equal(got[1], m[[0, 2]] * 2)


@pytest.mark.gpu
def test_cuda_still_works_after_the_refusal():
    x, m = torch.ones(3, 2, device="cuda"), torch.ones(3, 2, device="cuda")
    f = fgraph.jit(rows_of, batch={"x": Batched()}, buckets=[4, 8])
    with pytest.raises(SignatureError):
        f(x, m)
    assert torch.ones(1, device="cuda").sum().item() == 1.0  # no device-side assert killed the context
    g = fgraph.jit(rows_of, batch={"x": Batched(), "m": Batched()}, buckets=[4, 8])
    assert torch.equal(g(x, m), rows_of(x, m))
