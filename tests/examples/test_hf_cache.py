"""HF caches as donated state: `model.forward = fgraph.jit(model.forward, donate=[CACHE])` and
`model.generate(..., cache_implementation="static")` give eager's greedy tokens; a growing cache is a clear error;
a jitted module is a drop-in for it (issue #31)."""

import logging

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import DynamicCache, StaticCache  # noqa: E402

import fgraph  # noqa: E402
from examples import hf_generate as G  # noqa: E402
from tests.test_semantics import MODES  # noqa: E402

CACHE = G.cache_parameter(transformers.Qwen2ForCausalLM)  # `cache`, or `past_key_values` before transformers 5.24

IDS = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", MODES)
def test_static_cache_recipe_equals_eager_generate(arch, mode):
    model = G.tiny(arch)
    want = G.generate(model, IDS, 4)
    f = G.jit_forward(model, mode)
    assert torch.equal(G.generate(model, IDS, 4), want)
    assert torch.equal(G.generate(model, IDS, 4), want)  # a second generate: a new cache, the same decode signature
    s = f.stats()
    assert s["fallbacks"]["init"] == 2  # each prefill makes its lazily made cache's tensors, eagerly
    assert len(f.entries) == 1 and s["total"]["traces"] == 1 and s["total"]["calls"] == 6  # decode: one signature
    # the first generate's first decode call sees the cache, its second new input tensors (read afresh from then
    # on), its third is the replay path's, as all later ones are; in the second generate, captured graphs are
    # captured again over the new cache's tensors, and their input slots learned again (one more slow call)
    assert s["total"]["fast"] == (3 if mode == "NONE" else 2)
    (e,) = f.entries.values()
    assert f"{CACHE}.layers[0].keys" in e.paths and f"{CACHE}.layers[1].cumulative_length" in e.paths


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_recipe_gives_eagers_logits_bit_for_bit_at_every_step(attention, device):
    # the prefill (run eagerly: it makes generate's cache) on the module's own Parameters, and every decode step
    # from graphs traced with their requires_grad: the head reads hidden_states[:, -1:] (a 3-D slice), whose GEMM
    # torch picks by that flag (docs/contract.md, "What is bitwise": on CUDA, sdpa's compile path may run another
    # SDPA kernel than eager's enable_gqa path, so there it is close, not equal); uncompiled graphs, the CPU's
    # default (CUDA's compiles its pieces: close, as under torch.compile)
    base, model = G.tiny("qwen2", device), G.tiny("qwen2", device)
    for m in (base, model):
        m.set_attn_implementation(attention)
    G.jit_forward(model, compile=False)
    kw = dict(return_dict_in_generate=True, output_logits=True)
    ids = IDS.to(device)
    want = G.generate(base, ids, 5, **kw).logits
    same = torch.testing.assert_close if (device, attention) == ("cuda", "sdpa") else _equal
    for _ in range(2):  # the first generate traces its decode step; the second replays it
        got = G.generate(model, ids, 5, **kw).logits
        assert len(got) == len(want) == 5
        for step, (a, b) in enumerate(zip(got, want)):
            same(a, b, msg=f"step {step}")
    assert model.forward.stats()["total"]["replays"] >= 6


def _equal(a, b, msg):
    assert torch.equal(a, b), f"{msg}: {(a - b).abs().max().item()} apart"


def test_a_prefill_that_makes_the_cache_again_runs_eagerly_without_binding(monkeypatch):
    # generate makes a new cache per call, so every prefill makes its tensors: binding it (every parameter read,
    # flattened and keyed) only to run it eagerly cost an HF prefill ~5 ms; a call keyed as one that made state
    # runs the plain forward at once
    model = G.tiny("qwen2")
    want = [G.generate(model, ids, 3) for ids in (IDS, IDS[:, :4])]
    f = G.jit_forward(model, "FULL")
    prefills = []  # per bind: whether it bound a call whose cache is yet to be made
    bind = type(f).bind

    def counted(self, args, kwargs):
        cache = kwargs.get(CACHE)
        prefills.append(cache is not None and cache.layers[0].keys is None)
        return bind(self, args, kwargs)

    monkeypatch.setattr(type(f), "bind", counted)
    for _ in range(3):
        assert torch.equal(G.generate(model, IDS, 3), want[0])
    assert f.stats()["fallbacks"]["init"] == 3 and sum(prefills) == 1  # the first prefill's alone was bound
    assert torch.equal(G.generate(model, IDS[:, :4], 3), want[1])  # another prompt length: another key, bound
    assert sum(prefills) == 2
    for grad in (False, False, True):  # under grad mode it is bound: its outputs' backward is refused there
        with torch.set_grad_enabled(grad):
            f(IDS, **{CACHE: StaticCache(config=model.config, max_cache_len=16)})
    assert sum(prefills) == 4


