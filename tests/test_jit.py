"""fgraph.jit on the CPU: signatures, buckets and padding, splitting, mode resolution, plan hooks, counters.
Eager is the oracle: every result is compared with the same pure function run without fgraph."""

import pytest
import torch

import fgraph
from fgraph import Batched, Mode, Support
from tests import toys
from tests.toys import jitted, make, step


def eager(params, batch, **kw):
    with fgraph.disable_jit():
        return step(params, {"count": torch.zeros((), dtype=torch.int64)}, batch, **kw)[0]


def test_one_trace_serves_every_bucket_of_a_routine():
    f = jitted(mode="PIECEWISE", buckets=[4, 8, 16])
    params, state, _ = make()
    for n in (5, 6, 7, 8, 5):
        f(params, state, {"x": torch.randn(n, 8)}, routine="decode")
    f(params, state, {"x": torch.randn(3, 8)}, routine="decode")
    f(params, state, {"x": torch.randn(3, 8)}, routine="mixed")
    st = f.stats()
    assert len(st["signatures"]) == 3  # (decode, 8), (decode, 4), (mixed, 4): three graph sets...
    assert st["total"]["traces"] == 2 and st["total"]["calls"] == 7  # ...from two traces: the batch dim is symbolic
    assert st["signatures"]["(breaks=2, routine='decode', bucket=8)"] == {
        "traces": 1,
        "captures": 3,
        "warmups": 1,
        "replays": 5,
        "eager": 0,
        "calls": 5,
        "fast": 1,  # the replay path: a token count seen before (each new one is bound once)
        "padded": 3 + 2 + 1 + 0 + 3,
        "copies": 0,
        "copied_bytes": 0,
        "written_back": 0,
        "adopted": 0,
    }
    assert st["signatures"]["(breaks=2, routine='decode', bucket=4)"]["traces"] == 0


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_every_n_pads_slices_and_equals_eager(mode):
    f = jitted(mode=mode)
    params, state, _ = make()
    g = torch.Generator().manual_seed(1)
    for n in list(range(1, 65)) + [123]:
        x = torch.randn(n, 8, generator=g)
        out, _ = f(params, state, {"x": x}, routine="decode")
        assert out.shape == (n, 8)
        torch.testing.assert_close(out, eager(params, {"x": x}, routine="decode"))
    buckets = {s for s in fgraph.default_buckets() if s <= 64} | {128}
    assert len(f.stats()["signatures"]) == len(buckets)
    assert f.stats()["total"]["traces"] == 2  # bucket 1, and one symbolic trace for every bucket >= 2


def test_same_bucket_is_bitwise_equal_to_eager_at_that_size():
    f = jitted(mode="PIECEWISE", buckets=[8])
    params, state, batch = make(n=8)
    out, _ = f(params, state, batch, routine="decode")
    assert torch.equal(out, eager(params, batch, routine="decode"))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_k_breaks_make_k_plus_one_graph_pieces(k):
    f = jitted(mode="PIECEWISE", buckets=[8])
    params, state, batch = make()
    f(params, state, batch, routine="decode", breaks=k)
    (e,) = f.entries.values()
    assert [p.is_break for p in e.program.pieces] == [False, True] * k + [False]
    assert f.stats()["total"]["captures"] == k + 1


