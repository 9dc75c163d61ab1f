"""Paged attention on the CPU: the torch backend against a float64 reference, the padding contract, the KV
write, backend resolution, the break's trace and capture support, and the flashinfer backend's planning logic
(with a stand-in flashinfer whose kernels compute from the *plan*, so a stale plan gives wrong numbers).

Shapes are tiny (head dim 8, pages of 4 tokens) so every sequence spans several pages.
"""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fgraph
from fgraph import _fx
from fgraph.ops import _attn_flash
from fgraph.ops import _attn_flashinfer as FI
from fgraph.ops import attention as A
from tests.ops.attention_cases import (
    DECODE,
    GQA,
    MIXED,
    NAN,
    PAGE,
    TOY_BATCH,
    Case,
    D,
    FakeFlashAttnExtension,
    decode_wrapper_births,
    decode_wrapper_keys,
    fake_flashinfer,  # noqa: F401 (fixtures, taken by name)
    jit_toy,
    refill,
    same,
    toy_inputs,
    toy_step,
)


@pytest.mark.parametrize("hq, hkv", GQA)
@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED), ("mixed", ([1], [6]))])
def test_flash_attn_results_land_in_out(routine, lens, hq, hkv, monkeypatch):
    """The flash_attn backend hands the kernels the break's `out` (a strided view of it for folded GQA decode) and
    gets every head back where `out` keeps it, with no copy; a result computed elsewhere is copied in.
    The extension is a CPU stand-in (FakeFlashAttnExtension); the H200 tests check the real one
    against the same reference."""
    fake = FakeFlashAttnExtension()
    monkeypatch.setattr(_attn_flash, "_api", lambda: fake)
    monkeypatch.setitem(A.TAKES, "flash_attn", (None, None))  # the stand-in computes in any dtype (float64 here)
    monkeypatch.setattr(_attn_flash, "_num_sms", lambda index: 132)
    in_place, into = [], _attn_flash._into  # whether the kernel's result already was `out` (no copy kernel)
    monkeypatch.setattr(
        _attn_flash, "_into", lambda out, o: (in_place.append(o.data_ptr() == out.data_ptr()), into(out, o))
    )
    case = Case(*lens, hq, hkv)
    m = case.meta
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = torch.full_like(case.q, NAN)
    _attn_flash.forward(
        out,
        case.q,
        case.k,
        case.v,
        k_cache,
        v_cache,
        m.query_start_loc,
        m.seq_lens,
        m.block_table,
        m.slot_mapping,
        routine=routine,
        scale=D**-0.5,
        max_seq_len=64,
    )
    torch.testing.assert_close(out, case.expected())
    same(k_cache, case.written()[0])
    same(v_cache, case.written()[1])
    copied = routine == "mixed" and case.q.shape[0] == 1 and hq > hkv
    assert fake.copies_needed == copied and in_place == [not copied]


