"""fgraph.repeated: a function called many times alike (a decoder layer) is traced once per input signature and its
ops copied for the later calls. The graph must be the one a full trace gives, so these tests compare the two."""

import attrs
import pytest
import torch

import fgraph
from examples import engine, llama
from fgraph.trace import _repeated
from tests import toys


def layer(w, b, x):
    """A toy layer with a break in it: [N, D] -> [N, D]."""
    h = torch.tanh(x @ w + b)
    o = torch.empty_like(h)
    toys.toy_scale(o, h, 0.5)
    return x + o


def step(params, batch, routine="decode", repeat=True):
    f = fgraph.repeated(layer) if repeat else layer
    x = batch["x"]
    for w, b in zip(params["w"], params["b"]):
        x = f(w, b, x)
    return x * 2


def make(n=7, layers=5, d=8):
    g = torch.Generator().manual_seed(0)
    return (
        {
            "w": [torch.randn(d, d, generator=g) / d**0.5 for _ in range(layers)],
            "b": [torch.randn(d, generator=g) for _ in range(layers)],
        },
        {"x": torch.randn(n, d, generator=g)},
    )


def jitted(**kw):
    return fgraph.jit(step, static=["routine", "repeat"], batch={"batch": fgraph.Batched()}, buckets=[8, 32], **kw)


def graph_of(f, *args, **kw):
    """The traced program of this call's signature, node by node, and the shape guards its trace assumed."""
    f(*args, **kw)
    statics = {"routine": kw.get("routine", "decode"), "repeat": kw.get("repeat", True)}
    (e,) = [e for e in f.entries.values() if statics.items() <= dict(e.sig.statics).items()]  # (jit objects of
    # step and these options share one cache: the other static's signature may be there too)
    nodes = [str(n.format_node()) for n in e.traced.program.module.graph.nodes] + [
        str(n.format_node()) for m in e.traced.program.module.children() for n in m.graph.nodes
    ]
    return nodes, sorted(str(g.expr) for g in e.traced.shapes.shape_env.guards)


@pytest.mark.parametrize("routine", ["decode", "mixed"])
def test_layers_traced_once_give_the_graph_of_a_full_trace(routine):
    params, batch = make(n=25)
    before = dict(_repeated.stats)
    copied = graph_of(jitted(mode="NONE"), params, batch, routine=routine)
    assert _repeated.stats["traced"] - before["traced"] == 1 and _repeated.stats["copied"] - before["copied"] == 4
    assert copied == graph_of(jitted(mode="NONE"), params, batch, routine=routine, repeat=False)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_layers_traced_once_run_like_eager_at_every_size(mode):
    f = jitted(mode=mode)
    params, _ = make()
    g = torch.Generator().manual_seed(1)
    for n in (7, 25, 8, 3):
        for routine in ("decode", "mixed"):
            batch = {"x": torch.randn(n, 8, generator=g)}
            torch.testing.assert_close(f(params, batch, routine=routine), step(params, batch, routine=routine))
    assert f.stats()["total"]["traces"] == 2  # one symbolic trace per routine, each with its layers copied


def test_a_tensor_read_from_outside_the_arguments_is_refused():
    params, batch = make()

    def closes_over_weights(params, batch, routine="decode"):
        x = batch["x"]
        for i in range(len(params["w"])):
            x = fgraph.repeated(lambda x: x @ params["w"][i])(x)  # the copies would all read layer 0's weight
        return x

    f = fgraph.jit(closes_over_weights, static=["routine"], batch={"batch": fgraph.Batched()}, buckets=[8])
    with pytest.raises(fgraph.TraceError) as e:
        f(params, batch)
    msg = str(e.value)
    assert "fgraph.repeated(" in msg and "from outside the function's arguments" in msg
    assert "aten.mm.default at tests/trace/test_repeated.py:" in msg and "(an input of the jitted function)" in msg
    assert "pass every tensor the function reads as an argument" in msg


def test_outside_tracing_it_is_a_plain_call():
    params, batch = make()
    before = dict(_repeated.stats)
    torch.testing.assert_close(step(params, batch), step(params, batch, repeat=False))
    assert _repeated.stats == before


def test_torch_compile_of_a_model_that_decorates_its_layers_inside_is_one_graph():
    """torch.compile(fullgraph=True) of the example step, which applies fgraph.repeated inside its forward: dynamo
    sees the plain layer (the decorator steps aside while dynamo traces), so the torch.compile peer of the
    benchmarks compiles the very function fgraph jits. (An H200 run found dynamo failing on the
    decorator's repr.)"""
    from benchmarks.common import decode_batch

    cfg = attrs.evolve(llama.preset("tiny"), n_layers=2)
    params = llama.init_params(cfg, torch.float32, "cpu")
    batch, pages = decode_batch(cfg.vocab_size, 3, 16, 4, 64)
    step = llama.make_step(cfg, "torch", 64)
    torch._dynamo.reset()
    comp = torch.compile(step, fullgraph=True, backend="eager")
    before = dict(_repeated.stats)
    got, _ = comp(params, llama.init_cache(cfg, pages + 1, 4, torch.float32, "cpu"), batch, "decode")
    want, _ = step(params, llama.init_cache(cfg, pages + 1, 4, torch.float32, "cpu"), batch, "decode")
    torch.testing.assert_close(got, want)
    assert _repeated.stats == before


