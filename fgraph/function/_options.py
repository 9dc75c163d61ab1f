"""fgraph.jit's options, checked when jit is called.

A value of the wrong kind is a SignatureError naming the option and what it takes, not a TypeError from deep inside a
first call, nor a truthy string read as True."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable, Mapping

import attrs
import torch.utils._pytree as pytree

from .. import _primitives as P
from .._config import config
from .._errors import SignatureError
from .._modes import Mode
from .._signature import Batched, default_buckets
from ..compile import inductor_options


@attrs.frozen
class Options:
    """fgraph.jit's options for one function, checked once where jit is called (see `jit` for what each means).

    `given`: the options as passed, to make the same jitted function for each instance of a method's class."""

    static: tuple[str, ...]
    donate: tuple[str, ...]
    scratch: tuple[str, ...]
    batch: dict
    buckets: tuple[int, ...]
    mode: Mode
    breaks: list[str] | None
    strict: bool
    copy_outputs: bool
    routine: str
    warmups: int
    compile: dict | None
    given: dict
    compile_default: bool = False  # no compile= given: `compile_for` decides per device

    def compile_for(self, device: str) -> dict | None:
        """The Inductor options a signature on `device` compiles its graph pieces under; None: uncompiled graphs.
        As given, or by default ({}: Inductor's defaults) on CUDA while fgraph.config.compile_cuda is on."""
        if not self.compile_default:
            return self.compile
        return {} if device.startswith("cuda") and config.compile_cuda else None

    def compile_text(self, device: str) -> str:
        """Which `compile_for` is in effect on `device`, and why (explain, the capture summary)."""
        got = self.compile_for(device)
        if not self.compile_default:
            return "uncompiled graphs (compile=False)" if got is None else f"Inductor (compile={got or True!r})"
        if got is not None:
            return "Inductor (the default on CUDA; compile=False: eager's kernels, bit for bit)"
        why = "fgraph.config.compile_cuda is off" if device.startswith("cuda") else f"the default on {device}"
        return f"uncompiled graphs ({why}; compile=True: Inductor)"


def check_names(options: dict, known) -> None:
    """Check that every option given to jit(**options) is one Jitted takes.

    A misspelt one would otherwise be a TypeError naming Jitted.__init__, and only once the decorator is applied."""
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
    """What capture(...) captures: its static choices, the other keyword arguments, and the buckets.

    The static choices are a list per static keyword (each of its values); the buckets are the ones calls are padded
    to (a capture of any other would be unused), largest first."""
    where = f"fgraph.jit({jitted.name}).capture"
    try:
        positional = jitted.signature.bind_partial(*args).arguments
    except TypeError:  # (the call's own binding error comes from binding it)
        positional = {}
    listed = next((k for k, v in positional.items() if k in jitted.options.static and isinstance(v, list)), None)
    if listed is not None:
        raise SignatureError(
            f"{where}: static argument {listed}={positional[listed]!r} is passed by position, where a list is one "
            "(unhashable) value",
            f"pass it by keyword, {listed}=[...], to capture each value",
        )
    choices = {k: (v if isinstance(v, list) else [v]) for k, v in kwargs.items() if k in jitted.options.static}
    empty = next((k for k, v in choices.items() if not v), None)
    if empty is not None:
        raise SignatureError(
            f"{where}: {empty}=[] gives no value to capture, so nothing would be captured before sealing",
            f"list the values to capture ({empty}=[...]), or leave {empty} out to capture its default",
        )
    todo = jitted.options.buckets if buckets is None else bucket_sizes(where, buckets)
    unknown = [b for b in todo if b not in jitted.options.buckets]
    if unknown:
        raise SignatureError(
            f"{where}: buckets {unknown} are not among {jitted.name}'s buckets {list(jitted.options.buckets)}, so no "
            "call would be padded to them",
            "capture some of its buckets, or add these to fgraph.jit(..., buckets=[...])",
        )
    rest = {k: v for k, v in kwargs.items() if k not in jitted.options.static}
    return choices, rest, sorted(todo, reverse=True)


