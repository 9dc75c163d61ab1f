"""A compiled CUDA piece's one-query SDPA becomes fgraph::sdpa_decode (fgraph/compile/_sdpa.py): what is rewritten,
what stays as traced, and that the rewritten program computes eager's answer. On the CPU the op is eager's math (the
kernel's specs: tests/kernels/test_sdpa.py), so these check the rewrite itself; the pieces are rewritten as CUDA
ones are (`rewriting_on_cpu`)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fgraph
from fgraph import kernels
from fgraph.compile import _sdpa, compiler

B, HQ, HKV, S, D = 3, 6, 2, 40, 16


def repeat_kv(x, n):
    """transformers' repeat_kv: each KV head repeated to the n query heads it serves."""
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def hf_decode_attention(q, kc, vc, k, v, pos, mask):
    """An HF static-cache decode step's attention as a trace meets it: the new k/v written into the cache, the cache
    repeated to the query heads, a boolean mask made additive, SDPA, the heads put back."""
    kc.index_copy_(2, pos, k)
    vc.index_copy_(2, pos, v)
    bias = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
    o = F.scaled_dot_product_attention(q, repeat_kv(kc, HQ // HKV), repeat_kv(vc, HQ // HKV), attn_mask=bias, scale=0.3)
    return o.transpose(1, 2).reshape(q.shape[0], 1, -1)


def inputs(b=B, q_rows=1, dtype=torch.float32, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    mask = torch.rand(b, 1, q_rows, S, generator=g) > 0.3
    mask[..., 0] = True  # every row sees a key
    return [r(b, HQ, q_rows, d), r(b, HKV, S, d), r(b, HKV, S, d), r(b, HKV, 1, d), r(b, HKV, 1, d),
            torch.tensor([7]), mask]  # fmt: skip


def rewritten(fn, a):
    """(fn traced, a rewritten copy, the number rewritten)."""
    gm, other = make_fx(fn)(*[x.clone() for x in a]), make_fx(fn)(*[x.clone() for x in a])
    return gm, other, _sdpa.rewrite(other, "cpu")


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def same_answer(fn, gm, a):
    """gm on fresh copies of a gives fn's outputs, and leaves the inputs it writes as fn leaves them."""
    want_in, got_in = [x.clone() for x in a], [x.clone() for x in a]
    torch.testing.assert_close(gm(*got_in), fn(*want_in), rtol=0, atol=0)
    for w, g in zip(want_in, got_in):
        assert torch.equal(w, g)


def test_a_decode_steps_sdpa_over_repeated_kv_becomes_one_op_reading_the_kv_heads():
    a = inputs()
    _, gm, n = rewritten(hf_decode_attention, a)
    assert n == 1 and targets(gm).count(kernels.sdpa_op) == 1
    # the repeats' copies are gone: the op reads the cache at its KV heads
    assert torch.ops.aten.clone.default not in targets(gm)
    op = next(x for x in gm.graph.nodes if x.target is kernels.sdpa_op)
    assert [list(x.meta["val"].shape) for x in op.args[1:3]] == [[B, HKV, S, D]] * 2
    same_answer(hf_decode_attention, gm, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_off_the_kernel_the_op_is_eagers_sdpa_on_the_repeated_heads(dtype):
    q, kc, vc, *_ = inputs(dtype=dtype)
    bias = torch.where(inputs()[-1], 0.0, float("-inf")).to(dtype)
    want = F.scaled_dot_product_attention(q, repeat_kv(kc, 3), repeat_kv(vc, 3), attn_mask=bias, scale=0.3)
    assert torch.equal(kernels.sdpa_op(q, kc, vc, bias, 0.3), want)
    torch.library.opcheck(torch.ops.fgraph.sdpa_decode, (q, kc, vc, bias, 0.3))
    torch.library.opcheck(torch.ops.fgraph.sdpa_decode, (q, kc, vc, None, 0.3))


def test_without_a_mask_or_a_repeat_the_call_is_rewritten_as_it_reads():
    def plain(q, k, v):  # one KV head per query head: nothing repeated; no mask; the default scale
        return F.scaled_dot_product_attention(q, k, v)

    g = torch.Generator().manual_seed(1)
    a = [torch.randn(2, 4, n, D, generator=g) for n in (1, S, S)]
    _, gm, n = rewritten(plain, a)
    assert n == 1
    same_answer(plain, gm, a)


def test_what_sdpa_decode_cannot_serve_stays_as_traced():
    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def two_rows(q, kc, vc, k, v, pos, mask):
        return hf_decode_attention(q, kc, vc, k, v, pos, mask)

    q, kc, vc, k, v, pos, mask = inputs()
    cases = {
        "a causal call": (causal, [q, repeat_kv(kc, 3), repeat_kv(vc, 3)]),
        "two query rows": (two_rows, inputs(q_rows=2)),
        "float64": (hf_decode_attention, inputs(dtype=torch.float64)),
        "a head dim past the kernel's registers": (hf_decode_attention, inputs(d=512)),
    }
    for why, (fn, a) in cases.items():
        _, gm, n = rewritten(fn, a)
        assert n == 0, why
        assert kernels.sdpa_op not in targets(gm), why


def test_a_write_in_place_between_the_repeat_and_the_call_keeps_the_copy():
    def written_between(q, kc, vc, k, v, pos, mask):
        kr, vr = repeat_kv(kc, 3), repeat_kv(vc, 3)
        kc.mul_(2)  # after the copy: the call must read the cache as it was
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=torch.where(mask, 0.0, float("-inf")))

    a = inputs()
    _, gm, n = rewritten(written_between, a)
    assert n == 1  # the op reads the copy of the keys (one KV head per query head) and the values' cache
    same_answer(written_between, gm, a)


@contextlib.contextmanager
def rewriting_on_cpu(monkeypatch):
    """Compiled pieces' SDPA calls rewritten as CUDA ones are (the rewrite is for CUDA pieces)."""
    rewrite = _sdpa.rewrite
    monkeypatch.setattr(_sdpa, "rewrite", lambda gm, device_type="cuda": rewrite(gm, "cpu"))
    yield


@pytest.mark.parametrize("on", [True, False])
def test_compiled_pieces_call_sdpa_decode_when_the_switch_is_on_and_equal_eager(on, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "sdpa_decode", on)

    def step(q, cache, k, v, pos, mask):
        return hf_decode_attention(q, cache["k"], cache["v"], k, v, pos, mask), cache

    with rewriting_on_cpu(monkeypatch):
        before = compiler.counts["sdpa"]
        batched = {x: fgraph.Batched() for x in ("q", "cache", "k", "v", "mask")}
        f = fgraph.jit(step, batch=batched, donate=["cache"], buckets=[1, 4], compile=True)
        for n in (1, 3, 4):  # 3: padded into bucket 4
            q, kc, vc, k, v, pos, mask = inputs(b=n, seed=n)
            want, want_cache = step(q, {"k": kc.clone(), "v": vc.clone()}, k, v, pos, mask)
            got, got_cache = f(q, {"k": kc, "v": vc}, k, v, pos, mask)
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0)
    assert compiler.counts["sdpa"] - before == (2 if on else 0)  # one call in each bucket's piece


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    hkv=st.sampled_from([1, 2]),
    g=st.sampled_from([1, 2, 3]),
    s=st.integers(1, 70),
    d=st.sampled_from([8, 16]),
    mask=st.sampled_from([None, "float", "bool"]),
    scale=st.sampled_from([None, 0.3]),
    write_between=st.booleans(),
)
def test_any_one_query_attention_rewritten_computes_eagers_answer(b, hkv, g, s, d, mask, scale, write_between):
    def fn(q, kc, vc, m):
        kr, vr = repeat_kv(kc, g), repeat_kv(vc, g)
        if write_between:
            kc.add_(1)
        bias = {None: None, "float": torch.where(m, 0.0, float("-inf")), "bool": m}[mask]
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=bias, scale=scale)

    gen = torch.Generator().manual_seed(b * 1000 + s)
    m = torch.rand(b, 1, 1, s, generator=gen) > 0.3
    m[..., 0] = True
    a = [torch.randn(b, hkv * g, 1, d, generator=gen), torch.randn(b, hkv, s, d, generator=gen),
         torch.randn(b, hkv, s, d, generator=gen), m]  # fmt: skip
    _, gm, n = rewritten(fn, a)
    assert n == 1
    same_answer(fn, gm, a)


