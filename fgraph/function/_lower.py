"""What a JAX user inspects: a signature's input and output avals, and its traced program as code.

`jax.jit(f).lower(*args).as_text()` is the model."""

from __future__ import annotations

import keyword
import re

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .._pytree import flatten_with_paths


def _aval(t, traced, bucket) -> str:
    """dtype[dims]: a traced (fake) tensor's shape at `bucket` (its symbolic batch dims evaluated there)."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__ if t is not None else "None"
    size = (lambda d: d) if traced.shapes is None or bucket is None else (lambda d: traced.shapes.size(d, bucket))
    return f"{str(t.dtype).removeprefix('torch.')}{[size(d) for d in t.shape]}"


def output_paths(traced) -> list[str]:
    """The key path of each traced output in what the function returns (`[0]`, `[1].k`), by position."""
    n = len(traced.outs)
    try:
        recipe = getattr(traced, "out_recipe", None)
        if recipe is not None:  # folded arguments handed back whole: name the outputs by position
            raise ValueError
        tree = pytree.tree_unflatten(list(range(n)), traced.out_spec)
        paths = {i: "out" + pytree.keystr(p) for p, i in flatten_with_paths(tree)[0]}
        return [paths.get(j, f"out[{j}]") for j in range(n)]
    except Exception:
        return [f"out[{j}]" for j in range(n)]


def avals_lines(e, limit: int = 24) -> list[str]:
    """explain's `inputs:` and `outputs:` lines of one entry: key path: dtype[shape] (batched at the bucket)."""
    ins = [f"{e.paths[i]}: {leaf}" for i, leaf in enumerate(e.sig.leaves)]
    batched = set(e.batched_ix)
    ins = [s + (" (Batched)" if i in batched else "") for i, s in enumerate(ins)]
    outs = [f"{p}: {_aval(v, e.traced, e.sig.bucket)}" for p, v in zip(output_paths(e.traced), e.traced.outs)]

    def block(title, items):
        more = [f"    ... and {len(items) - limit} more"] if len(items) > limit else []
        return [f"  {title}: {len(items)}", *(f"    {s}" for s in items[:limit]), *more]

    return block("inputs", ins) + block("outputs", outs)


def _ident(path: str, taken: set) -> str:
    """A Python identifier for a key path: `params['w1']` -> params_w1."""
    name = re.sub(r"\W+", "_", path).strip("_") or "arg"
    if name[0].isdigit() or keyword.iskeyword(name):
        name = "_" + name
    base, k = name, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


class Lowered:
    """One signature's traced program, before capture.

    `.as_text()` is its FX code with the inputs named by key path, `.avals()` its input and output avals,
    `.graph_module` the program itself (a copy)."""

    def __init__(self, jitted, entry):
        self.jitted, self.entry = jitted, entry
        gm, traced = entry.traced.gm, entry.traced
        graph = fx.Graph()
        env, taken = {}, set()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        taken.add("self")
        names = {ph: _ident(traced.paths[i], taken) for ph, i in zip(placeholders, traced.tensor_ix)}
        for node in gm.graph.nodes:
            env[node] = new = graph.node_copy(node, lambda n: env[n])
            if node in names:
                new.name = new.target = names[node]
        self.graph_module = fx.GraphModule(gm, graph, class_name=jitted.name)

    def as_text(self) -> str:
        """The program as Python: one aten op per line, inputs named by key path (`x`, `params_w1`)."""
        e = self.entry
        head = f"# fgraph.jit({self.jitted.name}) signature {e.sig.describe()}, mode {e.mode.name}\n"
        return head + "\n".join(f"# {s.strip()}" for s in avals_lines(e, limit=10**9)) + "\n" + self.graph_module.code

    def avals(self) -> str:
        return "\n".join(avals_lines(self.entry, limit=10**9))

    def __str__(self):
        return self.as_text()


def lower(jitted, *args, **kwargs) -> Lowered:
    """Jitted.lower: the signature of this call, traced now if new (never captured)."""
    e = jitted.cache.probe(jitted, jitted.cache.for_grad_mode(jitted.bind(args, kwargs)))
    return Lowered(jitted, e)
