"""Paged attention on the GPU: every backend x routine, eager and captured with torch.cuda.CUDAGraph directly,
against a float64 reference (bf16 tolerance), replayed on new metadata several times.

Graphs are captured the way fgraph captures them: on an all-padding batch (every metadata leaf cut to its
`extra` rows, then padded), after one eager warm-up, with the plan hook run (capturing=True) first. Every
replay then writes a new batch into the static inputs and runs the hook first, as fgraph.jit does. The lengths
of the replays swing from 1 to max_seq_len: host-side decisions may depend on the signature only.

Unused pages, page tails past each sequence's length, and the scratch page (but its slot 0, which padded
tokens write) hold NaN: a kernel reading anything it should not shows up as NaN or a wrong number.
"""

import math

import pytest
import torch

import fgraph
from fgraph.ops import attention as A

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF = torch.bfloat16
MAX_SEQ = 1024
SHAPES = [(14, 2, 64), (32, 8, 128), (8, 4, 128)]  # (Hq, Hkv, D): Qwen2.5-0.5B, Llama-3-8B, group 2
TOL = 1e-2  # relative error ||out - ref|| / ||ref||


def backend_or_skip(name):
    try:
        return A.resolve_backend(name, DEV)
    except fgraph.FgraphError as e:
        pytest.skip(str(e))


