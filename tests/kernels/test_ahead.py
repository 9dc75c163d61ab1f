"""Compiling ahead (fgraph/kernels/_gemv.py `ahead`, _gemv_ops.py `compile_ahead`): as a piece is compiled, the
kernels its fgraph::linear family's tuner will compile at the first call, and those fgraph::sdpa_decode launches
then, start compiling in the compile workers, from the trace's fake tensors. It pays only if every job started ahead
is one the first call then asks for: the same kernel, argument dtypes and constants.

No GPU here: the trace's values are fake CUDA tensors and the jobs are recorded, not sent. That each job started ahead
on the GPU is the one a cold first call's tuner waits for (no compile left late) is the GPU suite's
(tests/kernels/test_linear_kernels.py)."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fgraph
from fgraph import kernels
from fgraph.kernels import _gemv, _gemv_ops, _sdpa, _workers

pytest.importorskip("triton")
BF16 = torch.bfloat16


@pytest.fixture
def jobs(monkeypatch):
    """The jobs the tuner's compiles would send (`tuner`) and those started ahead (`ahead`), each as (kernel, grid,
    argument dtypes or values, constants); no CUDA device context, no tuned choices on disk or in memory."""
    log = {"tuner": [], "ahead": []}

    def recorder(into):
        def record(fn, grid, *args, **kwargs):
            args = tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)
            log[into].append((fn.fn.__name__, grid, args, tuple(sorted(kwargs.items()))))

        return record

    monkeypatch.setattr(_workers, "compile_and_load", recorder("tuner"))
    monkeypatch.setattr(_workers, "ahead", recorder("ahead"))
    monkeypatch.setattr(_gemv.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_gemv.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(_gemv._tuned, "load", lambda key, index: (False, None))
    monkeypatch.setattr(_gemv, "_choice", {})
    monkeypatch.setattr(_gemv, "_lock_bufs", {})
    # (a view of a fake CUDA tensor needs CUDA's device guard: a weight's halves stand in as new tensors of their shape)
    halves = _gemv.halves
    monkeypatch.setattr(_gemv, "halves", lambda w, u: halves(w, u) if u is not None else (half(w), half(w)))
    return log


def half(w):
    return w.new_empty(w.shape[0] // 2, w.shape[1])


def fake(mode, *shape):
    with mode:
        return torch.empty(*shape, dtype=BF16, device="cuda")


def tuner_builds(plans):
    """What the tuner compiles for these keys' plans: each key's distinct kernels, warm (`_fastest`)."""
    for cfgs, launch in plans:
        for cfg in _gemv.builds(cfgs):
            launch(cfg, warm=True)


# op -> (its arguments, the plans its first call's tuner makes: a norm's and a group's matmuls tuned alone first)
CASES = {
    "linear, K split": lambda f: ((f(1, 4864), f(896, 4864), None), lambda x, w, b: [_gemv._plan(x, w, b)]),
    "linear with bias": lambda f: ((f(3, 896), f(1152, 896), f(1152)), lambda x, w, b: [_gemv._plan(x, w, b)]),
    "linear_glu, one weight": lambda f: ((f(2, 896), f(9728, 896)), lambda x, w: [_gemv._plan(x, w, None, True)]),
    "linear_glu, two weights": lambda f: (
        (f(1, 896), f(4864, 896), f(4864, 896)),
        lambda x, w, u: [_gemv._plan(x, w, None, True, None, u)],
    ),
    "norm_linear with residual": lambda f: (
        (f(1, 896), f(1, 896), f(896), 1e-6, f(1152, 896), f(1152), False),
        lambda x, r, nw, eps, w, b, glu: [
            _gemv._plan(torch.empty_like(x), w, b, glu),
            _gemv._plan(x, w, b, glu, (r, nw, eps)),
        ],
    ),
    "linears": lambda f: (
        (f(1, 896), [f(896, 896), f(128, 896), f(128, 896)], [f(896), f(128), f(128)]),
        lambda x, ws, bs: [*(_gemv._plan(x, w, b) for w, b in zip(ws, bs)), _gemv._plan_group(x, ws, bs)],
    ),
}
OPS = {
    "linear, K split": kernels.op,
    "linear with bias": kernels.op,
    "linear_glu, one weight": kernels.glu_op,
    "linear_glu, two weights": kernels.glu_op,
    "norm_linear with residual": kernels.norm_op,
    "linears": kernels.group_op,
}


@pytest.mark.parametrize("case", CASES)
def test_the_jobs_a_piece_starts_ahead_are_the_ones_its_tuner_will_compile(case, jobs):
    mode = FakeTensorMode()
    args, plans = CASES[case](lambda *shape: fake(mode, *shape))
    with mode:
        _gemv_ops._AHEAD[OPS[case]](*args)
        tuner_builds(plans(*args))
    assert jobs["ahead"] and sorted(set(jobs["ahead"])) == sorted(set(jobs["tuner"]))
    if case == "linear, K split":  # (a split's workspace and counters are float32 and int32, whatever x is)
        assert any(torch.float32 in a and torch.int32 in a for _, _, a, _ in jobs["ahead"])


def test_a_key_already_tuned_starts_nothing_ahead(jobs, monkeypatch):
    mode = FakeTensorMode()
    x, w = fake(mode, 1, 896), fake(mode, 896, 896)
    monkeypatch.setattr(_gemv._tuned, "load", lambda key, index: (True, None))  # (an earlier process tuned it)
    with mode:
        _gemv.ahead(x, w, None)
    _gemv._choice[_gemv._key(x, w, None)] = None  # (this process tuned it)
    monkeypatch.setattr(_gemv._tuned, "load", lambda key, index: (False, None))
    with mode:
        _gemv.ahead(x, w, None)
    assert jobs["ahead"] == []


def test_a_piece_starts_each_op_at_the_rows_it_was_traced_for_leaves_errors_to_its_tuner_and_nothing_when_off(
    monkeypatch,
):
    """A batch axis is traced as a symbol (its hint: the bucket, the rows the tuner will meet at the first call)."""
    met = []
    monkeypatch.setattr(_gemv_ops, "ahead", lambda x, w, b: met.append((tuple(x.shape), x.stride(), type(x).__name__)))
    piece = lambda x, w: kernels.op(x, w, None)  # noqa: E731
    x, w = torch.randn(3, 16, dtype=BF16), torch.randn(8, 16, dtype=BF16)
    for tracing_mode in ("fake", "symbolic"):
        assert _gemv_ops.compile_ahead(make_fx(piece, tracing_mode=tracing_mode)(x, w)) == 1
    assert met == [((3, 16), (16, 1), "FakeTensor")] * 2

    def fails(x, w, b):
        raise RuntimeError("a bug in the mirror")

    monkeypatch.setattr(_gemv_ops, "ahead", fails)
    before = _workers.counts["ahead_errors"]
    assert _gemv_ops.compile_ahead(make_fx(piece, tracing_mode="fake")(x, w)) == 0  # (the compile goes on)
    assert _workers.counts["ahead_errors"] == before + 1
    monkeypatch.setattr(fgraph.config, "compile_workers", 0)  # (no workers: no plan made for none to compile)
    assert _gemv_ops.compile_ahead(make_fx(piece, tracing_mode="fake")(x, w)) == 0
    assert _workers.counts["ahead_errors"] == before + 1


# sdpa_decode's (q, k, v, bias) as a 0.5B Qwen2's decode step reads them: 14 query heads over 2 KV heads of 64, a
# 1040-key static cache (each case splits the keys: the merge kernel too)
SDPA = {
    "B=1, no bias": lambda f: (f(1, 14, 1, 64), f(1, 2, 1040, 64), f(1, 2, 1040, 64), None),
    "B=1, float mask": lambda f: (f(1, 14, 1, 64), f(1, 2, 1040, 64), f(1, 2, 1040, 64), f(1, 1, 1, 1040)),
    "B=64, bool mask": lambda f: (
        f(64, 14, 1, 64),
        f(64, 2, 1040, 64),
        f(64, 2, 1040, 64),
        f(64, 1, 1, 1040, dtype=torch.bool),
    ),
}


@pytest.mark.parametrize("case", SDPA)
def test_the_jobs_sdpa_decode_starts_ahead_are_the_launches_its_first_call_makes(case, jobs, monkeypatch):
    monkeypatch.setattr(_sdpa, "_sms", lambda device: 132)  # (an H100's: no GPU here)
    launches = jobs["tuner"]  # (the first call's launches, recorded as the tuner's compiles are)
    monkeypatch.setattr(
        _workers, "direct", lambda fn, grid: lambda *a, **k: _workers.compile_and_load(fn, grid, *a, **k)
    )
    mode = FakeTensorMode()

    def f(*shape, dtype=BF16):
        with mode:
            return torch.empty(*shape, dtype=dtype, device="cuda")

    q, k, v, bias = SDPA[case](f)
    with mode:
        _sdpa.AHEAD[kernels.sdpa_op](q, k, v, bias, 0.125)
        _sdpa.launch(q, k, v, bias, 0.125)
    assert jobs["ahead"] == launches and [name for name, *_ in launches] == ["decode", "merge"]
