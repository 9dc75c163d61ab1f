"""Paged attention on the CPU: the torch backend against a float64 reference, the padding contract, the KV
write, backend resolution, the break's trace and capture support, and the flashinfer backend's planning logic
(with a stand-in flashinfer whose kernels compute from the *plan*, so a stale plan gives wrong numbers).

Shapes are tiny (head dim 8, pages of 4 tokens) so every sequence spans several pages.
"""

import attrs
import numpy as np
import pytest
import torch

import fgraph
from fgraph.ops import _attn_flashinfer as FI
from fgraph.ops import attention as A
from tests.ops.attention_cases import (
    CACHE_WRITES,
    DECODE,
    MIXED,
    PAGE,
    TOY_BATCH,
    Case,
    D,
    FakeFlashInfer,
    _layers,
    fake_flashinfer,  # noqa: F401 (fixtures, taken by name)
    jit_toy,
    plans_made,
    refill,
    same,
    toy_inputs,
    toy_step,
)


@pytest.mark.parametrize("compile", [False, True])
def test_jit_pieces_never_write_the_cache(compile):
    """The KV write lives in the break: the graph pieces between breaks hold no write into the cache (under
    Inductor, `compile=True`, such a write became a copy of the whole cache layer), and after a call the cache
    holds the new k/v at their slots (from the break), equal to the eager run's, with Inductor-compiled pieces
    too."""
    step = fgraph.jit(
        toy_step,
        static=["routine", "backend"],
        donate=["cache"],
        batch={"batch": TOY_BATCH},
        buckets=[32],
        mode="PIECEWISE",
        compile=compile,
    )
    case = Case(*MIXED, 4, 2, dtype=torch.float32)
    cache, batch = toy_inputs(case)
    jcache = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
    want, cache = toy_step(cache, batch)
    got, jcache = step(jcache, batch, routine="mixed", backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jcache.k + jcache.v, cache.k + cache.v):
        same(a[1:], b[1:])
    (e,) = step.entries.values()
    pieces = e.program.pieces
    assert [p.ops for p in pieces if p.is_break] == [("attention",), ("attention",)]
    for p in pieces:
        if not p.is_break:
            assert not CACHE_WRITES & set(p.ops), p.ops
            assert not any(i.startswith("cache.") for i in p.inputs), p.inputs  # pieces never even see the cache


def test_jit_rejects_a_cache_that_is_not_donated():
    """The break writes the cache (its schema says so), so fgraph's trace check still names the missing donation."""
    step = fgraph.jit(
        toy_step,
        static=["routine", "backend"],
        batch={"batch": TOY_BATCH},
        buckets=[32],
        mode="PIECEWISE",
    )
    cache, batch = toy_inputs(Case(*MIXED, 4, 2, dtype=torch.float32))
    with pytest.raises(
        fgraph.FgraphError,
        match=r"fgraph\.attention.* writes in place into cache\.k\[0\], "
        r"which is not donated",
    ):
        step(cache, batch, routine="mixed", backend="torch")


# ------------------------------------------------------------------------------------------ flashinfer logic
def test_flashinfer_host_plan_layout():
    m = A.pad_metadata(A.build_metadata([1, 1], [5, 4], [[7, 3], [2]], PAGE, 4), 4)
    h = FI.host_plan(m.query_start_loc, m.seq_lens, m.block_table, PAGE)
    assert h.indptr.tolist() == [0, 2, 3, 4, 5]  # padded rows: one (scratch) page each
    assert h.indices.tolist() == [7, 3, 2, 0, 0]
    assert h.last.tolist() == [1, 4, 1, 1]  # never 0 (flashinfer: 0 is a full page)
    assert h.qo_indptr.tolist() == [0, 1, 2, 3, 4] and h.lens.tolist() == [5, 4, 1, 1]
    assert all(a.dtype == np.int32 for a in (h.qo_indptr, h.indptr, h.indices, h.last, h.lens))
    assert h.t("indptr").dtype == torch.int32 and h.t("indptr").device.type == "cpu"


