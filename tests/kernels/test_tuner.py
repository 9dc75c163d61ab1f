"""How fgraph::linear's tuner searches a key's candidates (fgraph/kernels/_gemv.py `_fastest`): it compiles each
distinct kernel once (a split count is an argument, so K split 2, 4 or 8 ways is one kernel), screens every config
in a short timing, and picks among the few fastest by the full timing alone, never one slower than the limit.

The GPU's timing is stubbed (triton.testing.do_bench_cudagraph): the search runs on the CPU. That the kernels
compute the product at every split count is the GPU specs' (tests/kernels/test_linear_kernels.py)."""

import sys
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fgraph.kernels import _gemv, _workers

SHAPES = [(1, 896, 4864), (8, 896, 4864), (1, 2048, 2048), (3, 776, 768), (16, 151936, 896), (2, 40, 2100)]


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_every_candidate_shares_its_kernel_with_exactly_one_build(m, n, k):
    cfgs = _gemv.candidates(m, n, k)
    built = _gemv.builds(cfgs)
    assert set(built) <= set(cfgs) and len(set(built)) == len(built)
    for cfg in cfgs:  # the same constants: the base config, and whether K is split at all
        assert sum(b[:-1] == cfg[:-1] and (b[-1] > 1) == (cfg[-1] > 1) for b in built) == 1, cfg
    assert [c for c in cfgs if c[-1] == 1] == [b for b in built if b[-1] == 1]  # every unsplit config is built


@pytest.fixture
def stub_timing(monkeypatch):
    """do_bench_cudagraph stubbed: it runs the launch it is given once (the launch names its config) and returns the
    time `times` holds for that config at that `rep`; each timing is logged as (config, rep)."""
    state = {"times": {}, "log": [], "last": None}

    def bench(fn, rep):
        fn()
        state["log"].append((state["last"], rep))
        return state["times"][rep][state["last"]]

    testing = types.ModuleType("triton.testing")
    testing.do_bench_cudagraph = bench
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.testing", testing)
    return state


def search(state, cfgs, screen: dict, full: dict, limit_ms: float):
    """_fastest over cfgs with these timings -> (its pick, the configs compiled, the compiled count added)."""
    state["times"], state["log"] = {_gemv.SCREEN_MS: screen, _gemv.REP_MS: full}, []
    compiled = []

    def launch(cfg, warm=False):
        if warm:
            compiled.append(cfg)
            assert not state["log"], "a kernel compiled after the timing began"
        else:
            state["last"] = cfg

    before = _gemv.counts["compiled"]
    best = _gemv._fastest(cfgs, launch, limit_ms)
    return best, compiled, _gemv.counts["compiled"] - before


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # (reset per search)
@given(data=st.data())
def test_the_pick_is_the_fastest_finalist_by_its_full_timing_and_under_the_limit(stub_timing, data):
    m, n, k = data.draw(st.sampled_from(SHAPES))
    cfgs = _gemv.candidates(m, n, k)
    ms = st.floats(1.0, 3.0, allow_nan=False)
    screen = {c: data.draw(ms) for c in cfgs}
    full = {c: data.draw(ms) for c in cfgs}
    limit = data.draw(st.floats(0.5, 4.0))
    best, compiled, counted = search(stub_timing, cfgs, screen, full, limit)

    assert sorted(compiled) == sorted(_gemv.builds(cfgs)) and counted == len(compiled)
    screened = [c for c, rep in stub_timing["log"] if rep == _gemv.SCREEN_MS]
    finalists = [c for c, rep in stub_timing["log"] if rep == _gemv.REP_MS]
    assert sorted(screened) == sorted(cfgs)  # every config screened once
    fastest = min(screen.values())
    assert 1 <= len(finalists) <= _gemv.FINALISTS and min(cfgs, key=screen.get) in finalists
    assert all(screen[c] <= _gemv.SCREEN_KEEP * fastest for c in finalists)
    left_out = [c for c in cfgs if c not in finalists]
    assert all(screen[c] >= max(screen[f] for f in finalists) for c in left_out)  # the fastest ones go on
    under = [c for c in finalists if full[c] < limit]
    assert best == (min(under, key=full.get) if under else None)