@torch.no_grad()
def test_token_by_token_decode_with_a_static_cache_the_caller_made():
    model = G.tiny("llama")
    f = fgraph.jit(model, donate=[CACHE], mode="FULL")

    def run(fn):
        cache = StaticCache(config=model.config, max_cache_len=16)
        cache.early_initialization(2, 2, 16, torch.float32, "cpu")  # initialised: the prefill is traced as well
        ids, steps = IDS, []
        out = fn(input_ids=ids, **{CACHE: cache}, use_cache=True)
        assert out[CACHE] is cache  # the caller's own cache handed back, written in place
        for _ in range(3):
            nxt = out.logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, nxt], 1)
            steps.append(out.logits[:, -1].clone())
            out = fn(input_ids=nxt, **{CACHE: cache}, use_cache=True)
        assert int(cache.layers[0].cumulative_length) == 8
        return ids, steps

    want_ids, want = run(model)
    got_ids, got = run(f)
    assert torch.equal(got_ids, want_ids) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    assert len(f.entries) == 2 and f.stats()["fallbacks"]["init"] == 0  # prefill and decode, each traced once


def init_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "which held no tensor" in r.getMessage()]


@torch.no_grad()
def test_the_recipe_logs_a_fix_its_user_can_take_for_the_cache_generate_makes(caplog):
    """generate makes the StaticCache its prefill fills: its user never holds it to early_initialization(...) it.
    The log says what they can do (make one, initialise it, pass it), and that quiets it."""
    model = G.tiny("qwen2")
    want = G.generate(model, IDS, 3)
    G.jit_forward(model)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        assert torch.equal(G.generate(model, IDS, 3), want)
    (msg,) = init_logs(caplog)
    assert "generate's prefill makes the cache's tensors" in msg
    # its layers say is_initialized=False: the prefill ran eagerly untraced (a trace would name the keys it made)
    assert f"the tensors of donated `{CACHE}.layers[0]` and 1 more" in msg
    assert msg.split("Fix: ")[1].startswith("to trace the prefill as well") and f"generate(..., {CACHE}=cache)" in msg
    caplog.clear()
    model = G.tiny("qwen2")
    f = G.jit_forward(model)
    cache = StaticCache(config=model.config, max_cache_len=16)  # the fix, taken
    cache.early_initialization(2, 2, 16, torch.float32, "cpu")
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, disable_compile=True)
        assert torch.equal(model.generate(IDS, **{CACHE: cache}, **kw), want)
    assert not init_logs(caplog) and f.stats()["fallbacks"]["init"] == 0


@torch.no_grad()
def test_a_static_cache_the_caller_made_is_told_to_initialise_it(caplog):
    model = G.tiny("qwen2")
    f = fgraph.jit(model, donate=[CACHE])
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        f(IDS, **{CACHE: StaticCache(config=model.config, max_cache_len=16)}, use_cache=True)
    (msg,) = init_logs(caplog)
    assert msg.split("Fix: ")[1].startswith("make the state before the first call to trace it as well")
    assert "cache.early_initialization(...)" in msg and "generate" not in msg


class Layer:  # a plain class, as a transformers 4.x cache layer: tensors and Python ints
    def __init__(self, n):
        self.keys, self.length, self.size = torch.zeros(n, 3), torch.tensor(0), n


class Cache:
    def __init__(self, layers, n):
        self.layers = [Layer(n) for _ in range(layers)]