def test_consecutive_breaks_stay_together():
    def two(params, x):
        a, b = torch.empty_like(x), torch.empty_like(x)
        toys.toy_scale(a, x, 2.0)
        toys.toy_scale(b, x, 3.0)
        return a + b

    f = fgraph.jit(two, batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    out = f({}, torch.ones(3, 2))
    assert [p.is_break for p in next(iter(f.entries.values())).program.pieces] == [False, True, False]
    assert torch.equal(out, torch.full((3, 2), 5.0))


def test_breaks_run_eagerly_between_piecewise_replays():
    f = jitted(mode="PIECEWISE", buckets=[8])
    params, state, batch = make()
    f.capture(params, state, batch, routine="decode")
    before = toys.calls["scale"]
    f(params, state, batch, routine="decode")
    f(params, state, batch, routine="decode")
    assert toys.calls["scale"] - before == 4  # 2 breaks x 2 calls, each run in Python between replays


@pytest.mark.parametrize(
    "requested, routine, support, expected",
    [
        ("NONE", "decode", Support.ALWAYS, Mode.NONE),
        ("PIECEWISE", "decode", Support.NEVER, Mode.PIECEWISE),
        ("FULL", "decode", Support.ALWAYS, Mode.FULL),
        ("FULL", "mixed", Support.ALWAYS, Mode.FULL),
        ("FULL", "decode", Support.UNIFORM_DECODE, Mode.FULL),
        ("FULL", "mixed", Support.UNIFORM_DECODE, Mode.PIECEWISE),
        ("FULL", "decode", Support.NEVER, Mode.PIECEWISE),
        ("FULL_DECODE_ONLY", "decode", Support.ALWAYS, Mode.FULL),
        ("FULL_DECODE_ONLY", "mixed", Support.ALWAYS, Mode.NONE),
        ("FULL_DECODE_ONLY", "decode", Support.NEVER, Mode.PIECEWISE),
        ("FULL_AND_PIECEWISE", "decode", Support.UNIFORM_DECODE, Mode.FULL),
        ("FULL_AND_PIECEWISE", "mixed", Support.ALWAYS, Mode.PIECEWISE),
        ("FULL_AND_PIECEWISE", "decode", Support.NEVER, Mode.PIECEWISE),
    ],
)
def test_mode_resolution_table(requested, routine, support, expected):
    op = {Support.ALWAYS: toys.toy_scale, Support.UNIFORM_DECODE: toys.toy_decode_only, Support.NEVER: toys.toy_never}[
        support
    ]

    def fn(x, routine):
        o = torch.empty_like(x)
        op(o, x, 2.0) if op is toys.toy_scale else op(o, x)
        return o * 2

    f = fgraph.jit(fn, static=["routine"], batch={"x": Batched()}, mode=requested, buckets=[4])
    out = f(torch.ones(3, 2), routine=routine)
    (e,) = f.entries.values()
    assert e.mode is expected
    if (
        expected is Mode.PIECEWISE
        and requested.startswith("FULL")
        and Mode(requested).for_routine(routine == "decode") is Mode.FULL
    ):
        assert "FULL requested -> PIECEWISE" in e.reason
    with fgraph.disable_jit():
        assert torch.equal(out, fn(torch.ones(3, 2), routine))


def scaled_by_lens(x, lens):
    """x * lens per row, through the planned toy break (its plan hook records the padded host inputs)."""
    o = torch.empty_like(x)
    toys.toy_planned(o, x, lens)
    return o


def jit_planned(buckets):
    return fgraph.jit(scaled_by_lens, batch={"x": Batched(), "lens": Batched(pad=1)}, mode="FULL", buckets=buckets)


def test_plan_hook_sees_padded_host_inputs_before_every_execution():
    f = jit_planned(buckets=[4])
    toys.calls["plan"].clear()
    f.capture(torch.ones(3, 2), torch.tensor([1, 2, 3]))
    out = f(torch.ones(3, 2), torch.tensor([1, 2, 3]))
    assert [(b, n, cap) for b, n, cap, _ in toys.calls["plan"]] == [(4, 0, True), (4, 3, False)]
    assert toys.calls["plan"][-1][3]["lens"].tolist() == [1, 2, 3, 1]
    assert out.tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_padding_stays_right_when_calls_repeat_a_size_or_change_it():
    """Input buffers keep the padding rows of the last call and rewrite only the real rows; a call repeating the last
    call's sizes goes straight to one copy of the real rows. Whatever the sequence of sizes, the padded inputs are
    the real rows, then the padding value."""
    f = jit_planned(buckets=[8])
    toys.calls["plan"].clear()
    prev = None
    for n, v in [(5, 2), (5, 3), (3, 4), (3, 5), (5, 6), (8, 7), (8, 8), (5, 9), (5, 10)]:
        lens = torch.arange(n) + v
        out = f(torch.full((n, 2), float(v)), lens)
        assert toys.calls["plan"][-1][3]["lens"].tolist() == lens.tolist() + [1] * (8 - n), (n, v)
        assert out.tolist() == [[float(v) * k] * 2 for k in lens.tolist()], (n, v)
        (e,) = f.entries.values()
        # one copy of the real rows (remembered for the next call) when the padding in place is still right: the
        # same size as the last call, or a full bucket; another size pads in the loop
        if prev is not None:
            heads = (e.buffers.graph_mirror or e.buffers).heads  # (config.inputs_in_graph: the graph's own mirror)
            assert (None in heads) == (n == prev or n == 8), (n, v)
        prev = n


@pytest.mark.parametrize("buckets, rows", [([4], None), ([1], 1)], ids=["symbolic", "static"])
def test_plan_hook_sees_the_avals_of_every_tensor_argument(buckets, rows):
    """PlanCall.avals: every tensor argument of the break as traced, batched inputs and tensors made inside the
    function alike: its shape (None for the symbolic batch dim; a trace at bucket 1 is static), dtype and device."""

    def fn(x, lens, w):
        h = (x @ w).double()  # [N, 3] float64, made inside
        o = torch.empty_like(h)
        toys.toy_planned(o, h, lens)
        return o

    f = fgraph.jit(fn, batch={"x": Batched(), "lens": Batched(pad=1)}, mode="FULL", buckets=buckets)
    toys.calls["avals"].clear()
    out = f(torch.ones(1, 2), torch.tensor([3]), torch.ones(2, 3))
    assert out.tolist() == [[6.0, 6.0, 6.0]]
    want = {
        "out": fgraph.Aval((rows, 3), torch.float64, "cpu"),
        "x": fgraph.Aval((rows, 3), torch.float64, "cpu"),
        "lens": fgraph.Aval((rows,), torch.int64, "cpu"),
    }
    assert toys.calls["avals"] == [want, want]  # the capture's hook and the call's
    assert toys.calls["avals"][0] is toys.calls["avals"][1]  # read once per trace, not per call


def test_call_sites_with_other_avals_are_planned_apart():
    """Two breaks with equal constant arguments over the same batched input are one plan site when their tensor
    arguments have the same avals, two when they differ (a hook may make per-shape state for each)."""

    def fn(x, lens, dtype):
        outs = []
        for h in (x + 1, x * 2, (x + 3).to(dtype)):  # made inside: the sites read only `lens` as an input
            outs.append(torch.empty_like(h))
            toys.toy_planned(outs[-1], h, lens)
        return outs

    f = fgraph.jit(fn, static=["dtype"], batch={"x": Batched(), "lens": Batched(pad=1)}, mode="FULL", buckets=[4])
    for dtype, sites in [(torch.float32, 1), (torch.float64, 2)]:
        toys.calls["avals"].clear()
        f(torch.ones(3, 2), torch.tensor([1, 2, 3]), dtype=dtype)
        (e,) = [e for e in f.entries.values() if ("dtype", dtype) in e.sig.statics]
        assert len(e.plans) == sites and len(toys.calls["avals"]) == 2 * sites
        assert {a["x"].dtype for a in toys.calls["avals"]} == {torch.float32, dtype}


@pytest.mark.parametrize("planned", [True, False])
def test_plan_needed_rules_out_call_sites_once_per_trace(planned):
    def fn(x, lens):
        o = torch.empty_like(x)
        toys.toy_maybe_planned(o, x, lens, planned)
        return o

    f = fgraph.jit(fn, batch={"x": Batched(), "lens": Batched(pad=1)}, mode="FULL", buckets=[4])
    toys.calls["plan"].clear()
    assert f(torch.ones(3, 2), torch.tensor([1, 2, 3])).tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert len(toys.calls["plan"]) == (2 if planned else 0)  # capture + the call, or never
    assert len(next(iter(f.entries.values())).plans) == int(planned)


def test_oversize_runs_eagerly_and_is_counted():
    f = jitted(mode="PIECEWISE", buckets=[4])
    params, state, _ = make()
    x = torch.randn(9, 8)
    out, _ = f(params, state, {"x": x}, routine="decode")
    torch.testing.assert_close(out, eager(params, {"x": x}, routine="decode"))
    assert (
        f.stats()["fallbacks"] == {"unseen": 0, "oversize": 1, "cap": 0, "oom": 0, "empty": 0, "init": 0, "branch": 0}
        and not f.entries
    )


def test_sealed_function_never_captures_lazily():
    f = jitted(mode="PIECEWISE", buckets=[4, 8])
    params, state, batch = make()
    f.capture(params, state, batch, routine="decode")
    assert len(f.entries) == 2
    out, _ = f(params, state, batch, routine="mixed")  # unseen: eager
    assert len(f.entries) == 2 and f.stats()["fallbacks"]["unseen"] == 1
    torch.testing.assert_close(out, eager(params, batch, routine="mixed"))


def test_capture_counts_graphs_per_mode():
    params, state, batch = make()
    for mode, graphs in [("NONE", 0), ("PIECEWISE", 3), ("FULL", 1)]:
        f = jitted(mode=mode, buckets=[1, 2, 4, 8])
        f.capture(params, state, batch, routine=["decode", "mixed"], progress=False)
        # one trace per routine: capture runs the largest bucket first, and its symbolic trace serves bucket 1 too
        assert f.stats()["total"]["captures"] == 8 * graphs and f.stats()["total"]["traces"] == 2


def strided_step(batch):
    y = torch.cat([batch["x"], batch["x"]], 1)[:, :8]  # [N, 8], row stride 16: contiguous only when N == 1
    return y.contiguous() * 2


@pytest.mark.parametrize("fn, traces", [(step, 1), (strided_step, 2)], ids=["shares", "asks-n-equals-1"])
def test_bucket_one_reuses_the_symbolic_trace_when_its_guards_hold_at_one(fn, traces):
    """The batch dim is traced without torch's 0/1 specialisation, so bucket 1 reuses the symbolic trace of the
    larger buckets when every guard holds at 1, and replays bitwise equal to eager there. A function whose trace
    asks whether N == 1 (`.contiguous()` of a strided view) records that guard: bucket 1 gets its own trace."""
    params, state, batch = make()
    kw = {"static": ["routine", "breaks"], "donate": ["state"]} if fn is step else {}
    f = fgraph.jit(fn, batch={"batch": Batched()}, buckets=[1, 8], mode="FULL", **kw)
    args = (params, state) if fn is step else ()
    f.capture(*args, batch, progress=False)
    assert f.stats()["total"]["traces"] == traces
    x = {"x": torch.randn(1, 8)}
    out = f(*args, x)
    with fgraph.disable_jit():
        want = fn(*args, x)
    if fn is step:
        out, want = out[0], want[0]
    assert torch.equal(out, want)


def test_full_and_piecewise_uses_two_graph_sets():
    f = jitted(mode="FULL_AND_PIECEWISE", buckets=[8])
    params, state, batch = make()
    f.capture(params, state, batch, routine=["decode", "mixed"], progress=False)
    modes = {dict(e.sig.statics)["routine"]: (e.mode, len(e.graphs)) for e in f.entries.values()}
    assert modes == {"decode": (Mode.FULL, 1), "mixed": (Mode.PIECEWISE, 3)}
    for routine in ("decode", "mixed"):
        out, _ = f(params, state, batch, routine=routine)
        torch.testing.assert_close(out, eager(params, batch, routine=routine))


def test_copy_outputs_survive_the_next_replay():
    f = jitted(mode="PIECEWISE", buckets=[8], copy_outputs=True)
    params, state, _ = make()
    a, _ = f(params, state, {"x": torch.ones(8, 8)}, routine="decode")
    a_val = a.clone()
    f(params, state, {"x": torch.zeros(8, 8)}, routine="decode")
    assert torch.equal(a, a_val)


def test_explain_cache_misses_names_what_differs(caplog):
    f = jitted(mode="NONE", buckets=[8])
    params, state, batch = make()
    f(params, state, batch, routine="decode")
    fgraph.config.explain_cache_misses = True
    try:
        with caplog.at_level("WARNING", logger="fgraph"):
            f(params, {"count": torch.zeros((), dtype=torch.int32)}, batch, routine="decode")
    finally:
        fgraph.config.explain_cache_misses = False
    assert (
        "closest captured signature (breaks=2, routine='decode', bucket=8) differs in state['count']: "
        "int32[]@cpu (captured int64[]@cpu)" in caplog.text
    )


def test_inductor_compiled_pieces_equal_eager():
    f = jitted(mode="PIECEWISE", buckets=[8], compile=True)
    params, state, batch = make()
    out, _ = f(params, state, batch, routine="decode")
    torch.testing.assert_close(out, eager(params, batch, routine="decode"))
    (e,) = f.entries.values()
    assert all(
        type(getattr(e.module, p.name).module).__name__ == "Compiled" for p in e.program.pieces if not p.is_break
    )


def test_compile_takes_inductor_options_for_the_pieces(monkeypatch):
    """compile={...} are Inductor config options (as torch.compile(options=...)), in force while each piece
    compiles; a misspelt option is refused when the function is jitted, not at the first capture."""
    from torch._inductor import compile_fx as cfx
    from torch._inductor import config as inductor_config

    seen = []
    real = cfx.compile_fx

    def spy(*args, **kwargs):
        seen.append(inductor_config.max_fusion_size)
        return real(*args, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    f = jitted(mode="PIECEWISE", buckets=[8], compile={"max_fusion_size": 7})
    params, state, batch = make()
    out, _ = f(params, state, batch, routine="decode")
    torch.testing.assert_close(out, eager(params, batch, routine="decode"))
    assert seen and set(seen) == {7} and inductor_config.max_fusion_size != 7
    with pytest.raises(fgraph.SignatureError, match=r"compile= names \['max_fusion_sise'\].*Inductor config"):
        jitted(compile={"max_fusion_sise": 7})
    with pytest.raises(fgraph.SignatureError, match="neither a bool nor a dict"):
        jitted(compile="max-autotune")


def test_compiled_pieces_keep_residual_adds_out_of_the_gemms():
    """Inductor folds `x + a @ b` into addmm(x, a, b) when the sum leaves the piece, and cuBLAS's addmm copies x
    into its output first (2 device copies per layer on the H200). fgraph's post-grad pass turns such addmms back
    into mm + add; a bias (a 1-D addend) keeps its addmm (a GEMM epilogue, no copy)."""
    import torch.fx as fx

    from fgraph.compile import residual_adds_out_of_gemms

    aten = torch.ops.aten
    x, a, b, bias = torch.randn(4, 8), torch.randn(4, 16), torch.randn(16, 8), torch.randn(8)
    g = fx.Graph()
    px, pa, pb, pbias = (g.placeholder(n) for n in ("x", "a", "b", "bias"))
    res = g.call_function(aten.addmm.default, (px, pa, pb))
    biased = g.call_function(aten.addmm.default, (pbias, pa, pb))
    for node, val in ((px, x), (pa, a), (pb, b), (pbias, bias), (res, x + a @ b), (biased, bias + a @ b)):
        node.meta["val"] = val
    g.output((res, biased))
    residual_adds_out_of_gemms()(g)
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert targets.count(aten.addmm.default) == 1 and aten.mm.default in targets and aten.add.Tensor in targets
    got = fx.GraphModule(torch.nn.Module(), g)(x, a, b, bias)
    torch.testing.assert_close(got, (x + a @ b, bias + a @ b))


def repeat_last(t, size):  # a callable pad must accept the empty leaf of capture's all-padding dummy
    return torch.cat([t, torch.full((size - len(t),), t[-1].item() if len(t) else 0, dtype=t.dtype)])


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16])  # numpy host path, and the torch path
def test_pad_modes_scalar_ramp_and_callable(dtype):
    """Each batched leaf is padded to bucket + extra: a fill value, "ramp" (offsets continue by one up to the
    bucket) or a callable; rows of a shorter call after a longer one are re-padded, never left stale."""

    def fn(a, starts, c):
        return a * 1, starts * 1, c * 1

    f = fgraph.jit(
        fn,
        batch={"a": Batched(pad=7), "starts": Batched(pad="ramp", extra=1), "c": Batched(pad=repeat_last)},
        mode="PIECEWISE",
        buckets=[8],
        copy_outputs=True,
    )
    ints = lambda *v: torch.tensor(v, dtype=dtype)
    a, s, c = f(ints(1, 2, 3, 4, 5), ints(0, 2, 3, 5, 6, 9), ints(4, 5, 6, 7, 8))
    assert a.tolist() == [1, 2, 3, 4, 5] and c.tolist() == [4, 5, 6, 7, 8]  # outputs sliced back to N = 5
    (e,) = f.entries.values()
    assert e.buffers.host[1].tolist() == [0, 2, 3, 5, 6, 9, 8, 8, 8]  # ramp from 9 clamps at the bucket
    f(ints(1, 2), ints(0, 1, 2), ints(4, 5))
    assert e.buffers.host[0].tolist() == [1, 2, 7, 7, 7, 7, 7, 7]
    assert e.buffers.host[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert e.buffers.host[2].tolist() == [4, 5, 5, 5, 5, 5, 5, 5]
    f(ints(1, 2), ints(0, 3, 4), ints(4, 5))  # same length, new data: a "ramp" tail must follow it
    assert e.buffers.host[1].tolist() == [0, 3, 4, 5, 6, 7, 8, 8, 8]


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16])  # numpy host path, and the torch path
def test_batch_axis_other_than_the_first_is_padded_along_it(dtype):
    """Batched(axis=1): [2, N] leaves padded along N (fill 7); a shorter call after a longer one re-pads what the
    longer one wrote. Outputs are cut back to N along the dims sized by it (tests/padding/test_padding.py)."""
    f = fgraph.jit(lambda x: x.T * 2, batch={"x": Batched(axis=1, pad=7)}, mode="FULL", buckets=[8])
    for n in (5, 3, 3, 8):
        x = torch.arange(2 * n, dtype=dtype).view(2, n)
        out = f(x)
        assert out.shape == (n, 2) and torch.equal(out, x.T * 2)
        (e,) = f.entries.values()
        want = torch.cat([x, torch.full((2, 8 - n), 7, dtype=dtype)], 1)
        assert torch.equal(e.buffers.host[0], want)