@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED)])
def test_flashinfer_plans_once_per_step_from_the_hook(routine, lens, fake_flashinfer):
    bucket = sum(lens[0]) + 3
    for seed in (0, 1, 2):  # three steps with different lengths, same bucket
        case = Case(lens[0], [n + seed for n in lens[1]], 4, 2, dtype=torch.float32, seed=seed)
        meta = A.pad_metadata(case.meta, bucket)
        A.plan_attention(meta, backend="flashinfer", routine=routine, page_size=PAGE, scale=D**-0.5)
        out = _layers(case, meta, routine, bucket)
        torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
        assert plans_made(routine=routine) == seed + 1  # step 0: the new wrapper, by warm-up
    if routine == "decode":  # lengths 1, 4, 5, 9, 17, then +1 (new page counts), then +2 (the same: skipped)
        assert FI.stats() == {"plan": 1, "fast": 1, "module": 0, "skip": 1}
    else:  # the metadata padded to the bucket: a CUDA-graph prefill wrapper, set up by plan(), then the module's
        # plan called directly (each step's page counts change)
        assert FI.stats() == {"plan": 1, "fast": 0, "module": 2, "skip": 0}
        assert fake_flashinfer.plans == [("mixed", bucket)]


def test_flashinfer_decode_steps_within_pages_upload_only_the_last_page_lengths(fake_flashinfer):
    """A decode step that keeps every sequence in its last page (page_size - 1 steps in page_size) changes only the
    last-page lengths: the hook reuses the previous plan's indptr and page ids and uploads the lengths alone (the
    wrapper's plan is skipped); a sequence entering a new page, or other pages, upload everything again."""
    lens = [1, 5, 9, 13, 17]  # 1..5 pages of 4
    for step, (grow, seed, upload) in enumerate(
        [(0, 0, "full"), (1, 0, "lengths"), (2, 0, "lengths"), (4, 0, "full"), (4, 1, "full")]
    ):  # +4: new pages; seed 1: others
        case = Case([1] * 5, [n + grow for n in lens], 4, 2, dtype=torch.float32, seed=seed)
        meta = A.pad_metadata(case.meta, 8)
        bufs = FI._plan_bufs.get("cpu")
        before = (
            dict(bufs.uploads)
            if bufs is not None
            else dict.fromkeys(("full", "lengths", "graph_full", "graph_lengths"), 0)
        )
        A.plan_attention(meta, backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5)
        out = _layers(case, meta, "decode", 8)
        torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
        after = FI._plan_bufs["cpu"].uploads
        assert {k: after[k] - before[k] for k in after} == {
            "full": int(upload == "full"),
            "lengths": int(upload == "lengths"),
            "graph_full": 0,
            "graph_lengths": 0,
        }, step
    assert FI.stats()["skip"] == 3  # the schedule follows the page counts alone: steps 1, 2 and 4 keep it


@pytest.mark.parametrize("hq, hkv", [(4, 2), (8, 2)], ids=["cuda-cores", "tensor-cores-switched-on"])
def test_flashinfer_decode_replans_only_when_page_counts_change(hq, hkv, fake_flashinfer, monkeypatch):
    """Lengths grow by one a step (new pages each step: the page ids change, the page counts only when a
    sequence enters a new page). flashinfer's plan is made from the page counts (the host indptr) alone: a step
    with the same indptr skips it, the others call the module's plan directly after the first two (plan(), then
    fast_decode_plan, recorded). The stand-in kernels refuse a schedule that is not the buffers' indptr.
    Tensor-core wrappers take these paths with FI.TENSOR_CORE_PLAN_PATHS (the default, verified on the H200)."""
    monkeypatch.setattr(FI, "TENSOR_CORE_PLAN_PATHS", True)
    starts, bucket = [1, 5, 9, 13, 17], 8  # each at the start of a page of 4
    for step, (grow, how) in enumerate(
        [(0, "plan"), (1, "skip"), (4, "fast"), (5, "skip"), (8, "module"), (9, "skip"), (12, "module")]
    ):
        case = Case([1] * 5, [n + grow for n in starts], hq, hkv, dtype=torch.float32, seed=step)
        meta = A.pad_metadata(case.meta, bucket)
        A.plan_attention(meta, backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5)
        before = FI.stats()
        out = _layers(case, meta, "decode", bucket)
        after = FI.stats()
        assert {k for k in after if after[k] != before[k]} <= {how} and plans_made() == step + 1, (step, after)
        torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
    assert FI.stats() == {"plan": 1, "fast": 1, "module": 2, "skip": 3}