def reference(q, k_cache, v_cache, meta, scale):
    """float64, per sequence: gather its pages, causal mask aligned to the sequence's tail, explicit softmax."""
    qsl, sl, bt = meta.query_start_loc.tolist(), meta.seq_lens.tolist(), meta.block_table.tolist()
    page, hkv, d = k_cache.shape[1:]
    g = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s in range(len(sl)):
        L, t0, n = sl[s], qsl[s], qsl[s + 1] - qsl[s]
        pages = torch.tensor(bt[s][: -(-L // page)], device=q.device)
        k = k_cache[pages].reshape(-1, hkv, d)[:L].double().repeat_interleave(g, 1)  # [L, Hq, D]
        v = v_cache[pages].reshape(-1, hkv, d)[:L].double().repeat_interleave(g, 1)
        logits = torch.einsum("qhd,lhd->hql", q[t0 : t0 + n].double(), k) * scale
        hidden = torch.arange(L, device=q.device)[None, :] > (L - n + torch.arange(n, device=q.device))[:, None]
        logits = logits.masked_fill(hidden, -math.inf)
        w = torch.exp(logits - logits.max(-1, keepdim=True).values)
        out[t0 : t0 + n] = torch.einsum("hql,lhd->qhd", w / w.sum(-1, keepdim=True), v)
    return out


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


class Rig:
    """Static inputs for one signature (backend, routine, shape, bucket) and `layers` caches, as fgraph keeps
    them: the graph reads them by address, every call writes new values into them."""

    def __init__(self, backend, routine, shape, bucket, layers=2, seed=0):
        self.backend, self.routine, self.bucket = backend, routine, bucket
        self.hq, self.hkv, self.d = shape
        self.page = A.page_size_for(backend)
        self.max_pages = MAX_SEQ // self.page
        self.num_pages = 1 + bucket * self.max_pages
        self.gen = torch.Generator().manual_seed(seed)
        cache = lambda: torch.full((self.num_pages, self.page, self.hkv, self.d), math.nan, dtype=BF, device=DEV)
        self.k_cache = [cache() for _ in range(layers)]
        self.v_cache = [cache() for _ in range(layers)]
        self.q = torch.zeros(bucket, self.hq, self.d, dtype=BF, device=DEV)
        self.k = torch.zeros(bucket, self.hkv, self.d, dtype=BF, device=DEV)
        self.v = torch.zeros_like(self.k)
        dummy = self.all_padding()
        self.meta = A.AttentionMetadata(
            *(t.to(DEV) for t in (dummy.query_start_loc, dummy.seq_lens, dummy.block_table, dummy.slot_mapping))
        )

    def all_padding(self):
        """What fgraph captures with: each metadata leaf cut to its `extra` rows, then padded to the bucket."""
        one = A.build_metadata([1], [1], [[0]], self.page, self.max_pages)
        cut = A.AttentionMetadata(one.query_start_loc[:1], one.seq_lens[:0], one.block_table[:0], one.slot_mapping[:0])
        return A.pad_metadata(cut, self.bucket)

    def capture(self):
        """As fgraph captures: the plan hook (capturing), one eager warm-up (it creates flashinfer's wrappers and plans
        them from the hook's metadata), then one step in a CUDA graph -> (graph, its outputs)."""
        self.plan(self.all_padding(), capturing=True)
        self.attend()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = self.attend()
        return graph, outs

    def attend(self, meta=None):
        """One model step: every layer writes its k/v and attends, all with the same metadata."""
        meta = self.meta if meta is None else meta
        return [
            A.attention(
                self.q, self.k, self.v, kc, vc, meta, backend=self.backend, routine=self.routine, max_seq_len=MAX_SEQ
            )
            for kc, vc in zip(self.k_cache, self.v_cache)
        ]

    def new_batch(self, qlens, seqlens):
        """Fresh pages and KV history for S sequences, written in place; returns the unpadded host metadata."""
        free = (torch.randperm(self.num_pages - 1, generator=self.gen) + 1).tolist()
        tables = self.tables = [[free.pop() for _ in range(-(-n // self.page))] for n in seqlens]
        self.unused = torch.tensor(free, dtype=torch.int64, device=DEV)
        meta = A.build_metadata(qlens, seqlens, tables, self.page, self.max_pages)
        hist = [
            t[j // self.page] * self.page + j % self.page
            for t, q, n in zip(tables, qlens, seqlens)
            for j in range(n - q)
        ]
        hist = torch.tensor(hist, dtype=torch.int64, device=DEV)
        for c in self.k_cache + self.v_cache:
            c.fill_(math.nan)
            c.view(-1, self.hkv, self.d)[hist] = torch.randn(len(hist), self.hkv, self.d, generator=self.gen).to(
                DEV, BF
            )
        N = sum(qlens)
        for t, h in ((self.q, self.hq), (self.k, self.hkv), (self.v, self.hkv)):
            t.copy_(torch.randn(self.bucket, h, self.d, generator=self.gen).to(BF))  # padded rows too: finite
        return meta, N

    def load(self, meta):
        """Copy a padded host batch into the static metadata (as fgraph's one host->device transfer does)."""
        padded = A.pad_metadata(meta, self.bucket)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            getattr(self.meta, name).copy_(getattr(padded, name))
        return padded

    def plan(self, padded, capturing=False):
        A.plan_attention(
            padded,
            backend=self.backend,
            routine=self.routine,
            page_size=self.page,
            scale=self.d**-0.5,
            capturing=capturing,
        )

    def check(self, outs, meta, N):
        """Every layer's real rows against the reference; unused pages untouched."""
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            assert torch.isfinite(out[:N]).all(), f"layer {i}: non-finite outputs"
            ref = reference(self.q[:N], self.k_cache[i], self.v_cache[i], meta, self.d**-0.5)
            err = rel_err(out[:N], ref)
            assert err < TOL, f"layer {i}: relative error {err:.2e}"
            assert self.k_cache[i][self.unused].isnan().all() and self.v_cache[i][self.unused].isnan().all()


def trials(routine, bucket, real):
    """(query_lens, seq_lens) per replay: random lengths, all 1, all max, random again."""
    g = torch.Generator().manual_seed(bucket)
    if routine == "decode":
        rnd = lambda: torch.randint(1, MAX_SEQ + 1, (real,), generator=g).tolist()
        return [([1] * real, rnd()), ([1] * real, [1] * real), ([1] * real, [MAX_SEQ] * real), ([1] * real, rnd())]
    qlens = [1, 1, 1, 17, 64, 5][:real] if bucket >= 89 else [1] * real
    rnd = lambda: [int(torch.randint(q, MAX_SEQ + 1, (1,), generator=g)) for q in qlens]
    return [(qlens, rnd()), ([1] * len(qlens), [1] * len(qlens)), ([bucket], [MAX_SEQ]), (qlens, rnd())]


def run_captured(backend, routine, shape, bucket, real):
    rig = Rig(backend, routine, shape, bucket)
    graph, outs = rig.capture()
    for qlens, seqlens in trials(routine, bucket, real):
        meta, N = rig.new_batch(qlens, seqlens)
        rig.plan(rig.load(meta))
        graph.replay()
        rig.check(outs, meta, N)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("routine", ["decode", "mixed"])
@pytest.mark.parametrize("backend", A.BACKENDS)
def test_captured_matches_reference(backend, routine, shape):
    backend_or_skip(backend)
    run_captured(backend, routine, shape, 8 if routine == "decode" else 128, 7 if routine == "decode" else 6)


@pytest.mark.parametrize("bucket, real", [(1, 1), (8, 7), (64, 64)])
@pytest.mark.parametrize("backend", A.BACKENDS)
def test_decode_full_graph_per_bucket(backend, bucket, real):
    backend_or_skip(backend)
    run_captured(backend, "decode", (14, 2, 64), bucket, real)


@pytest.mark.parametrize("bucket, real", [(1, 1), (128, 6), (512, 6)])
@pytest.mark.parametrize("backend", ["flash_attn", "flashinfer"])
def test_mixed_full_graph(backend, bucket, real):
    """512 at 8B's shapes: flashinfer's graph-mode prefill needs more float workspace than the default."""
    backend_or_skip(backend)
    run_captured(backend, "mixed", (32, 8, 128), bucket, real)


def steps_behind(rig, graph, outs, metas, sync):
    """Each padded metadata loaded (from pinned memory, no host sync), planned and replayed, in turn; the outputs
    of every replay copied out. sync=False: all behind a ~0.1 s kernel, so the host plans a step while the device
    has not yet run the last one's plan copy."""
    got = []
    if not sync:
        torch.cuda._sleep(200_000_000)
    for padded, pinned, _ in metas:
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            getattr(rig.meta, name).copy_(getattr(pinned, name), non_blocking=True)
        rig.plan(padded)
        graph.replay()
        got.append([o.clone() for o in outs])
        if sync:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_flashinfer_plans_made_while_the_gpu_is_behind_replay_as_when_it_is_not(routine):
    """flashinfer's C++ plan writes the schedule into a pinned buffer and queues its copy; fgraph does not wait for
    the device between steps. Steps whose schedules differ (alternating page counts and query offsets), planned
    and replayed with no sync behind a long kernel, must give the very bits of the same steps synced one by one
    (from the same caches): the plan waits for the last one's copy out of that buffer (_Fence), and did wait."""
    from fgraph.ops import _attn_flashinfer as FI

    backend_or_skip("flashinfer")
    FI.reset()
    bucket = 8 if routine == "decode" else 128
    rig = Rig("flashinfer", routine, (32, 8, 128), bucket)
    graph, outs = rig.capture()
    real = 7 if routine == "decode" else 6
    rig.new_batch([1] * real, [MAX_SEQ - 200] * real)  # history on every page the steps below read
    metas = []
    for i in range(4):  # steps on those pages, each with other page counts (and query offsets) than the last
        seqlens = [MAX_SEQ // (2 + (i + j) % 3) - 60 * (i % 2) for j in range(real)]
        qlens = [1] * real if routine == "decode" else [1 + (i * 37 + 11 * j) % 20 for j in range(real)]  # <= 120
        padded = A.pad_metadata(A.build_metadata(qlens, seqlens, rig.tables, rig.page, rig.max_pages), bucket)
        pinned = A.AttentionMetadata(
            *(getattr(padded, n).pin_memory() for n in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"))
        )
        metas.append((padded, pinned, sum(qlens)))
    start = [c.clone() for c in rig.k_cache + rig.v_cache]
    synced = steps_behind(rig, graph, outs, metas, sync=True)
    for c, s in zip(rig.k_cache + rig.v_cache, start):
        c.copy_(s)
    fences = [w.fence for w in FI._wrappers.values() if w.fence is not None]
    waits = sum(f.waits for f in fences)
    behind = steps_behind(rig, graph, outs, metas, sync=False)
    for i, (a, b, (_, _, N)) in enumerate(zip(synced, behind, metas)):
        for layer, (x, y) in enumerate(zip(a, b)):  # the real rows (padded tokens race for the scratch slot)
            assert torch.equal(x[:N], y[:N]), f"step {i}, layer {layer}: replayed behind the device != synced"
    assert sum(f.waits for f in fences) > waits, "no plan found the last one's copy queued: the test tested nothing"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("routine", ["decode", "mixed"])
@pytest.mark.parametrize("backend", A.BACKENDS)
def test_eager_matches_reference(backend, routine, shape):
    """As in a piecewise signature (static inputs, hook before each call), then as a plain eager call on fresh
    unpadded tensors (flashinfer plans from the device then)."""
    backend_or_skip(backend)
    bucket, real = (8, 7) if routine == "decode" else (128, 6)
    rig = Rig(backend, routine, shape, bucket)
    for qlens, seqlens in trials(routine, bucket, real):
        meta, N = rig.new_batch(qlens, seqlens)
        rig.plan(rig.load(meta))
        rig.check(rig.attend(), meta, N)
    meta, N = rig.new_batch(*trials(routine, bucket, real)[0])
    rig.q, rig.k, rig.v = rig.q[:N], rig.k[:N], rig.v[:N]  # unpadded, outside any bucket
    rig.check(rig.attend(meta.to(DEV)), meta, N)


def test_flashinfer_plan_host_time():
    """The plan hook's host work per step (metadata + plan()) by batch, next to the stock plan() fed CPU page
    ids, printed for the record. A loose bound only: this is host time on a shared machine."""
    import time

    from fgraph.ops import _attn_flashinfer as FI

    backend_or_skip("flashinfer")
    FI.reset()  # only this test's wrappers: a plan serves every wrapper of its bucket and head config

    def us(fn, n=100):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    for B in (1, 8, 64, 256):
        rig = Rig("flashinfer", "decode", (14, 2, 64), B, layers=1)
        meta, _ = rig.new_batch([1] * B, [MAX_SEQ // 2 + 3] * B)
        padded = rig.load(meta)
        rig.plan(padded)
        rig.attend()
        torch.cuda.synchronize()
        h = FI.host_plan(padded.query_start_loc, padded.seq_lens, padded.block_table, rig.page)
        w = next(
            w for key, w in FI._wrappers.items() if key[0] == "decode" and key[1] == B and key[3][:3] == (14, 2, 64)
        )
        t = dict(
            meta=us(lambda: FI.host_plan(padded.query_start_loc, padded.seq_lens, padded.block_table, rig.page)),
            hook=us(lambda: rig.plan(padded)),
            stock=us(
                lambda: w.fi.plan(
                    h.t("indptr"),
                    h.t("indices"),
                    h.t("last"),
                    14,
                    2,
                    64,
                    rig.page,
                    q_data_type=BF,
                    kv_data_type=BF,
                    sm_scale=64**-0.5,
                )
            ),
        )
        w.planned = None  # the stock plan() above replaced the wrapper's plan behind our back
        t["replan"] = us(lambda: (setattr(w, "planned", None), rig.plan(padded)))  # forced: the module's plan call
        print(f"flashinfer decode plan, batch {B}: " + ", ".join(f"{k} {v:.0f} us" for k, v in t.items()))
        assert t["hook"] < 5000


@pytest.mark.parametrize(
    "shape, paths_on",
    [((14, 2, 64), False), ((14, 2, 64), True), ((8, 4, 128), False)],
    ids=["tensor-cores", "tensor-cores-paths-on", "cuda-cores"],
)
def test_flashinfer_decode_plan_paths(shape, paths_on, monkeypatch):
    """A captured decode graph replayed over steps whose lengths grow by one (page-aligned starts: most steps
    keep every page count, so the plan is skipped; every page_size-th step re-plans through the module's plan
    call) and then jump: every replay against the reference, and each plan path taken at least once."""
    from fgraph.ops import _attn_flashinfer as FI

    backend_or_skip("flashinfer")
    FI.reset()
    monkeypatch.setattr(FI, "TENSOR_CORE_PLAN_PATHS", paths_on)
    bucket, real = 8, 7
    rig = Rig("flashinfer", "decode", shape, bucket)
    graph, outs = rig.capture()
    starts = [rig.page * (3 + 2 * i) + 1 for i in range(real)]
    for grow in list(range(2 * rig.page + 2)) + [300, 301, 700]:
        meta, N = rig.new_batch([1] * real, [n + grow for n in starts])
        rig.plan(rig.load(meta))
        graph.replay()
        rig.check(outs, meta, N)
    counts = FI.stats()
    print(f"flashinfer decode plans {shape}: {counts}")
    if shape[0] // shape[1] > 2 and not paths_on:  # tensor cores: the API every step (_Wrapper._plan_decode)
        assert counts["fast"] > 0 and counts["skip"] == counts["module"] == 0, counts
    else:
        assert counts["skip"] > 0 and counts["module"] > 0 and counts["fast"] == 1, counts


def test_benchmark_runs(tmp_path):
    """benchmarks/attention_bench.py end to end on one small configuration (a smoke test, not a measurement)."""
    from benchmarks import attention_bench

    rows = attention_bench.main(
        ["--quick", "--models", "qwen2.5-0.5b", "--batches", "8", "--iters", "3", "--out", str(tmp_path)]
    )
    assert rows and all("us" in r for r in rows), rows
    assert (tmp_path / "attention.json").exists()


def toy_step(cache, batch, routine="mixed", backend="torch"):
    """Every layer attends with the same q/k/v over its own cache -> ([N, layers, Hq, D], cache)."""
    outs = [
        A.attention(
            batch["q"],
            batch["k"],
            batch["v"],
            kc,
            vc,
            batch["meta"],
            routine=routine,
            backend=backend,
            max_seq_len=MAX_SEQ,
        )
        for kc, vc in zip(cache.k, cache.v)
    ]
    return torch.stack(outs, 1), cache


@pytest.mark.parametrize("backend", A.BACKENDS)
def test_fgraph_jit_full_graphs(backend):
    """Under fgraph.jit(mode="FULL"), host batches, decode and mixed calls interleaved: every signature is one
    graph, flashinfer's mixed ones too; all against the reference."""
    backend_or_skip(backend)
    spec = {"q": fgraph.Batched(), "k": fgraph.Batched(), "v": fgraph.Batched(), "meta": A.metadata_batching()}
    step = fgraph.jit(
        toy_step, static=["routine", "backend"], donate=["cache"], batch={"batch": spec}, buckets=[8, 128], mode="FULL"
    )
    rig = Rig(backend, "mixed", (32, 8, 128), 128)
    cache = A.KVCache(rig.k_cache, rig.v_cache)
    for routine, (qlens, seqlens) in [
        ("decode", trials("decode", 8, 7)[0]),
        ("mixed", trials("mixed", 128, 6)[0]),
        ("decode", trials("decode", 8, 7)[2]),
        ("mixed", trials("mixed", 128, 6)[3]),
    ]:
        meta, N = rig.new_batch(qlens, seqlens)
        batch = {"q": rig.q[:N].cpu(), "k": rig.k[:N].cpu(), "v": rig.v[:N].cpu(), "meta": meta}
        out, cache = step(cache, batch, routine=routine, backend=backend)
        rig.check([out[:, i] for i in range(out.shape[1])], meta, N)
    modes = {dict(e.sig.statics)["routine"]: e.mode.name for e in step.entries.values()}
    assert modes == {"decode": "FULL", "mixed": "FULL"}, modes