def step(x, past_key_values=None):  # the older spelling of the parameter (transformers 4.x, 5.17)
    for layer in past_key_values.layers:
        layer.keys.index_copy_(0, layer.length.reshape(1), x[None])
        layer.length.add_(1)
        x = x + layer.keys.sum(0)
    return x, past_key_values


@pytest.mark.parametrize("mode", MODES)
def test_a_donated_plain_object_is_seen_into_and_handed_back(mode):
    want_cache, got_cache = Cache(2, 4), Cache(2, 4)
    f = fgraph.jit(step, donate=["past_key_values"], mode=mode)
    for i in range(3):
        x = torch.full((3,), float(i))
        want, back = step(x, want_cache)
        got, got_back = f(x, got_cache)
        assert torch.equal(got, want) and got_back is got_cache
    for a, b in zip(want_cache.layers, got_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.length, b.length) and b.size == 4
    assert len(f.entries) == 1 and f.stats()["total"]["traces"] == 1


class LazyLayer:  # as transformers' StaticLayer: keys made on first use, the counter moved to their device then
    def __init__(self):
        self.keys, self.length = None, torch.tensor(0)


def lazy_step(x, past_key_values=None):
    for layer in past_key_values.layers:
        if layer.keys is None:
            layer.keys, layer.length = torch.zeros(4, 3, device=x.device), layer.length.to(x.device).clone()
    return step(x, past_key_values)


class Box:
    def __init__(self):
        self.t = None


def lazy_scale(x, box):
    if box.t is None:  # made by the first call that sees it
        box.t = torch.full((3,), 2.0)
    return x * box.t.sum()


def test_only_calls_without_batched_arguments_make_state_again_without_binding(monkeypatch):
    for batch, binds in ((None, 1), ({"x": fgraph.Batched()}, 3)):  # batched: padded and moved as the slow path does
        f = fgraph.jit(lazy_scale, donate=["box"], batch=batch)
        bound, call = set(), [0]  # the calls that bound
        bind = type(f).bind
        monkeypatch.setattr(type(f), "bind", lambda self, a, k, bind=bind: bound.add(call[0]) or bind(self, a, k))
        with torch.no_grad():
            for call[0] in range(3):  # a new box each call: each call makes its tensor
                x, box = torch.ones(2, 3), Box()
                assert torch.equal(f(x, box), lazy_scale(x, Box())) and torch.equal(box.t, torch.full((3,), 2.0))
        assert f.stats()["fallbacks"]["init"] == 3 and len(bound) == binds, batch


class FlaggedLayer(LazyLayer):  # as transformers' cache layers: it says whether it holds its tensors yet
    def __init__(self):
        super().__init__()
        self.is_initialized = False


def flagged_step(x, past_key_values=None):
    print("traced" if isinstance(x, torch._subclasses.FakeTensor) else "eager")  # (a list it appends to: guarded)
    for layer in past_key_values.layers:
        if not layer.is_initialized:
            layer.keys, layer.length = torch.zeros(4, 3), layer.length.clone()
            layer.is_initialized = True
    return step(x, past_key_values)


def lazy_cache(n=2, cls=FlaggedLayer):
    """A cache of n layers that make their tensors on first use."""
    c = Cache(0, 0)
    c.layers = [cls() for _ in range(n)]
    return c


@pytest.mark.parametrize("mode", MODES)
def test_a_lazily_made_cache_that_moves_what_it_held_runs_its_first_call_eagerly(mode):
    want_cache, got_cache = lazy_cache(cls=LazyLayer), lazy_cache(cls=LazyLayer)
    f = fgraph.jit(lazy_step, donate=["past_key_values"], mode=mode)
    for i in range(3):
        x = torch.full((3,), float(i))
        assert torch.equal(f(x, got_cache)[0], lazy_step(x, want_cache)[0])
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(want_cache.layers, got_cache.layers))
    assert f.stats()["fallbacks"]["init"] == 1 and len(f.entries) == 1  # the making call, then one signature