@pytest.mark.parametrize(
    "kernel", ["eager's math", pytest.param("Triton's interpreter", marks=pytest.mark.interpreter)]
)
def test_a_hugging_face_decode_step_compiled_with_the_switch_calls_the_op_in_every_layer(kernel, tmp_path, monkeypatch):
    """The README's recipe on a tiny Qwen2 with transformers' sdpa attention (left-padded prompts; the installed
    transformers' own trace, whichever path it takes under a trace): the decode piece's SDPA in each layer becomes
    the op, and generate gives eager's tokens and its logits to rounding. In the interpreter the op is the kernel."""
    from examples import hf_generate as G

    pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "sdpa_decode", True)
    if kernel == "Triton's interpreter":
        monkeypatch.setattr(kernels._sdpa, "sdpa_decode", kernels._sdpa.launch)
    base, model = G.tiny("qwen2"), G.tiny("qwen2")
    for m in (base, model):
        m.set_attn_implementation("sdpa")
    ids = torch.randint(1, 128, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[2, :1] = 0  # left padding: a row's first keys are masked out
    kw = dict(attention_mask=mask, return_dict_in_generate=True, output_logits=True)
    want = G.generate(base, ids, 5, **kw)
    with rewriting_on_cpu(monkeypatch):
        before = compiler.counts["sdpa"]
        f = G.jit_forward(model, compile=True)
        for _ in range(2):  # the second generate replays the decode piece
            got = G.generate(model, ids, 5, **kw)
            assert torch.equal(got.sequences, want.sequences)
            torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=1e-5)
    assert compiler.counts["sdpa"] - before == 2  # the decode signature's one piece: both layers' calls
    assert f.stats()["total"]["replays"] >= 6


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_decode_piece_compiled_in_parts_compiles_each_distinct_part_once_and_gives_eagers_tokens(
    device, arch, tmp_path, monkeypatch
):
    """fgraph.config.compile_parts: an HF decode piece (no break: every layer in one piece) cut at its sdpa_decode
    calls, one per layer. Of 3 layers' 4 parts, the two middle ones (a layer's MLP and the next one's projections)
    are one graph over other weights: Inductor compiles 3, not the piece whole. So too for an MoE, whose routing
    makes an index the second middle part would otherwise read from the first (`share_repeats` makes it first)."""
    from examples import hf_generate as G

    pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(fgraph.config, "compile_parts", True)
    monkeypatch.setattr(compiler, "shared", {})  # (not the parts this process's other tests compiled)
    base, model = G.tiny(arch, device, layers=3), G.tiny(arch, device, layers=3)
    for m in (base, model):
        m.set_attn_implementation("sdpa")
    ids = torch.randint(1, 128, (3, 6), generator=torch.Generator().manual_seed(0)).to(device)  # (padded to 4)
    kw = dict(return_dict_in_generate=True, output_logits=True)
    want = G.generate(base, ids, 4, **kw)
    with rewriting_on_cpu(monkeypatch) if device == "cpu" else contextlib.nullcontext():
        before = dict(compiler.counts)
        f = G.jit_forward(model, compile=True, buckets=[4])
        for _ in range(2):  # the second generate replays the decode piece
            got = G.generate(model, ids, 4, **kw)
            assert torch.equal(got.sequences, want.sequences)
            torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=1e-5)
    made = {k: compiler.counts[k] - before[k] for k in ("compiled", "loaded", "sdpa", "cut")}
    assert made == {"compiled": 3, "loaded": 0, "sdpa": 3, "cut": 1}  # (cut once, for every signature's capture)
    assert f.stats()["total"]["captures"] >= 2
    assert compiler.counts["repeats"] > before["repeats"]  # (the mask's bias made once, not in each part)
    assert "compiled: in parts, cut at its 3 fgraph::sdpa_decode calls" in str(fgraph.explain(f))