def test_trace_is_one_break_that_writes_the_cache():
    """Under fgraph's tracer attention is one break node that does the KV write itself: no index_copy_ or
    index_put_ outside it (Inductor would turn such a write into a copy of the cache layer), and the op's schema
    declares both caches written, so the trace's in-place checks see the mutation."""
    case = Case(*MIXED, 4, 2, dtype=torch.float32)
    meta = A.pad_metadata(case.meta, 24)
    pad = lambda x: torch.cat([x, x.new_zeros(24 - x.shape[0], *x.shape[1:])])

    def f(q, k, v, kc, vc, qsl, sl, bt, sm):
        return A.attention(q, k, v, kc, vc, A.AttentionMetadata(qsl, sl, bt, sm), routine="mixed", backend="torch")

    gm = make_fx(f, tracing_mode="fake")(
        pad(case.q),
        pad(case.k),
        pad(case.v),
        case.k_cache,
        case.v_cache,
        *(getattr(meta, n) for n in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")),
    )
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not {torch.ops.aten.index_copy_.default, torch.ops.aten.index_put_.default} & set(ops), ops
    assert ops.count(torch.ops.fgraph.attention.default) == 1
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.fgraph.attention.default)
    assert node.args[10:] == (None, None, "torch", "mixed", D**-0.5, 8 * PAGE, PAGE)  # no rope: cos, sin None
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    written = {names.index(t.name) if t.op == "placeholder" else str(t.target) for t in _fx.write_targets(node)}
    assert written == {3, 4, "aten.empty.memory_format"}, written  # kc, vc and out (allocated in the function)


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize("routine, lens", [("decode", DECODE), ("mixed", MIXED)])
def test_jit_matches_eager(routine, lens, backend, fake_flashinfer):
    """fgraph.jit (all-padding capture, padded replays, plan hook) against the unpadded eager call, twice."""
    step = jit_toy()
    for seed in (0, 1):
        case = Case(*lens, 4, 2, dtype=torch.float32, seed=seed)
        cache, batch = toy_inputs(case)
        if seed == 0:
            jcache = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
        else:  # the same cache tensors (graphs read state by address): refill them in place
            refill(jcache, cache)
        want, cache = toy_step(cache, batch, routine=routine, backend=backend)
        got, jcache = step(jcache, batch, routine=routine, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(jcache.k + jcache.v, cache.k + cache.v):
            same(a[1:], b[1:])
    stats = step.stats()["total"]
    assert stats["traces"] == 1 and stats["calls"] == 2
    if backend == "flashinfer":  # one plan per execution, from the hook: warm-up, then each call (the eager
        # oracle plans its own unpadded sequences); plans after the first may be module calls or skipped
        bucket = 8 if routine == "decode" else 32
        counts = [w.counts for key, w in FI._wrappers.items() if key[:2] == (routine, bucket)]
        assert len(counts) == 1 and sum(counts[0].values()) == 3, counts


def test_flashinfer_decode_buckets_after_the_first_are_captured_without_an_eager_warmup(fake_flashinfer, monkeypatch):
    """A FULL decode graph records its bucket's flashinfer wrapper, which must exist (and be planned) before the
    capture. The plan hook makes each bucket's wrapper from the traced q and k_cache (PlanCall.avals) and plans it,
    the first bucket's too, so only the first bucket is warmed up (once per trace: libraries initialise lazily),
    and the other buckets are captured with no eager run of the model (the donated counter, put back after
    capture, stays 0). Replays of every bucket equal eager."""

    def counted(cache, batch, state, routine="decode", backend="flashinfer"):
        state["calls"].add_(1)
        out, cache = toy_step(cache, batch, routine, backend)
        return out, cache, state

    births = decode_wrapper_births(fake_flashinfer, monkeypatch)
    f = fgraph.jit(
        counted,
        static=["routine", "backend"],
        donate=["cache", "state"],
        batch={"batch": TOY_BATCH},
        buckets=[8, 16, 32],
        mode="FULL",
    )
    jcache, batch = toy_inputs(Case(*DECODE, 4, 2, dtype=torch.float32, num_pages=200))
    state = {"calls": torch.zeros((), dtype=torch.int64)}
    f.capture(jcache, batch, state, routine="decode", backend="flashinfer", progress=False)
    assert state["calls"].item() == 0 and f.stats()["total"]["warmups"] == 1
    assert set(FI._wrappers) == decode_wrapper_keys(torch.float32, [8, 16, 32])
    assert births == [(True, False)] * 3  # all by the hook, none by the warm-up or inside a capture
    for n in (7, 12, 25):  # one call per bucket
        case = Case([1] * n, [1 + (5 * i) % 23 for i in range(n)], 4, 2, dtype=torch.float32, num_pages=200, seed=n)
        cache, batch = toy_inputs(case)
        refill(jcache, cache)  # the captured cache tensors, refilled in place
        want, _ = toy_step(cache, batch, "decode", "flashinfer")
        got, _, _ = f(jcache, batch, state, routine="decode", backend="flashinfer")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert f.stats()["total"]["replays"] == 3 and f.stats()["total"]["traces"] == 1


def test_flashinfer_decode_wrappers_are_never_made_inside_a_graph_capture(fake_flashinfer, monkeypatch):
    """Two models in one process (float32, then float64: two wrapper configurations of the same page size and scale),
    FULL decode, two buckets each: every decode wrapper a graph records is made by the plan hook before its capture,
    never inside it, where flashinfer could not plan it (the eager oracle makes its own, outside any graph). The
    H200 found the hook calling a bucket ready when its only wrapper was the other model's."""
    births = decode_wrapper_births(fake_flashinfer, monkeypatch)
    for dtype in (torch.float32, torch.float64):
        f = fgraph.jit(
            toy_step,
            static=["routine", "backend"],
            donate=["cache"],
            batch={"batch": TOY_BATCH},
            buckets=[8, 16],
            mode="FULL",
        )
        jcache, batch = toy_inputs(Case(*DECODE, 4, 2, dtype=dtype, num_pages=200))
        f.capture(jcache, batch, routine="decode", backend="flashinfer", progress=False)
        case = Case([1] * 12, [1 + (5 * i) % 23 for i in range(12)], 4, 2, dtype=dtype, num_pages=200, seed=12)
        cache, batch = toy_inputs(case)
        refill(jcache, cache)
        torch.testing.assert_close(
            f(jcache, batch, routine="decode", backend="flashinfer")[0],
            toy_step(cache, batch, "decode", "flashinfer")[0],
            rtol=1e-5,
            atol=1e-5,
        )
    # per model: its 2 buckets by the hook, then the eager oracle's 12 sequences (bucket 12) by its own call
    assert births == [(True, False), (True, False), (False, False)] * 2, births


def test_flashinfer_captures_make_only_their_own_decode_wrappers(fake_flashinfer):
    """Models of other dtypes in one process (float32, float64, float32 again; FULL decode, overlapping buckets):
    each capture makes exactly its own configuration's wrapper per bucket it captures, never one in another model's
    configuration (on the GPU each wrapper holds flashinfer's pinned buffers): no float64 wrapper for the buckets
    the float32 models captured, no float32 wrapper for the float64 model's. Each model's replays equal eager."""
    models, want = [], set()
    for dtype, buckets in [(torch.float32, [8, 16]), (torch.float64, [4, 16]), (torch.float32, [4, 32])]:
        f = fgraph.jit(
            toy_step,
            static=["routine", "backend"],
            donate=["cache"],
            batch={"batch": TOY_BATCH},
            buckets=buckets,
            mode="FULL",
        )
        jcache, batch = toy_inputs(Case(*DECODE, 4, 2, dtype=dtype, num_pages=200))
        f.capture(jcache, batch, routine="decode", backend="flashinfer", progress=False)
        want |= decode_wrapper_keys(dtype, buckets)
        assert set(FI._wrappers) == want, sorted(set(FI._wrappers) ^ want, key=repr)
        assert f.stats()["total"]["warmups"] == 1
        models.append((f, jcache, dtype))
    for f, jcache, dtype in models:  # 3 sequences: bucket 4 or 8
        case = Case([1] * 3, [2, 7, 13], 4, 2, dtype=dtype, num_pages=200, seed=3)
        cache, batch = toy_inputs(case)
        refill(jcache, cache)
        torch.testing.assert_close(
            f(jcache, batch, routine="decode", backend="flashinfer")[0],
            toy_step(cache, batch, "decode", "flashinfer")[0],
            rtol=1e-5,
            atol=1e-5,
        )
        assert f.stats()["total"]["replays"] == 1


def test_flashinfer_decode_graphs_copy_the_staged_metadata_in_themselves(fake_flashinfer, monkeypatch):
    """fgraph.config.inputs_in_graph: the FULL decode graph copies flashinfer's metadata in at its first layer,
    from a stage the plan hook writes (no upload of its own). Steps within pages, a new page, other pages: the
    same attention as eager; after the capture, every plan is staged for the graph, none uploaded."""
    monkeypatch.setattr(fgraph.config, "inputs_in_graph", True)
    step = jit_toy(buckets=(8,))
    lens = [1, 5, 9, 13, 17]
    jcache, staged = None, []
    for grow, seed in [(0, 0), (1, 0), (2, 0), (4, 0), (4, 1)]:
        case = Case([1] * 5, [n + grow for n in lens], 4, 2, dtype=torch.float32, seed=seed)
        cache, batch = toy_inputs(case)
        if jcache is None:
            jcache = A.KVCache(tuple(t.clone() for t in cache.k), tuple(t.clone() for t in cache.v))
        else:  # graphs read state by address: refill the same tensors
            refill(jcache, cache)
        want, _ = toy_step(cache, batch, routine="decode", backend="flashinfer")
        before = dict(FI._plan_bufs["cpu"].uploads) if "cpu" in FI._plan_bufs else None
        got, jcache = step(jcache, batch, routine="decode", backend="flashinfer")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if before is not None:
            after = FI._plan_bufs["cpu"].uploads
            staged.append({k: after[k] - before[k] for k in after if after[k] != before[k]})
    (e,) = [e for e in step.entries.values() if e.full is not None]
    assert e.buffers.graph_mirror is not None
    # step 1: the capture's copy and the call's; within pages only the lengths; a new page or other pages: all
    # (the eager oracle between the steps uploads its own plan, which does not touch the graph stage)
    assert staged == [
        {"graph_full": 2},
        {"graph_lengths": 1},
        {"graph_lengths": 1},
        {"graph_full": 1},
        {"graph_full": 1},
    ], staged