def test_a_kernel_too_large_for_the_gpu_is_never_timed_nor_picked(stub_timing, monkeypatch):
    errors = pytest.importorskip("triton.runtime.errors")
    cfgs = _gemv.candidates(1, 896, 4864)
    too_large = next(c for c in _gemv.builds(cfgs) if c[-1] > 1)  # a split kernel: every split count runs it
    state = stub_timing

    def launch(cfg, warm=False):
        if warm and cfg == too_large:
            raise errors.OutOfResources(300_000, 232_448, "shared memory")  # (as Triton's loader raises it)
        state["last"] = cfg

    state["times"] = {rep: dict.fromkeys(cfgs, 2.0) | {too_large: 0.1} for rep in (_gemv.SCREEN_MS, _gemv.REP_MS)}
    state["log"], before = [], _gemv.counts["unfit"]
    best = _gemv._fastest(cfgs, launch, limit_ms=5.0)
    timed = {c for c, _ in state["log"]}
    same_kernel = [c for c in cfgs if c[:-1] == too_large[:-1] and c[-1] > 1]
    assert len(same_kernel) > 1 and best is not None and best not in same_kernel and not timed & set(same_kernel)
    assert _gemv.counts["unfit"] - before == 1
    assert _gemv._fastest([too_large], launch, limit_ms=5.0) is None  # none fits: cuBLAS


def test_a_config_fastest_in_the_screen_loses_to_a_finalist_faster_in_the_full_timing(stub_timing):
    a, b, c, d = _gemv.candidates(1, 896, 896)[:4]
    screen = {a: 1.0, b: 1.05, c: 1.1, d: 2.0}
    best, _, _ = search(stub_timing, [a, b, c, d], screen, {a: 1.2, b: 1.0, c: 1.1, d: 0.1}, limit_ms=5.0)
    assert best == b  # d was fastest in full, but 2x the screen's fastest: never a finalist
    assert (d, _gemv.REP_MS) not in stub_timing["log"]
    best, _, _ = search(stub_timing, [a, b, c, d], screen, {a: 1.2, b: 1.0, c: 1.1, d: 0.1}, limit_ms=0.9)
    assert best is None  # cuBLAS (the limit) beats every finalist


def test_a_candidate_is_compiled_and_loaded_in_the_compile_threads_not_at_its_first_launch(monkeypatch):
    """The warm path hands back nothing to launch: it compiles (a compile worker first, when there are any), then
    loads (module and launcher) what it compiled, so that no load is left for the timing loop (Triton <= 3.6 builds
    each launcher from C there)."""
    log = []

    class Compiled:
        def _init_handles(self):
            log.append("load")

    class Fn:
        def warmup(self, *args, grid, **kwargs):
            log.append(("compile", args, grid, kwargs))
            return Compiled()

    fn = Fn()
    precompile = lambda *job: log.append(("worker", *job))  # noqa: E731 (with compile_workers: a worker's first)
    monkeypatch.setattr(_workers, "precompile", precompile)
    _gemv._runner(fn, (4, 2), warm=True)(1, 2, BLOCK_N=16)
    job = ((1, 2), (4, 2), {"BLOCK_N": 16})
    assert log == [("worker", fn, job[1], job[0], job[2]), ("compile", *job), "load"]


def test_a_key_tuned_inside_another_counts_its_seconds_once(monkeypatch):
    """A group's tuner tunes each of its matmuls' keys first: the tuner's wall time is the outer key's alone."""
    clock = iter(range(100))
    monkeypatch.setattr(_gemv.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(_gemv.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_gemv.torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(_gemv._tuned, "load", lambda key, index: (False, None))
    monkeypatch.setattr(_gemv._tuned, "store", lambda key, index, cfg: None)
    monkeypatch.setattr(_gemv, "_choice", {})
    device = _gemv.torch.device("cuda", 0)
    inner = lambda: _gemv._chosen(("inner",), device, lambda: None)  # noqa: E731
    before = _gemv.seconds["tune"]
    _gemv._chosen(("outer",), device, lambda: inner() or None)
    # the outer key reads the clock at 0 and 2, the inner key at 1, inside it: 2 s, not 2 + the inner's
    assert _gemv.seconds["tune"] - before == 2 and set(_gemv._choice) == {("outer",), ("inner",)}