def test_the_example_decoder_traces_one_layer_and_explains_as_before(monkeypatch):
    """The Llama/Qwen step copies its layers: explain (pieces, ops, inputs and outputs of each) and the shape
    guards of the traces that served a generation are the same as with every layer traced."""
    cfg = attrs.evolve(llama.preset("tiny"), n_layers=4)
    params = llama.init_params(cfg, torch.float32, "cpu")

    def explained():
        eng = engine.build(
            cfg,
            params,
            backend="torch",
            mode="FULL_AND_PIECEWISE",
            max_seqs=4,
            max_seq_len=64,
            page_size=4,
            max_batch_tokens=8,
            buckets=(2, 8),
        )
        text = [str(eng.explain(r)) for r in ("decode", "mixed")]  # (before any capture: no timings in it)
        eng.add([5, 17, 300, 2, 999, 41, 8, 8, 120, 77], max_new_tokens=3)  # mixed steps at bucket 8, decodes at 2
        eng.run(progress=False)
        guards = sorted(
            str(g.expr)
            for e in eng.step_fn.entries.values()
            if e.traced.shapes is not None
            for g in e.traced.shapes.shape_env.guards
        )
        assert guards  # (the comparison means something)
        return text + [guards]

    before = dict(_repeated.stats)
    copied = explained()
    traced, copied_n = (_repeated.stats[k] - before[k] for k in ("traced", "copied"))
    assert traced >= 2 and copied_n == traced * (cfg.n_layers - 1)  # each trace: one layer traced, 3 copied
    monkeypatch.setattr(fgraph, "repeated", lambda fn: fn)
    assert copied == explained()


def like_eager_with_layers_copied(chain):
    """chain(params, batch), jitted, equals eager, with its 4 later layers copied from the first."""
    params, batch = make(n=5)
    f = fgraph.jit(chain, batch={"batch": fgraph.Batched()}, buckets=[8])
    before = _repeated.stats["copied"]
    torch.testing.assert_close(f(params, batch), chain(params, batch))
    assert _repeated.stats["copied"] - before == 4


def test_outputs_that_are_arguments_or_values_come_back_as_such():
    """A copy hands back an argument it returns as that very tensor, and a Python value as itself."""

    def pair(w, x):
        return torch.tanh(x @ w), x, 3

    def chain(params, batch):
        x, seen = batch["x"], []
        for w in params["w"]:
            y, same, k = fgraph.repeated(pair)(w, x)
            seen.append(same is x and k == 3)
            x = y
        assert all(seen), seen  # checked while tracing, in every layer (traced or copied)
        return x

    like_eager_with_layers_copied(chain)


@attrs.define
class Hidden:  # a record no one registered: fgraph registers it where it meets it, in values as in arguments
    x: torch.Tensor


def test_records_between_layers_are_seen_into():
    """A layer that returns an unregistered attrs record: each copy gets its own record of fresh tensors, never
    the first layer's (which made every later layer's output the first one's)."""

    def rec_layer(w, x):
        return Hidden(torch.tanh(x @ w))

    def chain(params, batch):
        x = batch["x"]
        for w in params["w"]:
            x = fgraph.repeated(rec_layer)(w, x).x
        return x

    like_eager_with_layers_copied(chain)


def test_inductor_compiles_the_pieces_of_copied_layers():
    """jit(compile=True): Inductor compiles each piece, copied layers' nodes included (they carry layer 0's fake
    values as metadata), and the result equals the eager step."""
    from benchmarks.common import decode_batch

    cfg = attrs.evolve(llama.preset("tiny"), n_layers=3)
    params = llama.init_params(cfg, torch.float32, "cpu")
    batch, pages = decode_batch(cfg.vocab_size, 5, 64, 4, 128)
    step = llama.make_step(cfg, "torch", 128)
    f = fgraph.jit(
        step,
        static=["routine"],
        donate=["cache"],
        buckets=[8],
        compile=True,
        mode="FULL",
        batch={"batch": llama.Batch(fgraph.Batched(), fgraph.Batched(), llama.A.metadata_batching())},
    )
    before = _repeated.stats["copied"]
    got, _ = f(params, llama.init_cache(cfg, pages + 1, 4, torch.float32, "cpu"), batch, routine="decode")
    want, _ = step(params, llama.init_cache(cfg, pages + 1, 4, torch.float32, "cpu"), batch, "decode")
    assert _repeated.stats["copied"] - before == 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_float_argument_keys_its_template_by_sign():
    """0.0 and -0.0 compare equal, but copysign (or 1 / x) tells them apart: each gets its own template, as statics
    and Python scalars are keyed by a float's hex."""

    @fgraph.repeated
    def signed(x, s):
        return x + torch.copysign(torch.ones_like(x), s)

    def two(x):
        return signed(x, 0.0), signed(x, -0.0)

    f = fgraph.jit(two, batch={"x": fgraph.Batched()}, buckets=[4])
    x = torch.rand(3, 2)
    for got, want in zip(f(x), two(x)):
        assert torch.equal(got, want)