@pytest.mark.parametrize("mode", MODES)
def test_a_call_whose_donated_layers_say_they_hold_no_tensors_yet_runs_eagerly_untraced(mode, caplog, capsys):
    """A layer that says is_initialized=False (transformers' lazily made cache, before generate's prefill) is made by
    the call: it runs eagerly at once, not first traced (a trace of it would be thrown away: seconds of a first
    generate); a new such cache of the same signature runs eagerly too; the calls after each are traced once."""
    f = fgraph.jit(flagged_step, donate=["past_key_values"], mode=mode)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for _ in range(2):  # two generates: each makes its cache, then steps on it
            want_cache, got_cache = lazy_cache(), lazy_cache()
            for i in range(3):
                x = torch.full((3,), float(i))
                assert torch.equal(f(x, got_cache)[0], flagged_step(x, want_cache)[0])
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(want_cache.layers, got_cache.layers))
    # each call's runs of the function (jitted, then eager's): the first generate's first call, eagerly, at once; its
    # second traced; its third replayed; the second generate's first eagerly, the others replayed
    first, second = ["eager", "eager", "traced", "eager", "eager"], ["eager", "eager", "eager", "eager"]
    assert capsys.readouterr().out.split() == first + second
    assert f.stats()["fallbacks"]["init"] == 2 and f.stats()["total"]["traces"] == 1 and len(f.entries) == 1
    (msg,) = init_logs(caplog)
    assert "the tensors of donated `past_key_values.layers[0]` and 1 more" in msg
    assert "cache.early_initialization" in msg


def test_a_layer_that_says_it_holds_no_tensors_but_is_not_made_is_traced_from_the_second_call(caplog):
    def reads_length(x, past_key_values=None):  # never makes the layers' keys: the flag stays False
        return x + past_key_values.layers[0].length

    f = fgraph.jit(reads_length, donate=["past_key_values"])
    cache = lazy_cache(1)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for i in range(3):
            x = torch.full((3,), float(i))
            assert torch.equal(f(x, cache), reads_length(x, cache))
    assert f.stats()["fallbacks"]["init"] == 1 and f.stats()["total"]["traces"] == 1 and not init_logs(caplog)


def test_a_layer_that_says_it_holds_no_tensors_under_strict_is_the_traces_error():
    f = fgraph.jit(flagged_step, donate=["past_key_values"], strict=True)
    with pytest.raises(fgraph.SignatureError, match="makes donated `past_key_values.layers.0..keys`"):
        f(torch.ones(3), lazy_cache())


def test_a_dynamic_cache_is_a_clear_error():
    model = G.tiny("llama")
    model.forward = fgraph.jit(model.forward, donate=[CACHE])
    with pytest.raises(fgraph.TraceError) as e, torch.no_grad():  # generate's default cache: a DynamicCache
        model.generate(IDS, max_new_tokens=3, do_sample=False)
    msg = str(e.value)
    assert f"{CACHE}.layers[0].keys" in msg and "grown" in msg and "DynamicCache" in msg
    assert "use_cache=False" in msg and 'cache_implementation="static"' in msg
    cache = DynamicCache(config=model.config)  # the caller's own: its first call makes it, its second grows it
    model(input_ids=IDS, **{CACHE: cache}, use_cache=True)
    with pytest.raises(fgraph.TraceError, match="use_cache=False"):
        model(input_ids=IDS[:, :1], **{CACHE: cache}, use_cache=True)


def test_the_jitted_module_forwards_attribute_access():
    model = G.tiny("qwen2")
    want = G.generate(model, IDS, 3)
    m = fgraph.jit(model, donate=[CACHE])
    assert m.config is model.config and m.device == model.device and m.generation_config is model.generation_config
    assert torch.equal(G.generate(m, IDS, 3), want)  # generate's self(...) goes through the jitted forward
    assert m._forward.stats()["total"]["calls"] == 2 and "forward" not in vars(model)  # restored afterwards
    with pytest.raises(AttributeError):
        m.no_such_attribute  # noqa: B018


