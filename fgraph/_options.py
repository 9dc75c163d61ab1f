"""fgraph.jit's options, checked when jit is called: a value of the wrong kind is a SignatureError naming the option
and what it takes, not a TypeError from deep inside a first call, nor a truthy string read as True."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable, Mapping

import torch.utils._pytree as pytree

from . import _primitives as P
from ._errors import SignatureError
from ._inductor import inductor_options
from ._modes import Mode
from ._signature import Batched, default_buckets


def check_names(options: dict, known) -> None:
    """jit(**options): every option is one Jitted takes (a misspelt one would otherwise be a TypeError naming
    Jitted.__init__, and only once the decorator is applied)."""
    for k in options:
        if k not in known:
            close = difflib.get_close_matches(k, known, n=1)
            raise SignatureError(
                f"fgraph.jit: unknown option {k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                f"the options are {', '.join(known)}",
            )


def names(fname: str, option: str, x) -> tuple:
    """static= / donate= / scratch= / breaks= ...: one name, or a list of names."""
    if x is None:
        return ()
    if isinstance(x, str):
        return (x,)
    if isinstance(x, (Mapping, Batched)) or not isinstance(x, Iterable):
        raise SignatureError(
            f"fgraph.jit({fname}): {option}={x!r} is neither a name nor a list of names",
            f"pass {option}=['name', ...] (parameter names as strings)",
        )
    return tuple(x)


def batch_spec(fname: str, batch, static: tuple) -> dict:
    """batch=: {argument name: a Batched, or a prefix tree of the argument holding Batched and None}."""
    if batch is None:
        return {}
    if not isinstance(batch, Mapping):
        raise SignatureError(
            f"fgraph.jit({fname}): batch={batch!r} is not a dict of argument names",
            'pass batch={"x": fgraph.Batched()}: per argument, a Batched or a tree of Batched/None matching it',
        )
    for name, spec in batch.items():
        if name in static:
            raise SignatureError(
                f"fgraph.jit({fname}): {name!r} is named in both static= and batch=",
                "keep it in one: a static argument is a Python value frozen into the signature, never padded",
            )
        leaves = pytree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Batched) or x is None)
        bad = next((x for x in leaves if not isinstance(x, Batched)), None)
        if bad is not None:
            holds = f"{bad!r} is" if bad is spec else f"it holds {bad!r}, which is"
            raise SignatureError(
                f"fgraph.jit({fname}): batch={{{name!r}: {spec!r}}}: {holds} neither a Batched nor None",
                "mark the leaves that carry the batch axis with fgraph.Batched(...), the others with None",
            )
    return dict(batch)


def bucket_sizes(where: str, buckets) -> tuple[int, ...]:
    """buckets= (of jit, or of capture): positive integer sizes, sorted, without repeats."""
    if isinstance(buckets, (str, bytes, Mapping)) or not isinstance(buckets, Iterable):
        raise SignatureError(f"{where}: buckets={buckets!r} is not a list of sizes", "give buckets=[1, 2, 4, ...]")
    sizes = list(buckets)
    if not sizes:
        raise SignatureError(f"{where}: buckets=[] leaves no size to pad a call to", "give buckets=[...]")
    if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in sizes):
        raise SignatureError(f"{where}: buckets={sizes}", "give positive integer sizes")
    return tuple(sorted({int(b) for b in sizes}))


def capture_plan(jitted, args: tuple, kwargs: dict, buckets) -> tuple[dict, dict, list[int]]:
    """capture(...)'s static choices (a list per static keyword: each of its values), the other keyword arguments,
    and the buckets to capture, largest first: ones calls are padded to (a capture of any other would be unused)."""
    where = f"fgraph.jit({jitted.name}).capture"
    try:
        positional = jitted.signature.bind_partial(*args).arguments
    except TypeError:  # (the call's own binding error comes from binding it)
        positional = {}
    listed = next((k for k, v in positional.items() if k in jitted.static and isinstance(v, list)), None)
    if listed is not None:
        raise SignatureError(
            f"{where}: static argument {listed}={positional[listed]!r} is passed by position, where a list is one "
            "(unhashable) value",
            f"pass it by keyword, {listed}=[...], to capture each value",
        )
    choices = {k: (v if isinstance(v, list) else [v]) for k, v in kwargs.items() if k in jitted.static}
    empty = next((k for k, v in choices.items() if not v), None)
    if empty is not None:
        raise SignatureError(
            f"{where}: {empty}=[] gives no value to capture, so nothing would be captured before sealing",
            f"list the values to capture ({empty}=[...]), or leave {empty} out to capture its default",
        )
    todo = jitted.buckets if buckets is None else bucket_sizes(where, buckets)
    unknown = [b for b in todo if b not in jitted.buckets]
    if unknown:
        raise SignatureError(
            f"{where}: buckets {unknown} are not among {jitted.name}'s buckets {list(jitted.buckets)}, so no call "
            "would be padded to them",
            "capture some of its buckets, or add these to fgraph.jit(..., buckets=[...])",
        )
    rest = {k: v for k, v in kwargs.items() if k not in jitted.static}
    return choices, rest, sorted(todo, reverse=True)


def flag(fname: str, option: str, x) -> bool:
    """strict= / copy_outputs=: a bool (copy_outputs="no" would be truthy: copies, where zero-copy was meant)."""
    if not isinstance(x, bool):
        raise SignatureError(f"fgraph.jit({fname}): {option}={x!r} is not a bool", f"pass {option}=True or False")
    return x


def declare(jitted, static: tuple, donate: tuple, opts: dict) -> None:
    """Jitted.__init__'s options, checked and set on it (static and donate already merged with jax's spellings)."""
    fname, params = jitted.name, jitted.signature.parameters
    scratch, batch = names(fname, "scratch", opts["scratch"]), batch_spec(fname, opts["batch"], static)
    for kind, given in (("static", static), ("donate", donate), ("scratch", scratch), ("batch", list(batch))):
        for a in given:
            if a not in params and not (kind == "donate" and a in jitted._lifted.roots()):
                raise SignatureError(
                    f"fgraph.jit({fname}): {kind}= names {a!r}, which is not a parameter of {fname}{jitted.signature}",
                    f"use one of {list(params)}",
                )
    jitted.static, jitted.donate, jitted.scratch, jitted.batch = tuple(static), tuple(donate), scratch, batch
    given = opts["buckets"]
    jitted.buckets = default_buckets() if given is None else bucket_sizes(f"fgraph.jit({fname})", given)
    mode = opts["mode"]
    try:
        jitted.mode = Mode(mode.upper() if isinstance(mode, str) else mode)
    except ValueError:
        raise SignatureError(
            f"fgraph.jit({fname}): unknown mode {mode!r}", f"use one of {[m.value for m in Mode]}"
        ) from None
    breaks = None if opts["breaks"] is None else names(fname, "breaks", opts["breaks"])
    unknown = [b for b in breaks or () if b not in P.registry]
    if unknown:
        raise SignatureError(
            f"fgraph.jit({fname}): breaks= names unknown primitives {unknown}",
            f"registered primitives are {sorted(P.registry)}",
        )
    jitted.breaks = None if breaks is None else list(breaks)
    jitted.strict = flag(fname, "strict", opts["strict"])
    jitted.copy_outputs = flag(fname, "copy_outputs", opts["copy_outputs"])
    routine = jitted.routine = opts["routine"]
    if not isinstance(routine, str) or (routine != "routine" and routine not in params):
        raise SignatureError(
            f"fgraph.jit({fname}): routine={routine!r} is not a parameter of {fname}{jitted.signature}",
            "routine= names the static parameter whose value 'decode' marks decode signatures: pass its name",
        )
    warmups = opts["warmups"]
    if isinstance(warmups, bool) or not isinstance(warmups, int) or warmups < 0:
        raise SignatureError(
            f"fgraph.jit({fname}): warmups={warmups!r} is not a count", "pass a non-negative int (the default: 1)"
        )
    jitted.warmups = warmups
    check_options(fname, jitted.signature, jitted)
    jitted.compile = inductor_options(fname, opts["compile"])


def check_options(fname: str, signature, jitted) -> None:
    """The jit options padding and capture rely on, checked when jit is called rather than at a first call."""
    loose = [a for a in jitted.scratch if a not in jitted.donate]
    if loose:
        raise SignatureError(
            f"fgraph.jit({fname}): scratch= names {loose}, which are not donated",
            "scratch= declares donated state whose padded rows write only to a scratch area: donate it too",
        )
    if jitted.mode.value == "FULL_DECODE_ONLY" and jitted.routine not in jitted.static:
        raise SignatureError(
            f"fgraph.jit({fname}): mode FULL_DECODE_ONLY needs the static routine argument {jitted.routine!r} "
            f'(its value "decode" marks the signatures to capture), but {fname}{signature} '
            + ("has no such parameter" if jitted.routine not in signature.parameters else "does not make it static"),
            f"add a `{jitted.routine}` parameter to static=[...] (or pass routine=<its name>), or use mode='FULL'",
        )
