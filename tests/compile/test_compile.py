"""Inductor-compiled pieces (jit(compile=True)): one compilation per distinct piece, with the batch axis symbolic,
shared by every bucket, both routines and every layer whose piece is the same graph; a second process loads it
from Inductor's cache; a bucket where the compilation's assumptions fail gets its own; every call equals eager."""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

import fgraph
from examples import engine, llama
from fgraph.ops import attention as A

ROOT = pathlib.Path(__file__).parent.parent.parent
CFG = dict(llama.presets["tiny"], n_layers=3, dim=64, n_heads=2, n_kv_heads=1, head_dim=32, intermediate=96)


def captured(buckets, tmp_path, monkeypatch, seed=0, layers=3):
    """An engine of the tiny model with compiled pieces captured for `buckets`, both routines, on a fresh Inductor
    cache; the model's own (eager) step; the config."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # (another model per seed: fresh pieces)
    cfg = llama.LlamaConfig(**{**CFG, "vocab_size": CFG["vocab_size"] + seed, "n_layers": layers})
    params = llama.init_params(cfg, torch.float32, "cpu", seed=seed)
    eng = engine.build(
        cfg, params, backend="torch", mode="FULL", buckets=buckets, max_batch_tokens=max(buckets),
        max_seqs=max(buckets), max_seq_len=32, page_size=4, compile=True, capture=True,
    )  # fmt: skip
    return eng, params, cfg


def call(eng, step, params, n, routine):
    """One step on n tokens (decode: n sequences of one; mixed: one prompt of n) over a fresh cache."""
    ps, pages = eng.page_size, eng.max_pages
    if routine == "decode":
        meta = A.build_metadata([1] * n, [3] * n, [[1 + s] for s in range(n)], ps, pages)
        positions = torch.full((n,), 2)
    else:
        meta = A.build_metadata([n], [n], [list(range(1, 1 + -(-n // ps)))], ps, pages)
        positions = torch.arange(n)
    batch = llama.Batch(tokens=torch.arange(n) % 50, positions=positions, meta=meta)
    cache = A.KVCache.allocate(len(params.layers), 64, ps, eng.cache.k[0].shape[2], eng.cache.k[0].shape[3])
    logits, _ = step(params, cache, batch, routine=routine)
    return logits.clone()


def compiled_fns(eng) -> dict:
    """Per distinct compiled function: how its pieces were served (symbolic or static), by signature."""
    out: dict = {}
    for e in eng.step_fn.entries.values():
        for c in e.compiled.values():
            out.setdefault(id(c.fn), set()).add(c.how)
    return out


def test_one_compilation_per_distinct_piece_serves_every_bucket_routine_and_layer(tmp_path, monkeypatch):
    eng, params, cfg = captured([2, 4, 8], tmp_path, monkeypatch)
    entries = list(eng.step_fn.entries.values())
    assert len(entries) == 6 and eng.step_fn.stats()["total"]["traces"] == 2  # 3 buckets x 2 routines, 2 traces
    pieces = [p for p in entries[0].program.pieces if not p.is_break]
    assert len(pieces) == cfg.n_layers + 1  # before the first attention, between layers, after the last
    # the first piece, the middle piece every layer boundary shares, the last: three compilations for 24 uses
    assert len(compiled_fns(eng)) == 3
    assert all(hows == {"symbolic"} for hows in compiled_fns(eng).values())
    eager = llama.make_step(cfg)
    for routine in ("decode", "mixed"):
        for n in (2, 3, 5, 8):  # buckets and sizes padded up to one
            torch.testing.assert_close(
                call(eng, eng.step_fn, params, n, routine), call(eng, eager, params, n, routine), rtol=1e-4, atol=1e-4
            )


def test_compilations_grow_with_what_is_distinct_not_with_layers_or_buckets(tmp_path, monkeypatch):
    """Two layers and one bucket, or five layers and four buckets: the same three compilations (first, middle and
    last piece), whatever the layers x buckets x routines."""
    small = captured([2], tmp_path, monkeypatch, seed=2, layers=2)[0]
    big = captured([2, 3, 5, 8], tmp_path, monkeypatch, seed=2, layers=5)[0]
    assert len(small.step_fn.entries) == 2 and len(big.step_fn.entries) == 8
    assert len(compiled_fns(small)) == len(compiled_fns(big)) == 3
    assert set(compiled_fns(small)) == set(compiled_fns(big))  # the same model's pieces: the very same functions


def test_a_bucket_outside_the_compilations_assumptions_gets_its_own_and_the_trace_is_untouched(tmp_path, monkeypatch):
    """Inductor may assume a symbolic size is >= 2 (or not some size): where that fails (bucket 1 here), the piece is
    compiled for that bucket's static shapes. Its assumptions stay out of the trace's guards: one trace per routine
    still serves bucket 1 (the compiled pieces check their own assumptions per signature)."""
    eng, params, cfg = captured([1, 2, 4], tmp_path, monkeypatch, seed=1)
    assert eng.step_fn.stats()["total"]["traces"] == 2
    for e in eng.step_fn.entries.values():
        for c in e.compiled.values():
            assert c.how == "symbolic" or e.sig.bucket == 1
    eager = llama.make_step(cfg)
    for routine in ("decode", "mixed"):
        for n in (1, 3):
            torch.testing.assert_close(
                call(eng, eng.step_fn, params, n, routine), call(eng, eager, params, n, routine), rtol=1e-4, atol=1e-4
            )
    assert "compiled: symbolic" in str(fgraph.explain(eng.step_fn))


SCRIPT = """
import json, torch
from examples import engine, llama
from fgraph.compile import compiler
cfg = llama.LlamaConfig(**{cfg})
params = llama.init_params(cfg, torch.float32, "cpu", seed=0)
engine.build(cfg, params, backend="torch", mode="FULL", buckets=[2, 4], max_batch_tokens=4, max_seqs=4,
             max_seq_len=32, page_size=4, compile=True, capture=True)
