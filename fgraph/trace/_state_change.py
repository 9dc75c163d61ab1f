"""What a call did to its donated state beyond writing its tensors in place, and objects that say they hold none yet.

A call that makes a lazily made cache's tensors runs eagerly (`InitialisesState`), found by its trace
(`state_change`) or, for objects that say so (`is_initialized` False: transformers' cache layers), before any trace
(`uninitialised`); a call that replaces a donated tensor or changes a Python value in donated state is refused."""

from __future__ import annotations

import sys

import torch
import torch.utils._pytree as pytree

from .._errors import GROWING_CACHE_FIX, TraceError
from .._pytree import flatten_with_paths, static_attrs


class InitialisesState(Exception):
    """The call makes tensors of a donated object that held none there (a lazily made cache): it runs eagerly."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what, self.fix = what, fix
        self.rescan = False  # the eager call may make tensors the function reads: lift them again at the next call


def _sliding_fix(name: str, layers: int) -> str:
    """The fix for transformers' sliding-window cache layers: a static cache of full-length layers, which keeps the
    cache (the model's sliding-window mask still limits each query to its window: eager's tokens)."""
    return (
        "pass a static cache whose layers keep every position: cache = transformers.Cache(layers=["
        f"transformers.StaticLayer(max_cache_len=L) for _ in range({layers})]) with L the prompt plus the new tokens, "
        f"then generate(..., {name}=cache) or forward(..., {name}=cache); the model's sliding-window mask still limits "
        "each query to its window, so the tokens are eager's (examples/hf_generate.py: full_static_cache)"
    )


def state_change(fname: str, donated: list, dyn: dict, before: dict) -> InitialisesState | None:
    """How the call changed what its donated arguments hold, beyond writing their tensors in place.

    None when it only wrote in place; InitialisesState when it made tensors where there were none (a lazily made
    cache: that call runs eagerly, later ones are traced; it may replace what it held too, as a StaticCache moves its
    counter to the keys' device); a TraceError when it replaced a tensor by another (a
    growing cache) or changed a Python value in it (graphs replay neither)."""
    made, replaced = [], None
    for name in donated:
        was, was_static = before[name]
        was_leaves = dict(was)
        now = flatten_with_paths(dyn[name])[0]
        for p, x in now:
            old = was_leaves.get(p, None)
            where = name + pytree.keystr(p)
            if isinstance(old, torch.Tensor) and x is not old and replaced is None:
                replaced = (where, old, x)
            if p not in was_leaves and isinstance(x, torch.Tensor):
                made.append(where)
        now_static = static_attrs(dyn[name])
        changed = [k for k in now_static if k in was_static and not _same(now_static[k], was_static[k])]
        if changed and not made:
            k = changed[0]
            library = type(dyn[name]).__module__.split(".")[0] == "transformers"  # code the user cannot change
            sliding = library and any(getattr(x, "is_sliding", False) for x in getattr(dyn[name], "layers", ()))
            raise TraceError(
                f"fgraph.jit({fname}): the function changes `{name}{k}` of donated state from "
                f"{was_static[k]!r} to {now_static[k]!r}: a Python value, which a captured graph cannot update"
                + (" (transformers' sliding-window cache layers count tokens in a Python int)" if sliding else ""),
                _sliding_fix(name, len(dyn[name].layers))
                if sliding
                else "call it with use_cache=False"
                if library
                else f"keep `{name}{k}` in a tensor updated in place (or pass it as an argument)",
            )
    if replaced is not None and not made:
        where, old, x = replaced
        grew = isinstance(x, torch.Tensor) and tuple(x.shape) != tuple(old.shape)
        raise TraceError(
            f"fgraph.jit({fname}): donated `{where}` ({_aval(old)}) is replaced by "
            f"{'a new tensor ' + _aval(x) if isinstance(x, torch.Tensor) else repr(x)}"
            f"{', grown' if grew else ''} by the function, where donated state is written in place (a cache "
            "that grows per call, such as transformers' DynamicCache, has no fixed-size graph)",
            GROWING_CACHE_FIX,
        )
    if made:
        return initialises(f"the call makes donated `{made[0]}`", made)
    return None


def uninitialised(donated: dict) -> list[str]:
    """The key paths of the objects in donated arguments (name -> value, seen into) that say they hold no tensors yet
    (`is_initialized` False: transformers' cache layers before their first write, which makes them)."""
    return [
        name + k.removesuffix(".is_initialized")
        for name, v in donated.items()
        for k, flag in static_attrs(v).items()
        if k.endswith(".is_initialized") and flag is False
    ]


def initialises(what: str, made: list[str]) -> InitialisesState:
    """A call that makes donated state: what it makes (`made`, key paths; `what` names the first), and the fix."""
    what += f" and {len(made) - 1} more" if len(made) > 1 else ""
    if _under_generate():  # the cache may be generate's own (cache_implementation=...), never in the user's hands
        name = made[0].split(".")[0].split("[")[0]
        return InitialisesState(
            what + ", which held no tensor (generate's prefill makes the cache's tensors): this call runs eagerly, "
            "later ones are traced",
            "to trace the prefill as well and have every generate read one cache in place, make a StaticCache, "
            f"call cache.early_initialization(...) and pass it: generate(..., {name}=cache) (cache.reset() between "
            "generates)",
        )
    return InitialisesState(
        what + ", which held no tensor (state made lazily, on first use): this call runs eagerly, later ones are "
        "traced",
        "make the state before the first call to trace it as well (a transformers StaticCache: "
        "cache.early_initialization(...))",
    )


def _under_generate() -> bool:
    """Whether transformers' generate is calling: it passes the model a cache it made itself unless given one."""
    f = sys._getframe()
    while f is not None and not f.f_globals.get("__name__", "").startswith("transformers.generation."):
        f = f.f_back
    return f is not None


def _aval(t) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _same(a, b) -> bool:
    try:
        return a is b or type(a) is type(b) and bool(a == b)
    except Exception:
        return False
