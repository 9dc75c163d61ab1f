"""explain: deterministic text about what fgraph made of a function, per signature."""

from __future__ import annotations

from .._errors import FgraphError
from .._traceback import boundary
from ..compile import kernels_made
from ..trace import op_summary
from ._jit import Jitted
from ._lower import avals_lines


class Explanation:
    def __init__(self, text: str, entries: list):
        self.text, self.entries = text, entries

    def __str__(self):
        return self.text

    __repr__ = __str__


def _entry_text(fn: Jitted, e, n: int | None) -> str:
    lines = [f"{fn.name}{e.sig.describe()}"]
    if n is not None:
        lines.append(f"  tokens: {n} -> bucket {e.sig.bucket} ({e.sig.bucket - n} padded)")
    lines.append(f"  mode: {e.mode.name} ({e.reason})")
    if e.mode.name != "NONE":  # which graphs: Inductor's compiled pieces or eager's kernels (jit's compile=)
        lines.append(f"  compile: {fn.options.compile_text(e.device)}")
        if e.uncompiled:
            lines.append(f"  uncompiled: {e.uncompiled}; this signature runs uncompiled graphs")
    lines.extend(avals_lines(e))
    lines.append(f"  read: {_inputs_text(e)}")
    for f in e.traced.mixing or ():  # ops the padded rows take part in (fgraph/padding/_mixing.py)
        lines.append(f"  padding visible: {f}")
    for f in e.traced.random:  # ops whose draws differ from eager's (fgraph/padding/_random.py)
        lines.append(f"  random: {f}")
    guards = e.sig.guards()
    if guards:  # the Python values this signature's trace baked in, checked on every call
        shown = ", ".join(f"{k}={v!r}" for k, v in guards[:8]) + (
            f", +{len(guards) - 8} more" if len(guards) > 8 else ""
        )
        lines.append(f"  guarded: {shown}")
    for name in e.traced.unguarded:  # Python values read but not guarded (the signature lists the guarded ones)
        lines.append(f"  not guarded: {name}")
    pieces = e.program.pieces
    lines.append(
        f"  pieces: {len(pieces)} ({sum(not p.is_break for p in pieces)} graph, "
        f"{sum(p.is_break for p in pieces)} break)"
    )
    for p in pieces:
        if p.is_break:
            level, why = p.support
            lines.append(f"  [{p.index}] break {op_summary(p.ops)}  support {level.name} ({why})")
            continue
        nxt = pieces[p.index + 1] if p.index + 1 < len(pieces) else None
        ends = f"break {nxt.ops[0]}" if nxt is not None else "output"
        lines.append(f"  [{p.index}] graph {len(p.ops)} ops: {op_summary(p.ops)}; ends at {ends}")
        lines.append(f"      in: {', '.join(p.inputs) or '-'}")
        lines.append(f"      out: {', '.join(p.outputs) or '-'}")
        c = e.compiled.get(p.name)
        if c is not None:  # Inductor (compile=...): the shared symbolic compilation, or one for this bucket's shapes
            how = c.how or "pending (at the first call)"
            lines.append(
                f"      compiled: {how}" + (f", shared by {c.shared.uses} uses" if c.how == "symbolic" else "")
            )
            made = kernels_made(c.module)
            if made:  # fgraph's own kernels in the piece (fgraph.config.small_m_*: fgraph/compile/_small_m.py)
                lines.append(f"      fgraph kernels: {made}")
    if e.graphs:
        lines.append(
            f"  captured: {len(e.graphs)} graph{'s' if len(e.graphs) != 1 else ''} in {e.capture_seconds:.3f} s "
            f"after {e.stats.warmups} eager warm-up run(s), pool {e.pool_bytes / 2**30:.3f} GiB"
        )
    else:
        lines.append("  captured: no graphs (runs the program eagerly)")
    return "\n".join(lines)


def _inputs_text(e) -> str:
    """How each input reaches the graphs.

    Per input: padded into the input buffers (batched), read in place or copied (what the graphs read by address:
    Slots in fgraph/capture/_slots.py), or read as passed (no graphs yet)."""
    if e.slots is not None:
        each = e.slots.describe()
    else:
        each = [f"{e.paths[i]}: read in place" for i in e.address_ix]
    back = {i for _, i in e.write_back}  # donated, written in place: copied back after each call
    each = [
        f"{e.paths[i]}: padded into input buffers{', written back' if i in back else ''}" for i in e.batched_ix
    ] + each
    groups: dict[str, list[str]] = {}  # how an input is read -> the inputs read so, in order
    for item in each:
        path, how = item.rsplit(": ", 1)
        groups.setdefault(how, []).append(path)
    return "; ".join(_listed(how, paths) for how, paths in groups.items()) or "-"


def _listed(how: str, paths: list[str], most: int = 6) -> str:
    if len(paths) <= most:
        return f"{how}: {', '.join(paths)}"
    return f"{how} ({len(paths)}): {', '.join(paths[:most])}, ..."


@boundary
def explain(fn, *args, **kwargs) -> Explanation:
    """A report per signature of how fgraph runs it.

    Per signature: requested -> effective mode and why, bucket, pieces (ops, inputs, outputs, the break ending each
    and its capture support), and after capture the time and pool bytes.

    explain(step) covers every signature seen so far; explain(step, *args, **kwargs) the signature of that call
    (traced on the spot, without capturing, if it is new).
    """
    if not isinstance(fn, Jitted):
        raise FgraphError(
            f"fgraph.explain: expected a function made by fgraph.jit, got {type(fn).__name__}",
            "wrap it first: fgraph.explain(fgraph.jit(f, ...), *args)",
        )
    if not args and not kwargs:
        entries = sorted(fn.entries.values(), key=lambda e: (repr(e.sig.statics), e.sig.bucket or 0))
        return Explanation(
            "\n".join(_entry_text(fn, e, None) for e in entries) or f"{fn.name}: no signatures yet", entries
        )
    call = fn.bind(args, kwargs)
    why = fn.state.ungraphed(call)
    if why is not None:  # no graph serves it: what the call does
        return Explanation(f"{fn.name}{call.sig.describe()}\n  runs eagerly: {why.what or 'an empty batch'}", [])
    e = fn.cache.probe(fn, call)  # trace only: explaining never captures
    return Explanation(_entry_text(fn, e, call.n), [e])