@pytest.mark.gpu
def test_full_capture_of_the_recipe_on_the_gpu_gives_exact_tokens():
    model = G.tiny("qwen2", "cuda")
    ids = IDS.cuda()
    want = G.generate(model, ids, 8)
    f = G.jit_forward(model, "FULL")
    # the prefill's cache is unmade, its counter still on the host: that call makes and moves them, eagerly
    assert torch.equal(G.generate(model, ids, 8), want)
    assert f.stats()["fallbacks"]["init"] == 1
    assert f.stats()["total"]["captures"] >= 1 and f.stats()["total"]["replays"] >= 6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_cache_each_generate_makes_is_adopted_not_copied_per_call(device):
    """generate makes a new StaticCache per generate. From the third on, its tensors are adopted (moved once into
    fgraph's buffers, then read in place): no decode call copies the cache in and back out."""
    model = G.tiny("qwen2", device)
    ids = IDS.to(device)
    want = G.generate(model, ids, 6)
    f = G.jit_forward(model, "FULL")
    for _ in range(3):
        assert torch.equal(G.generate(model, ids, 6), want)
    before = f.stats()["total"]
    assert torch.equal(G.generate(model, ids, 6), want)
    after = f.stats()["total"]
    (e,) = f.entries.values()
    cache = [i for i in e.slots.ix if e.paths[i].startswith(G.cache_parameter(model) + ".")]
    assert after["adopted"] - before["adopted"] == len(cache) > 0
    smallest = min(e.slots.targets[e.slots.ix.index(i)].nbytes for i in cache if e.paths[i].endswith("keys"))
    assert after["copied_bytes"] - before["copied_bytes"] < smallest  # (the step's own small inputs only)


@pytest.mark.gpu
def test_generates_own_compile_of_the_jitted_forward_runs_fgraphs_graphs():
    """generate as it runs by default on CUDA with a static cache: it torch.compiles the model's call, whose forward
    is jitted; that call is opaque to the compile (a graph break), so fgraph's graphs give eager's tokens."""
    model = G.tiny("qwen2", "cuda")
    ids = IDS.cuda()
    want = G.generate(model, ids, 8)
    f = G.jit_forward(model, "FULL")
    torch._dynamo.reset()
    assert torch.equal(G.generate(model, ids, 8, disable_compile=False), want)
    assert f.stats()["total"]["captures"] >= 1 and f.stats()["total"]["replays"] >= 6


@pytest.mark.parametrize("cache", ["generate", "caller"])
def test_the_hf_benchmark_checks_tokens_before_it_times(tmp_path, monkeypatch, cache):
    from benchmarks import hf_bench

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = hf_bench.main(["--smoke", "--batches", "1", "--new", "3", "--rounds", "1", "--cache", cache])
    assert {r["contender"] for r in rows} == {"hf_eager", "hf_eager_static", "hf_fgraph_static"}
    assert all(r["tokens_equal_eager_static"] for r in rows)
    # a rate per row, unless its one round had none: on a loaded machine (CI's two workers on two cores) a short
    # generate can take as long as the long one, and such a round is counted invalid, not timed (NaN)
    assert all(r["decode_tok_s_median"] > 0 or r["invalid_rounds"] == r["rounds"] for r in rows), rows
    (fg,) = (r["fgraph"] for r in rows if "fgraph" in r)
    if cache == "generate":  # decode's one signature; each of the 7 generates (the first, two untimed rounds of two,
        # the timed round of two) makes a cache, eagerly in its prefill
        assert fg["signatures"] == 1 and fg["fallbacks"]["init"] == 7 and fg["total"]["fast"] > 0
    else:  # the caller's cache, made up front: prefill and decode are traced, and decode steps replayed
        assert fg["signatures"] == 2 and fg["fallbacks"]["init"] == 0 and fg["total"]["fast"] > 0
    (host,) = (r["host_us"] for r in rows if "host_us" in r)
    assert 0 < host["replay_path"] < host["slow_bind"] and all(r["call_us"] > 0 for r in rows)
    assert 0 < host["find_in_generate"] < host["slow_bind"]
    (tuner,) = (r["linear_s"] for r in rows if "linear_s" in r)  # the few-row matmul tuner's wall time (CPU: none)
    assert tuner["tune"] >= tuner["compile"] >= 0
    (loop,) = (r["loop_us"] for r in rows if "loop_us" in r)
    # generate's own loop (a difference of two timings: on a loaded machine it can come out below zero, or above a
    # model call's, so only that it was measured is checked; how it compares is the benchmark's to say)
    assert loop == loop and abs(loop) < float("inf")
    assert (tmp_path / "hf_bench.jsonl").read_text().count("\n") == 3