def test_a_function_returning_none_runs_once_per_call():
    def bump(x, state):
        state["n"].add_(x.sum())

    f = fgraph.jit(bump, donate=["state"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    state = {"n": torch.zeros(())}
    for _ in range(3):
        assert f(torch.ones(3), state) is None
    assert state["n"].item() == 9  # three calls of 3 (what warm-up and capture added is put back)
    assert f.stats()["total"]["calls"] == 3


def test_log_captures_reports_each_signature(caplog):
    f = jitted(mode="PIECEWISE", buckets=[8])
    params, state, batch = make()
    fgraph.config.log_captures = True
    try:
        with caplog.at_level("WARNING", logger="fgraph"):
            f.capture(params, state, batch, routine="decode", progress=False)
    finally:
        fgraph.config.log_captures = False
    assert "captured 3 PIECEWISE graph(s) for (breaks=2, routine='decode', bucket=8)" in caplog.text


@pytest.mark.parametrize("in_graph", [True, False], ids=["copied-by-the-graph", "copied-by-the-call"])
def test_inputs_copied_in_by_the_graph_or_the_call_give_the_same_results(in_graph, monkeypatch):
    """fgraph.config.inputs_in_graph (the default): FULL graphs copy the padded inputs in from a mirror of their
    own (on the CPU the stand-in graph reruns that copy); off, each call copies them. Sizes that are not buckets,
    both routines, a plan hook reading the padded host inputs: the same results as eager, and the mirror is what
    the hook saw."""
    monkeypatch.setattr(fgraph.config, "inputs_in_graph", in_graph)
    f = jitted(mode="FULL", buckets=[8, 32])
    params, state, batch = make()
    f.capture(params, state, batch, routine=["decode", "mixed"], progress=False)
    assert all((e.buffers.graph_mirror is not None) == in_graph for e in f.entries.values())
    g = torch.Generator().manual_seed(3)
    for n in (7, 25, 8, 3, 25, 7):
        for routine in ("decode", "mixed"):
            x = torch.randn(n, 8, generator=g)
            out, _ = f(params, state, {"x": x}, routine=routine)
            torch.testing.assert_close(out, eager(params, {"x": x}, routine=routine))
    assert f.stats()["total"]["replays"] == 12

    h = jit_planned(buckets=[8])
    for n, v in [(5, 2), (5, 3), (3, 4), (8, 5)]:
        lens = torch.arange(n) + v
        out = h(torch.full((n, 2), float(v)), lens)
        (e,) = h.entries.values()
        assert toys.calls["plan"][-1][3]["lens"].tolist() == lens.tolist() + [1] * (8 - n)
        if in_graph:
            assert e.buffers.host is e.buffers.graph_mirror.host  # what the hook read: the graph's own mirror
        assert out.tolist() == [[float(v) * k] * 2 for k in lens.tolist()], (n, v)


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL"])
def test_a_value_made_once_per_execution_is_shared_by_its_breaks_and_never_reused_by_the_next(mode):
    """P.once_per_execution: three breaks of one call derive `lens - 1` once; the next call (other lengths, the
    same input buffers) derives it again, so no call reads a stale value. Outside fgraph.jit: once per break."""
    f = fgraph.jit(
        toys.shifted_layers, batch={"x": fgraph.Batched(), "lens": fgraph.Batched(pad=1)}, buckets=[8], mode=mode
    )
    f(torch.ones(5, 2), torch.arange(5) + 1)  # trace, warm up, capture
    for n, v in [(5, 2), (3, 7), (5, 4)]:
        x, lens = torch.full((n, 2), float(v)), torch.arange(n) + v
        before = toys.calls.get("shifted", 0)
        got = f(x, lens)
        assert toys.calls["shifted"] - before == 1, (mode, n, v)  # (the CPU stand-in graph reruns the breaks)
        before = toys.calls["shifted"]
        torch.testing.assert_close(got, toys.shifted_layers(x, lens))
        assert toys.calls["shifted"] - before == 3  # eager: no execution, each break makes its own
