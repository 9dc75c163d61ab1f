"""Capture leaves no trace: after a jitted call, donated state is exactly what one eager call leaves, in every
mode, though warm-up and capture run the function (on all-padding inputs) before the real call. State declared
`scratch=` is not put back: its padded rows write only into a scratch area, proven here on the example models."""

import logging

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fgraph
from fgraph import Batched
from fgraph.capture import _graphs as G

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def counter_step(x, state):
    state["n"].add_(1)
    return x + 1, state


def sgd_step(params, x, y, lr=0.1):
    """One least-squares SGD step on donated params. Padded rows (x = 0, y = 0) add nothing to the gradient, which
    the Batched(mixes=True) declaration says."""
    err = x @ params["w"] - y  # [N, 1]
    params["w"].sub_(lr * x.T @ err)  # [D, 1]
    return err.square(), params


def sgd_jit(mode, **kw):
    mixed = Batched(mixes=True)
    return fgraph.jit(sgd_step, donate=["params"], batch={"x": mixed, "y": mixed}, mode=mode, **kw)


def data(n, d=4, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g).to(device), torch.randn(n, 1, generator=g).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_one_call_bumps_a_donated_counter_once(mode, device):
    f = fgraph.jit(counter_step, donate=["state"], batch={"x": Batched()}, mode=mode, buckets=[4, 8])
    state = {"n": torch.zeros((), device=device)}
    for k, n in enumerate([3, 3, 5, 1, 7], start=1):  # new signatures (buckets 4, 8, 1) and replays
        out, _ = f(torch.ones(n, device=device), state)
        assert state["n"].item() == k and out.shape == (n,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_sgd_on_donated_params_steps_once_per_call(mode, device):
    f = sgd_jit(mode, buckets=[8])
    w0 = torch.linspace(-1, 1, 4, device=device)[:, None]
    params, ref = {"w": w0.clone()}, {"w": w0.clone()}
    for seed, n in enumerate([5, 3, 6]):  # padded to 8, never a bucket
        x, y = data(n, seed=seed, device=device)
        loss, _ = f(params, x, y)
        want, _ = sgd_step(ref, x, y)
        torch.testing.assert_close(params["w"], ref["w"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    assert f.stats()["total"]["traces"] == 1


def doubling_step(x, state):
    state["n"].mul_(2).add_(1)  # after k runs: 2**k - 1, so every extra run shows
    return x * state["n"], state


@settings(max_examples=20, deadline=None)
@given(mode=st.sampled_from(MODES), sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5), up_front=st.booleans())
def test_any_sequence_of_calls_leaves_what_eager_leaves(mode, sizes, up_front):
    f = fgraph.jit(doubling_step, donate=["state"], batch={"x": Batched()}, mode=mode, buckets=[1, 2, 4, 8, 16])
    state, ref = {"n": torch.zeros(())}, {"n": torch.zeros(())}
    if up_front:
        f.capture(torch.ones(1), state, progress=False)
    for n in sizes:
        x = torch.arange(float(n))
        out, _ = f(x, state)
        want, _ = doubling_step(x, ref)
        assert torch.equal(out, want) and torch.equal(state["n"], ref["n"])


@pytest.mark.parametrize("mode", MODES)
def test_capture_up_front_leaves_state_untouched(mode):
    f = fgraph.jit(counter_step, donate=["state"], batch={"x": Batched()}, mode=mode, buckets=[2, 4, 8])
    state = {"n": torch.zeros(())}
    f.capture(torch.ones(1), state, progress=False)
    assert state["n"].item() == 0 and len(f.entries) == 3
    f(torch.ones(3), state)
    assert state["n"].item() == 1


@pytest.mark.parametrize("mode", MODES)
def test_an_unbatched_function_captured_on_the_real_call_runs_it_once(mode):
    """Without Batched leaves capture runs on the caller's own inputs: warm-up and capture would apply the step
    twice more."""
    f = fgraph.jit(lambda state: state["n"].mul_(2).add_(1) * 1, donate=["state"], mode=mode)
    state = {"n": torch.ones(())}
    f(state)
    assert state["n"].item() == 3
    f(state)
    assert state["n"].item() == 7


def test_state_is_put_back_when_capture_fails(monkeypatch):
    def broken(self, fn, *args):
        fn(*args)  # the stand-in ran the function, then the capture failed
        raise RuntimeError("capture failed")

    monkeypatch.setattr(G.HostGraph, "capture", broken)
    f = fgraph.jit(counter_step, donate=["state"], batch={"x": Batched()}, mode="FULL", buckets=[4])
    state = {"n": torch.zeros(())}
    with pytest.raises(fgraph.CaptureError, match="capture failed"):  # (the RuntimeError is its cause)
        f(torch.ones(3), state)
    assert state["n"].item() == 0


def test_the_put_back_is_what_keeps_state_right(monkeypatch):
    """Removing the put-back (a no-op context) makes the counter count the warm-up and capture runs again."""
    import contextlib

    from fgraph.capture import _entry

    monkeypatch.setattr(_entry, "put_back", lambda tensors: contextlib.nullcontext(lambda: None))
    f = fgraph.jit(counter_step, donate=["state"], batch={"x": Batched()}, mode="PIECEWISE", buckets=[4])
    state = {"n": torch.zeros(())}
    f(torch.ones(3), state)
    assert state["n"].item() == 3


def push(x, state):
    """Append x at the state's counter (a static KV cache's write: transformers' StaticLayer indexes by its count)."""
    state["buf"].index_copy_(0, state["n"], x[None])
    state["n"].add_(1)
    return x * 2, state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_each_warm_up_and_capture_run_starts_from_the_calls_state(mode, compile, device):
    """A capture runs the function more than once before the call's result stands (warm-up, then capture): each
    run must start from the call's own state. A run that saw the state the one before it left would write one slot
    further, past a full buffer's end on the last call: an IndexError on the CPU, a device-side assert on a GPU.
    New tensors on the last call make it capture there (the slots read them from then on)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, generator=g).to(device) for _ in range(3)]

    def fresh(state):  # the same values in new tensors
        return {k: v.clone() for k, v in state.items()}

    f = fgraph.jit(push, donate=["state"], mode=mode, compile=compile)
    mine = {"buf": torch.zeros(3, 4, device=device), "n": torch.zeros(1, dtype=torch.int64, device=device)}
    want = fresh(mine)
    for k, x in enumerate(xs):
        if k == len(xs) - 1:
            mine = fresh(mine)  # the last slot: a capture again
        out, _ = f(x, mine)
        ref, _ = push(x, want)
        torch.testing.assert_close(out, ref)
        assert all(torch.equal(mine[n], want[n]) for n in want), k
    assert f.stats()["total"]["captures"] >= 2


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(MODES), st.lists(st.sampled_from(["same", "new tensors", "reset"]), min_size=1, max_size=8))
def test_any_sequence_of_counter_indexed_writes_leaves_what_eager_leaves(mode, ops):
    """Calls that append into a buffer exactly as long as they need, the state passed again, as new tensors (a
    capture again, then copies) or after a reset (captures from scratch): every output and state equals eager's."""
    f = fgraph.jit(push, donate=["state"], mode=mode)
    mine = {"buf": torch.zeros(len(ops), 4), "n": torch.zeros(1, dtype=torch.int64)}
    want = {k: v.clone() for k, v in mine.items()}
    g = torch.Generator().manual_seed(len(ops))
    for k, op in enumerate(ops):
        if op == "new tensors":
            mine = {n: v.clone() for n, v in mine.items()}
        elif op == "reset":
            f.reset()
        x = torch.randn(4, generator=g)
        out, _ = f(x, mine)
        ref, _ = push(x, want)
        assert torch.equal(out, ref) and all(torch.equal(mine[n], want[n]) for n in want), (ops, k)


# -- scratch: state whose padded rows write only into a scratch area --------------------------------------------
def write_rows(x, slots, table):
    """Write each row of x into table[slot]: padded rows carry slot 0, the table's scratch row."""
    table.index_copy_(0, slots, x)
    return x * 2, table


def test_scratch_must_be_donated():
    with pytest.raises(fgraph.SignatureError, match=r"scratch= names \['table'\], which are not donated"):
        fgraph.jit(write_rows, scratch=["table"], batch={"x": Batched(), "slots": Batched()})


@pytest.mark.parametrize("mode", MODES)
def test_scratch_state_is_not_copied_and_only_its_scratch_row_sees_padding(mode, caplog, monkeypatch):
    from fgraph.capture import _entry

    copied, put_back = [], _entry.put_back
    monkeypatch.setattr(_entry, "put_back", lambda tensors: copied.extend(tensors) or put_back(tensors))
    f = fgraph.jit(
        write_rows,
        donate=["table"],
        scratch=["table"],
        batch={"x": Batched(), "slots": Batched(pad=0)},
        mode=mode,
        buckets=[8],
    )
    table, ref = torch.zeros(10, 2), torch.zeros(10, 2)
    x, slots = torch.arange(6.0).view(3, 2) + 1, torch.tensor([4, 7, 9])
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(x, slots, table)
    write_rows(x, slots, ref)
    assert torch.equal(table[1:], ref[1:])  # every row but the scratch row 0 as one eager call left it
    assert not any(t is table for t in copied)
    assert "padding is visible" not in caplog.text  # the scatter lands in declared scratch


def test_a_scatter_into_undeclared_state_is_reported(caplog):
    f = fgraph.jit(write_rows, donate=["table"], batch={"x": Batched(), "slots": Batched(pad=0)}, buckets=[8])
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(torch.ones(3, 2), torch.tensor([4, 7, 9]), torch.zeros(10, 2))
    assert "aten.index_copy" in caplog.text and "writes rows of the batch axis into table" in caplog.text


# -- the example models: padded rows write only the scratch page ---------------------------------------------
def model(kind, device="cpu"):
    from examples import llama, qwen2_moe

    if kind == "llama":
        cfg = llama.preset("tiny")
        return cfg, llama.init_params(cfg, torch.float32, device), llama.make_step(cfg, "torch", 32)
    cfg = qwen2_moe.preset("tiny-moe")
    return cfg, qwen2_moe.init_params(cfg, torch.float32, device), qwen2_moe.make_step(cfg, "torch", 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, mode", [("llama", "FULL_AND_PIECEWISE"), ("qwen2_moe", "FULL")])
def test_example_models_padded_rows_write_only_the_scratch_page(kind, mode, device):
    """The declaration engine.py makes (scratch=["cache"]) holds: capturing every routine and bucket, on
    all-padding batches, changes no KV page but the scratch page 0; then a call of 3 sequences (5 tokens, bucket 8)
    leaves every other page as the eager step does."""
    from examples import llama
    from fgraph.ops import attention as A

    cfg, params, step = model(kind, device)
    cache = llama.init_cache(cfg, 9, 4, torch.float32, device)
    for t in cache.k + cache.v:
        t.normal_()
    spec = llama.Batch(Batched(pad=0), Batched(pad=0), A.metadata_batching())
    f = fgraph.jit(
        step,
        static=["routine"],
        donate=["cache"],
        scratch=["cache"],
        batch={"batch": spec},
        buckets=[4, 8],
        mode=mode,
    )
    before = [t.clone() for t in cache.k + cache.v]
    zero = torch.zeros(1, dtype=torch.int64)
    one = llama.Batch(zero, zero, A.build_metadata([1], [1], [[0]], 4, 4))  # engine.example_batch: on the scratch page
    f.capture(params, cache, one, routine=["decode", "mixed"], progress=False)
    assert len(f.entries) == 4
    for t, b in zip(cache.k + cache.v, before):
        assert torch.equal(t[1:], b[1:])  # only the scratch page was written
    meta = A.build_metadata([2, 2, 1], [3, 6, 1], [[1], [2, 3], [4]], 4, 4)
    g = torch.Generator().manual_seed(0)
    batch = llama.Batch(torch.randint(0, cfg.vocab_size, (5,), generator=g), torch.tensor([1, 2, 4, 5, 0]), meta)
    ref = llama.init_cache(cfg, 9, 4, torch.float32, device)
    for r, b in zip(ref.k + ref.v, before):
        r.copy_(b)
    logits, _ = f(params, cache, batch, routine="mixed")  # batch on the host: fgraph copies it over
    on_device = llama.Batch(batch.tokens.to(device), batch.positions.to(device), batch.meta.to(device))
    with fgraph.disable_jit():
        want, _ = step(params, ref, on_device, routine="mixed")
    assert logits.shape == want.shape == (5, cfg.vocab_size)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    for t, r in zip(cache.k + cache.v, ref.k + ref.v):
        torch.testing.assert_close(t[1:], r[1:], rtol=1e-5, atol=1e-5)


def test_no_garbage_collection_during_a_cuda_stream_capture(monkeypatch):
    """A collection inside a CUDA stream capture can destroy another function's graphs, which aborts the process
    (seen on the H200 when a test's garbage was collected during the next test's capture): CudaGraph.capture runs
    with automatic collection off and turns it back on after."""
    import contextlib
    import gc

    seen = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    g = G.CudaGraph(None)
    assert gc.isenabled() and g.capture(lambda x: x + 1, torch.ones(2)).tolist() == [2.0, 2.0]
    assert seen == [False] and gc.isenabled()


def test_each_cuda_graph_capture_owns_its_cublas_workspace(monkeypatch):
    """torch's cuBLAS workspaces are cleared right before a capture (so the capture allocates its own, in its pool)
    and right after (so no later graph inherits it): what others then do to torch's workspaces cannot free memory a
    jitted function's graphs write. On the GPU: tests/capture/test_workspace_gpu.py."""
    import contextlib

    seen = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        seen.append("capture begins")
        yield
        seen.append("capture ends")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: seen.append("clear"), raising=False)
    G.CudaGraph(None).capture(lambda x: x + 1, torch.ones(2))
    assert seen == ["clear", "capture begins", "capture ends", "clear"]


GRAD_MODES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": torch.enable_grad,
}


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(MODES), st.lists(st.sampled_from(sorted(GRAD_MODES)), min_size=2, max_size=6))
def test_calls_in_any_sequence_of_grad_and_inference_modes_equal_eager(mode, modes):
    """fgraph's buffers, slots and captured outputs are its own, made outside inference mode: made inside it, they
    were inference tensors that a later call under no_grad could not write (torch's raw "Inplace update to
    inference tensor outside InferenceMode")."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).eval()
    f = fgraph.jit(m, batch={"input": Batched()}, mode=mode, buckets=[4])
    for k, name in enumerate(modes):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        with GRAD_MODES[name]():
            got = f(x)
        with torch.no_grad():
            torch.testing.assert_close(got, m(x), msg=str(modes[: k + 1]))  # (a padded matmul rounds at its size)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(MODES), st.lists(st.sampled_from(sorted(GRAD_MODES)), min_size=2, max_size=6))
@example("FULL", ["inference_mode"] * 3 + ["no_grad"] * 3)  # both copy one path through buffers they share
def test_state_made_under_any_mode_is_written_as_eager_writes_it(mode, modes):
    """Donated state made inside the call's mode each call (as generate makes its cache under inference_mode or
    no_grad): inference tensors are written in inference mode only, so each mode captures its own signature."""
    f = fgraph.jit(push, donate=["state"], mode=mode)
    for k, name in enumerate(modes):
        with GRAD_MODES[name]():
            state = {"buf": torch.zeros(2, 4), "n": torch.tensor([k % 2])}
            want = {n: v.clone() for n, v in state.items()}
            x = torch.full((4,), float(k))
            out, _ = f(x, state)
            ref, _ = push(x, want)
        assert torch.equal(out, ref) and all(torch.equal(state[n], want[n]) for n in want), (modes, k)


def test_a_function_captured_under_no_grad_says_how_to_serve_inference_mode(caplog):
    """Sealed by capture() under no_grad, a call under inference mode is another signature: it runs eagerly, and the
    log names the torch setting to capture under."""
    f = fgraph.jit(counter_step, donate=["state"], batch={"x": Batched()}, buckets=[4])
    state = {"n": torch.zeros(())}
    with torch.no_grad():
        f.capture(torch.ones(4), state, progress=False)
    with caplog.at_level(logging.WARNING, logger="fgraph"), torch.inference_mode():
        out, _ = f(torch.ones(3), state)
    assert torch.equal(out, torch.full((3,), 2.0)) and state["n"].item() == 1
    assert f.stats()["fallbacks"]["unseen"] == 1
    (msg,) = [r.getMessage() for r in caplog.records if "was not captured" in r.getMessage()]
    assert "capture(...), called under the same torch settings ([inference mode])" in msg