def test_the_hf_benchmarks_moe_row_checks_its_tokens_against_eager(tmp_path, monkeypatch):
    from benchmarks import hf_bench

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = hf_bench.main(["--smoke", "--arch", "qwen2_moe", "--batches", "2", "--new", "3", "--rounds", "1"])
    assert {r["arch"] for r in rows} == {"qwen2_moe"} and all(r["tokens_equal_eager_static"] for r in rows)
    fgs = {r["contender"]: r["fgraph"] for r in rows if "fgraph" in r}
    assert set(fgs) == {"hf_fgraph_static", "hf_fgraph_moe_primitive"}  # (the compiled ones are CUDA's)
    assert all(fg["total"]["captures"] >= 1 and fg["total"]["fast"] > 0 for fg in fgs.values())


def test_a_benchmark_variant_runs_every_generate_of_its_own_row_under_its_switches(tmp_path, monkeypatch):
    # `--variant sdpa_decode=False`: a lever timed beside the row without it, in the same rounds of one process; its
    # switches are set while its own model traces, compiles and runs, and for no other row
    import fgraph
    from benchmarks import hf_bench
    from examples import hf_generate

    seen, jit_forward = {}, hf_generate.jit_forward

    def spied(model, *a, **k):  # (each generate of a jitted row traces, compiles or replays inside it)
        jit_forward(model, *a, **k)
        generate, calls = model.generate, seen.setdefault(id(model), [])
        model.generate = lambda *x, **kw: calls.append(fgraph.config.sdpa_decode) or generate(*x, **kw)

    monkeypatch.setattr(hf_generate, "jit_forward", spied)
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--smoke", "--batches", "1", "--new", "3", "--rounds", "1", "--variant", "sdpa_decode=False"]
    rows = hf_bench.main(argv)
    name = "hf_fgraph_generate_default+sdpa_decode=False"
    assert {r["contender"] for r in rows} == {"hf_eager", "hf_eager_static", "hf_fgraph_static", name}
    assert all(r["tokens_equal_eager_static"] for r in rows)
    static, variant = seen.values()  # (in the order the contenders are made)
    assert static and all(static) and variant and not any(variant)
    assert fgraph.config.sdpa_decode is True  # the default, back
    for bad in ("no_such_switch=1", "sdpa_decode=3", "sdpa_decode=maybe"):
        with pytest.raises(SystemExit):
            hf_bench.main([*argv[:-1], bad])


def test_a_round_whose_short_generate_took_as_long_as_its_long_one_has_no_decode_rate():
    # (the H200's B=8 run had one: 64 tokens in no more time than 1, a rate of 5e11 tokens/s in the row's max)
    from benchmarks import hf_bench

    assert hf_bench.decode_rates(8, 64, [(0.01, 0.2), (0.3, 0.3), (0.5, 0.2)]) == pytest.approx([8 * 63 / 0.19])


def test_a_sliding_window_cache_is_a_clear_error():
    """transformers' sliding-window StaticCache layers count tokens in a Python int, changed by every call, which no
    graph replays: refused at trace time, with a way out that keeps a static cache (full-length layers: the specs of
    that way are tests/examples/test_hf_sliding.py)."""
    import transformers as tf

    none = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    cfg = tf.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4, **none)  # fmt: skip
    model = tf.MistralForCausalLM(cfg).eval()
    model.generation_config.update(**none)
    G.jit_forward(model, "FULL")
    with pytest.raises(fgraph.TraceError, match=r"cumulative_length_int.*sliding-window.*\n.*StaticLayer"):
        G.generate(model, IDS, 3)


