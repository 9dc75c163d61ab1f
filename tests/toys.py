"""Toy break primitives and a toy step shared by the core tests (registered once per process)."""

import torch

import fgraph
from fgraph import Batched, Support
from fgraph import _primitives as P

calls = {"scale": 0, "plan": [], "avals": []}


@fgraph.primitive("toy_scale")
def toy_scale(out: torch.Tensor, x: torch.Tensor, s: float) -> None:
    """out = x * s; counts its eager executions (a replayed graph does not run Python)."""
    calls["scale"] += 1
    out.copy_(x * s)


@fgraph.primitive("toy_never", support=lambda args: (Support.NEVER, "toy_never syncs with the host"))
def toy_never(out: torch.Tensor, x: torch.Tensor) -> None:
    out.copy_(x + 1)


@fgraph.primitive(
    "toy_decode_only", support=lambda args: (Support.UNIFORM_DECODE, "toy_decode_only has no mixed graph routine")
)
def toy_decode_only(out: torch.Tensor, x: torch.Tensor) -> None:
    out.copy_(x - 1)


def _record_plan(call: fgraph.PlanCall) -> None:
    calls["plan"].append((call.bucket, call.n, call.capturing, {k: v.clone() for k, v in call.inputs.items()}))
    calls["avals"].append(call.avals)


@fgraph.primitive("toy_planned", plan=_record_plan)
def toy_planned(out: torch.Tensor, x: torch.Tensor, lens: torch.Tensor) -> None:
    out.copy_(x * lens.to(x.dtype)[:, None])


@fgraph.primitive("toy_prepared", plan=lambda call: _record_plan(call) or True)
def toy_prepared(out: torch.Tensor, x: torch.Tensor, lens: torch.Tensor) -> None:
    """toy_planned whose plan hook makes all the host state it needs (returns True)."""
    out.copy_(x * lens.to(x.dtype)[:, None])


@fgraph.primitive("toy_maybe_planned", plan=_record_plan, plan_needed=lambda args: args["planned"])
def toy_maybe_planned(out: torch.Tensor, x: torch.Tensor, lens: torch.Tensor, planned: bool) -> None:
    out.copy_(x * lens.to(x.dtype)[:, None])


def step(params, state, batch, routine="decode", breaks=2):
    """A toy decoder step: `breaks` toy breaks between dense layers; state['count'] is donated and bumped."""
    h = batch["x"] @ params["w"]  # [N, D]
    for _ in range(breaks):
        o = torch.empty_like(h)
        toy_scale(o, h, 0.5)
        h = torch.tanh(o @ params["w"]) + batch["x"]
    state["count"].add_(1)
    return h, state


def make(n=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(d, d, generator=g) / d**0.5}
    state = {"count": torch.zeros((), dtype=torch.int64)}
    batch = {"x": torch.randn(n, d, generator=g)}
    return params, state, batch


def jitted(**kw):
    kw = {"static": ["routine", "breaks"], "donate": ["state"], "batch": {"batch": Batched()}, **kw}
    return fgraph.jit(step, **kw)


@fgraph.primitive("toy_shifted")
def toy_shifted(out: torch.Tensor, x: torch.Tensor, lens: torch.Tensor) -> None:
    """out = x * (lens - 1): `lens - 1` made once per execution (as flash_attn's decode makes its KV lengths)."""

    def shifted():
        calls["shifted"] = calls.get("shifted", 0) + 1
        return lens - 1

    out.copy_(x * P.once_per_execution(("toy_shifted", id(lens)), shifted).to(x.dtype)[:, None])


def shifted_layers(x, lens, layers=3):
    for _ in range(layers):
        o = torch.empty_like(x)
        toy_shifted(o, x, lens)
        x = o + 1
    return x