def test_flashinfer_tensor_core_decode_replans_every_step_through_the_api_when_switched_off(
    fake_flashinfer, monkeypatch
):
    """Tensor-core wrappers (GQA groups > 2: Qwen2.5's 7, Llama-3's 4) plan with the prefill scheduler. With
    FI.TENSOR_CORE_PLAN_PATHS off they skip nothing: every step plan() (first) or fast_decode_plan."""
    monkeypatch.setattr(FI, "TENSOR_CORE_PLAN_PATHS", False)
    starts, bucket = [1, 5, 9, 13, 17], 8
    for step, grow in enumerate([0, 1, 4, 5]):
        case = Case([1] * 5, [n + grow for n in starts], 8, 2, dtype=torch.float32, seed=step)
        meta = A.pad_metadata(case.meta, bucket)
        A.plan_attention(meta, backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5)
        torch.testing.assert_close(
            _layers(case, meta, "decode", bucket).double(), case.expected(), rtol=1e-5, atol=1e-5
        )
    assert FI.stats() == {"plan": 1, "fast": 3, "module": 0, "skip": 0}


def test_flashinfer_decode_plan_falls_back_to_the_api(fake_flashinfer, monkeypatch):
    """Without fast_decode_plan every plan is flashinfer's plan(); when the module call cannot be recorded (no
    `_cached_module`), every plan keeps fast_decode_plan. Either way still skipped when unchanged."""
    starts, bucket = [1, 5, 9, 13, 17], 8
    steps = [0, 4, 8, 9]  # changed, changed, changed, unchanged

    def run():
        for step, grow in enumerate(steps):
            case = Case([1] * 5, [n + grow for n in starts], 4, 2, dtype=torch.float32, seed=step)
            meta = A.pad_metadata(case.meta, bucket)
            A.plan_attention(meta, backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5)
            torch.testing.assert_close(
                _layers(case, meta, "decode", bucket).double(), case.expected(), rtol=1e-5, atol=1e-5
            )

    monkeypatch.setattr(fake_flashinfer, "decode", type("decode", (), {}))
    run()
    assert FI.stats() == {"plan": 3, "fast": 0, "module": 0, "skip": 1}
    FI.reset()
    W, fast = fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper, FakeFlashInfer().decode.fast_decode_plan

    class Hidden(W):
        """Keeps its module elsewhere than `_cached_module` (only fast_decode_plan knows where)."""

        def plan(self, *a, **k):
            W.plan(self, *a, **k)
            self.mod = self.__dict__.pop("_cached_module")

    def hidden_fast(w, *a, **k):
        w._cached_module = w.mod
        try:
            fast(w, *a, **k)
        finally:
            del w._cached_module

    monkeypatch.setattr(fake_flashinfer, "BatchDecodeWithPagedKVCacheWrapper", Hidden)
    monkeypatch.setattr(fake_flashinfer, "decode", type("decode", (), {"fast_decode_plan": staticmethod(hidden_fast)}))
    run()
    assert FI.stats() == {"plan": 1, "fast": 2, "module": 0, "skip": 1}


def test_flashinfer_replans_when_called_outside_jit(fake_flashinfer):
    """No hook: plan from the device tensors on first use; re-plan for new tensors or in-place changes."""
    case = Case(*DECODE, 4, 2, dtype=torch.float32)
    meta = A.pad_metadata(case.meta, 8)
    out = _layers(case, meta, "decode", 8)
    assert plans_made() == 1
    torch.testing.assert_close(out.double(), case.expected(), rtol=1e-5, atol=1e-5)
    case2 = Case(DECODE[0], [n + 3 for n in DECODE[1]], 4, 2, dtype=torch.float32, seed=1)
    meta2 = A.pad_metadata(case2.meta, 8)  # new tensors
    torch.testing.assert_close(_layers(case2, meta2, "decode", 8).double(), case2.expected(), rtol=1e-5, atol=1e-5)
    assert plans_made() == 2
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):  # same tensors, new values
        getattr(meta2, name).copy_(getattr(meta, name))
    torch.testing.assert_close(_layers(case, meta2, "decode", 8).double(), case.expected(), rtol=1e-5, atol=1e-5)
    assert plans_made() == 3


def test_flashinfer_buckets_share_buffers_without_stale_plans(fake_flashinfer):
    """Decode wrappers of different buckets share the persistent buffers: the last plan owns them. Coming back
    to bucket 8 re-uploads its metadata; its wrapper's own plan (page counts unchanged) is still good: skipped."""
    small, large = Case([1, 1], [3, 6], 4, 2, dtype=torch.float32), Case(*DECODE, 4, 2, dtype=torch.float32, seed=3)
    m_small, m_large = A.pad_metadata(small.meta, 2), A.pad_metadata(large.meta, 8)
    _layers(large, m_large, "decode", 8)
    _layers(small, m_small, "decode", 2)  # overwrites the shared buffers
    out = _layers(large, m_large, "decode", 8)  # same tensors as before, but the buffers are gone: re-upload
    torch.testing.assert_close(out.double(), large.expected(), rtol=1e-5, atol=1e-5)
    assert [b for _, b in fake_flashinfer.plans] == [8, 2] and plans_made(8) == 2 and FI.stats()["skip"] == 1