def test_the_example_runs_generate_through_fgraph_and_says_what_served_it():
    out = G.main(["--device", "cpu", "--new-tokens", "6", "--batch", "2", "--prompt-len", "5"])
    assert out["tokens_equal"] and out["signatures"] == 1 and out["fallbacks"] == {"init": 1}
    # decode: 5 calls, the last two the replay path's (the first three meet the layout, then new input tensors
    # twice: read in place after a capture again, then copied)
    assert out["stats"]["replays"] == 5 and out["stats"]["fast"] == 2


def test_the_example_compiles_the_pieces_on_request_and_by_default_only_on_cuda():
    """`--compile`: Inductor's kernels in the graphs (float32 on the CPU: these tokens equal eager's)."""
    args = ["--device", "cpu", "--new-tokens", "6", "--batch", "2", "--prompt-len", "5"]
    out = G.main([*args, "--compile"])
    assert out["compile"] and out["tokens_equal"] and out["stats"]["replays"] == 5
    assert not G.main(args)["compile"]


def test_a_cache_passed_but_not_donated_is_named_with_the_fix():
    """`fgraph.jit(model)` without donating the cache: generate's StaticCache is an argument fgraph does not see into,
    so its counter is read but no input (or, once the class is seen into in this process for a donated one, written
    in place but not donated). The error names the tensor's key path inside the argument and the fix (donate it),
    which then gives eager's tokens."""
    model, want = G.tiny(), G.generate(G.tiny(), IDS, 4)
    name = G.cache_parameter(model)
    read = rf"`{name}\.layers\[0\]\.\w+`.*argument `{name}` is a StaticCache.*\nFix: donate it: .*donate=\['{name}'\]"
    written = rf"into {name}\.layers\[0\]\.\w+, which is not donated\nFix: add '{name}' to donate="
    with pytest.raises(fgraph.TraceError, match=f"{read}|{written}"):
        G.generate(fgraph.jit(model), IDS, 4)
    jitted = fgraph.jit(model, donate=[name])
    assert torch.equal(G.generate(jitted, IDS, 4), want)
    assert jitted.stats()["total"]["replays"] >= 3  # the module's stats count what its generate ran


def test_the_hf_benchmark_checks_tokens_against_eager_when_eagers_rows_are_skipped(tmp_path, monkeypatch):
    from benchmarks import hf_bench

    monkeypatch.setenv("OUT", str(tmp_path))
    rows = hf_bench.main(["--smoke", "--batches", "1", "--new", "3", "--rounds", "1", "--skip", "hf_eager"])
    assert {r["contender"] for r in rows} == {"hf_eager_static", "hf_fgraph_static"}
    assert all(r["tokens_equal_eager"] and r["tokens_equal_eager_static"] for r in rows)


@pytest.mark.parametrize("cache", ["generate", "caller"])
def test_the_hf_host_benchmark_times_the_replay_path_inside_generate(cache):
    from benchmarks import hf_host

    got = hf_host.main(["--loops", "1", "--tokens", "4", "--stub", "--cache", cache])
    assert 0 < got["find"] < got["call"] and got["host_us"] > 0  # find is part of the call's host time


def test_the_hf_host_benchmark_times_the_parts_of_a_decode_call():
    from benchmarks import hf_host

    got = hf_host.main(["--loops", "1", "--tokens", "4", "--parts"])
    assert 0 < got["proven"][0] < got["find"][0] < got["call"][0]  # the proof is part of find, find of the call


def test_the_paired_speedup_is_the_median_of_each_rounds_ratio_and_skips_rounds_without_a_rate():
    # (a host whose load drifts between rounds moves both contenders of a round: their ratio holds where the
    # medians of each contender's own rates do not)
    from benchmarks import hf_bench

    mine = [(0.0, 0.1), (0.0, 0.2), (0.0, 0.4), (0.3, 0.3)]
    peer = [(0.0, 0.2), (0.0, 0.4), (0.0, 0.8), (0.0, 0.1)]
    assert hf_bench.paired_speedup(mine, peer) == 2.0
    assert hf_bench.paired_speedup([(0.3, 0.3)], [(0.0, 0.1)]) is None