print(json.dumps({{k: v for k, v in compiler.counts.items() if k != "seconds"}}))
"""


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_pieces_from_inductors_cache(tmp_path):
    cfg = dict(CFG, vocab_size=CFG["vocab_size"] + 7)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    runs = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(cfg=cfg)], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["compiled"] == 3 and first["loaded"] == 0  # first, middle and last piece
    assert second["compiled"] == 0 and second["loaded"] == 3
    assert first["shared"] == second["shared"] > 0  # every other use found the process's own compilation


def test_a_weight_as_wide_as_the_largest_bucket_ties_no_compilation_to_that_bucket(tmp_path, monkeypatch):
    """The qkv projection has 128 columns and the largest bucket is 128 rows, where the trace is made: comparing the
    two sizes while compiling would guard `N == 128` and leave every other bucket running code made for 128 rows (a
    crash at its warm-up, or worse). Every bucket but 1 is served by the one symbolic compilation per piece, and
    every call equals the plain function."""
    eng, params, cfg = captured([2, 8, 120, 128], tmp_path, monkeypatch, seed=3, layers=2)
    assert (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim == 128
    assert all(hows == {"symbolic"} for hows in compiled_fns(eng).values())
    assert len(compiled_fns(eng)) == 3
    eager = llama.make_step(cfg)
    for routine, sizes in (("decode", (2, 5, 63)), ("mixed", (2, 5, 30))):  # (63: bucket 120; the cache's pages)
        for n in sizes:
            torch.testing.assert_close(
                call(eng, eng.step_fn, params, n, routine), call(eng, eager, params, n, routine), rtol=1e-4, atol=1e-4
            )


def test_a_compilations_assumptions_leave_the_traces_shape_env_as_it_was():
    """What a compilation assumes in the trace's shape env is taken back out, caches included: after it, the env
    and the trace's own sizes know nothing of it (a cached `s0 -> 256` would specialise the next piece compiled in
    the same env, which would then record no assumption of its own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fgraph.compile import restored

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    x = mode.from_tensor(torch.empty(256, 4), symbolic_context=StatelessSymbolicContext([DimDynamic.DYNAMIC] * 2))
    s = x.shape[0].node.expr
    with restored(env) as before:
        assert x.shape[0] == 256  # a compilation's guard: replaces s by 256
        assert x.shape[0].node.expr == 256 and len(env.guards) > len(before.guards)
    assert x.shape[0].node.expr == s and env.replace(s) == s
    assert not env.replacements and not env.guards


def test_a_compilation_serves_only_inputs_of_the_layout_it_asserts():
    """Compilation.holds_for checks every size and stride of the layout (a number the trace fixed as well as a symbol),
    each int input, the guards and the ranges, before a bucket runs the code."""
    import sympy

    from fgraph.compile import Compilation

    s = sympy.Symbol("s0", integer=True, positive=True)
    n = sympy.Integer
    layout = [((s, n(4)), (n(4), n(1))), s, ((n(256),), (n(1),))]  # [s0, 4] rows, s0 as an int, [256]
    shared = Compilation(None, layout, [sympy.Ne(s, 7)], {s: (2, 512)})
    ok = [torch.empty(8, 4), 8, torch.empty(256)]
    assert shared.holds_for(ok)
    assert not shared.holds_for([torch.empty(8, 4), 9, torch.empty(256)])  # an int input that disagrees
    assert not shared.holds_for([torch.empty(8, 4), 8, torch.empty(248)])  # a fixed size
    assert not shared.holds_for([torch.empty(4, 8).t(), 8, torch.empty(256)])  # a stride
    assert not shared.holds_for([torch.empty(7, 4), 7, torch.empty(256)])  # a guard
    assert not shared.holds_for([torch.empty(1, 4), 1, torch.empty(256)])  # a range
    assert shared.uses == 1


def test_a_trace_that_fixed_a_size_shares_no_compilation_with_one_that_did_not(tmp_path, monkeypatch):
    """The bucket-8 trace fixes N = 8 (`x.shape[0] == 8`: Inductor's code for its piece asserts 8 rows); the bucket-16
    trace has the same graph but serves any N != 8. Its piece gets a compilation of its own, and every call equals
    the plain function: the piece at bucket 16 never runs code made for 8 rows."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def f(x):
        y = torch.tanh(x * 2.0 + 1.0)
        return y * 3.0 if x.shape[0] == 8 else y * 3.0

    jf = fgraph.jit(f, batch={"x": fgraph.Batched()}, buckets=[8, 16], compile=True)
    for n in (8, 16, 12, 8):
        x = torch.randn(n, 5)
        torch.testing.assert_close(jf(x), f(x))
    assert jf.stats()["total"]["traces"] == 2
    fns = {id(c.fn) for e in jf.entries.values() for c in e.compiled.values()}
    assert len(fns) == 2