def flag(fname: str, option: str, x) -> bool:
    """strict= / copy_outputs=: a bool (copy_outputs="no" would be truthy: copies, where zero-copy was meant)."""
    if not isinstance(x, bool):
        raise SignatureError(f"fgraph.jit({fname}): {option}={x!r} is not a bool", f"pass {option}=True or False")
    return x


def make(fname: str, signature, lifted_roots: set[str], given: dict) -> Options:
    """Jitted's options, checked.

    jax's spellings (static_argnames=, donate_argnames=) merged in, names that are parameters, values of the right
    kind."""
    opts = dict(given)
    static, donate = (
        (*names(fname, a, opts.pop(a)), *names(fname, f"{a}_argnames", opts.pop(f"{a}_argnames")))
        for a in ("static", "donate")
    )
    both = [a for a in static if a in donate]
    if both:
        raise SignatureError(
            f"fgraph.jit({fname}): {both[0]!r} is named in both static= and donate=",
            "keep it in one: static= is for hashable Python values frozen into the signature, donate= for tensors "
            "the function updates in place",
        )
    params = signature.parameters
    scratch, batch = names(fname, "scratch", opts["scratch"]), batch_spec(fname, opts["batch"], static)
    for kind, named in (("static", static), ("donate", donate), ("scratch", scratch), ("batch", list(batch))):
        for a in named:
            if a not in params and not (kind == "donate" and a in lifted_roots):
                raise SignatureError(
                    f"fgraph.jit({fname}): {kind}= names {a!r}, which is not a parameter of {fname}{signature}",
                    f"use one of {list(params)}",
                )
    bucket_opt = opts["buckets"]
    buckets = default_buckets() if bucket_opt is None else bucket_sizes(f"fgraph.jit({fname})", bucket_opt)
    mode = opts["mode"]
    try:
        mode = Mode(mode.upper() if isinstance(mode, str) else mode)
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
    strict = flag(fname, "strict", opts["strict"])
    copy_outputs = flag(fname, "copy_outputs", opts["copy_outputs"])
    routine = opts["routine"]
    if not isinstance(routine, str) or (routine != "routine" and routine not in params):
        raise SignatureError(
            f"fgraph.jit({fname}): routine={routine!r} is not a parameter of {fname}{signature}",
            "routine= names the static parameter whose value 'decode' marks decode signatures: pass its name",
        )
    warmups = opts["warmups"]
    if isinstance(warmups, bool) or not isinstance(warmups, int) or warmups < 0:
        raise SignatureError(
            f"fgraph.jit({fname}): warmups={warmups!r} is not a count", "pass a non-negative int (the default: 1)"
        )
    options = Options(
        static=tuple(static),
        donate=tuple(donate),
        scratch=scratch,
        batch=batch,
        buckets=buckets,
        mode=mode,
        breaks=None if breaks is None else list(breaks),
        strict=strict,
        copy_outputs=copy_outputs,
        routine=routine,
        warmups=warmups,
        compile=None,
        given=dict(given),
    )
    check_options(fname, signature, options)
    return attrs.evolve(
        options, compile=inductor_options(fname, opts["compile"]), compile_default=opts["compile"] is None
    )


def check_options(fname: str, signature, options: Options) -> None:
    """The jit options padding and capture rely on, checked when jit is called rather than at a first call."""
    loose = [a for a in options.scratch if a not in options.donate]
    if loose:
        raise SignatureError(
            f"fgraph.jit({fname}): scratch= names {loose}, which are not donated",
            "scratch= declares donated state whose padded rows write only to a scratch area: donate it too",
        )
    if options.mode.value == "FULL_DECODE_ONLY" and options.routine not in options.static:
        raise SignatureError(
            f"fgraph.jit({fname}): mode FULL_DECODE_ONLY needs the static routine argument {options.routine!r} "
            f'(its value "decode" marks the signatures to capture), but {fname}{signature} '
            + ("has no such parameter" if options.routine not in signature.parameters else "does not make it static"),
            f"add a `{options.routine}` parameter to static=[...] (or pass routine=<its name>), or use mode='FULL'",
        )