def test_flashinfer_wider_block_tables_get_their_own_decode_wrapper(fake_flashinfer):
    """A second engine with longer sequences (a wider block table, same bucket) gets its own wrapper and larger
    buffers, instead of the first wrapper's buffers overflowing ("pages in use"); the first still works."""
    short, long = (
        Case(*DECODE, 4, 2, dtype=torch.float32),
        Case([1] * 8, [29, 30, 31, 32, 25, 26, 27, 28], 4, 2, dtype=torch.float32, num_pages=72, max_pages=8),
    )
    m_short = A.pad_metadata(short.meta, 8)
    m_short = attrs.evolve(m_short, block_table=m_short.block_table[:, :5])  # 5 pages a row: buffers of 8 x 5
    m_long = A.pad_metadata(long.meta, 8)  # 8 pages a row, 60 in use
    for case, meta in ((short, m_short), (long, m_long), (short, m_short)):
        torch.testing.assert_close(_layers(case, meta, "decode", 8).double(), case.expected(), rtol=1e-5, atol=1e-5)
    assert sorted(key[-1] for key in FI._wrappers) == [5, 8]


def test_flashinfer_plan_of_a_jitted_call_is_not_taken_by_a_later_direct_call(fake_flashinfer):
    """The hook's plan belongs to the fgraph execution it was made for. A direct call afterwards (another model in
    the same process, the eager oracle of a test) must plan from its own metadata: taking the leftover plan of a
    CUDA-graph replay (which runs no Python, so nothing used the plan up) gave wrong attention, and an illegal
    address on the H200 where the leftover page tables were smaller (2026-11-29)."""
    from fgraph import _primitives as P

    bucket = 8
    a = Case([1] * 5, [1, 4, 5, 9, 17], 4, 2, dtype=torch.float32, seed=0)
    b = Case([1] * 5, [3, 6, 7, 12, 20], 4, 2, dtype=torch.float32, seed=1)
    _layers(a, A.pad_metadata(a.meta, bucket), "decode", bucket)  # creates the bucket's wrapper
    with P.execution():  # what fgraph does for a FULL replay: the plan hook, then the graph (no eager rule runs)
        A.plan_attention(
            A.pad_metadata(a.meta, bucket), backend="flashinfer", routine="decode", page_size=PAGE, scale=D**-0.5
        )
    before = plans_made(bucket)
    out = _layers(b, A.pad_metadata(b.meta, bucket), "decode", bucket)  # outside fgraph: plans for itself, once
    torch.testing.assert_close(out.double(), b.expected(), rtol=1e-5, atol=1e-5)
    assert plans_made(bucket) == before + 1


def test_flashinfer_two_engines_of_other_block_table_widths_alternate(fake_flashinfer):
    """Two jitted steps in one process whose block tables differ in width (two engines with different max_seq_len),
    calls alternating, same decode bucket: each equals eager. A decode plan serves the wrappers of its bucket and
    block-table width only; planning the narrower engine's wrapper from the wider one's plan overflowed its page
    buffers (an FgraphError: "60 pages in use, the decode buffers hold 40"), issue #32 item 8."""
    engines = {  # name: (jitted step, sequence lengths at step 0, Case options), the narrow one first
        "narrow": (jit_toy(buckets=(8,)), [1, 4, 5, 9, 13], {"max_pages": 5}),
        "wide": (jit_toy(buckets=(8,)), [29, 30, 31, 32, 25, 26, 27, 28], {"max_pages": 16, "num_pages": 72}),
    }
    caches = {}
    for step in range(3):  # lengths +1 a step: some sequences enter new pages
        for name, (f, lens, opts) in engines.items():
            case = Case([1] * len(lens), [n + step for n in lens], 4, 2, dtype=torch.float32, seed=step, **opts)
            cache, batch = toy_inputs(case)
            if name not in caches:
                caches[name] = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
            else:  # graphs read state by address: refill the same tensors
                refill(caches[name], cache)
            want, _ = toy_step(cache, batch, routine="decode", backend="flashinfer")
            got, caches[name] = f(caches[name], batch, routine="decode", backend="flashinfer")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sorted({key[-1] for key in FI._wrappers if key[1] == 8}) == [5, 16]
