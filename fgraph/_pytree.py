"""Pytrees through `torch.utils._pytree`: attrs classes and dataclasses join dict/list/tuple/NamedTuple/None.

Fields marked static (`fgraph.field(static=True)`, or `metadata={"static": True}` on a dataclass field) go
into the tree structure, so they are part of the signature and must be hashable.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from ._errors import FgraphError
from ._signature import static_key  # (by type and value: 1, 1.0 and True apart; 0.0 and -0.0 too)

KeyPath = tuple  # of torch.utils._pytree key entries
keystr = pytree.keystr


def _register_node(cls, flatten, unflatten, flatten_with_keys) -> None:
    """torch's pytree registration of one of fgraph's node classes (records, objects seen into), with key paths."""
    pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        flatten_with_keys_fn=flatten_with_keys,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
    )


def field(*, static: bool = False, **kwargs):
    """An attrs field; `static=True` puts its value in the treedef instead of the leaves."""
    if not isinstance(static, bool):
        raise FgraphError(f"fgraph.field(static={static!r}): static is a bool", "pass static=True or static=False")
    metadata = dict(kwargs.pop("metadata", {}) or {}, static=static)
    try:
        return attrs.field(metadata=metadata, **kwargs)
    except TypeError as e:  # an option attrs.field does not take
        raise FgraphError(f"fgraph.field: {e}", "fgraph.field takes static= and attrs.field's options") from None


def _fields(cls):
    fields = attrs.fields(cls) if attrs.has(cls) else dataclasses.fields(cls)
    return [(f.name, bool(f.metadata.get("static"))) for f in fields]


_RECORDS: dict[type, tuple[list[str], list[str]]] = {}  # registered record class -> (dynamic, static) fields


def register(cls: type) -> type:
    """Register an attrs class or dataclass as a pytree node (usable as a class decorator)."""
    if cls in pytree.SUPPORTED_NODES:
        return cls
    if not isinstance(cls, type) or not (attrs.has(cls) or dataclasses.is_dataclass(cls)):
        raise FgraphError(
            f"fgraph.register({cls!r}): expected an attrs class or a dataclass",
            "register the class (not an instance); other types: torch.utils._pytree.register_pytree_node",
        )
    names = _fields(cls)
    dynamic, static = [n for n, s in names if not s], [n for n, s in names if s]
    _RECORDS[cls] = (dynamic, static)

    def flatten(x):
        return [getattr(x, n) for n in dynamic], tuple(getattr(x, n) for n in static)

    def flatten_with_keys(x):
        return [(pytree.GetAttrKey(n), getattr(x, n)) for n in dynamic], tuple(getattr(x, n) for n in static)

    def unflatten(values, context):
        kw = dict(zip(dynamic, values)) | dict(zip(static, context))
        obj = object.__new__(cls)  # bypass __init__ validators/converters: values may be fx proxies or fakes
        for k, v in kw.items():
            object.__setattr__(obj, k, v)
        return obj

    _register_node(cls, flatten, unflatten, flatten_with_keys)
    return cls


_OBJECTS: set[type] = set()  # plain classes seen into as donated state (see_into)
_OPAQUE = (torch.Tensor, torch.nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType)


def _plain_object(x) -> bool:
    """An instance of a plain Python class pytrees do not know (no dataclass, attrs class, container or torch type)."""
    t = type(x)
    return (
        t not in pytree.SUPPORTED_NODES
        and isinstance(getattr(x, "__dict__", None), dict)
        and not isinstance(x, (*_OPAQUE, list, tuple, dict))
        and not _is_record(x)
        and t.__module__.split(".")[0] not in ("builtins", "torch", "fgraph", "functools")
    )


def see_into(tree: Any, depth: int = 8) -> None:
    """Register the plain classes of the objects in a donated argument (and nested in them) as pytree nodes.

    An object of such a class (transformers' StaticCache, its StaticLayers) is flattened into its attributes:
    tensors, containers and objects seen into are children (their tensors become donated state, read and written in
    place), every other attribute (ints, bools, None, strings, devices) is static, part of the signature."""
    if depth == 0:
        return
    if _plain_object(x := tree):
        if type(x) not in _OBJECTS:
            _register_object(type(x))
        children = list(vars(x).values())
    elif isinstance(x, dict):
        children = list(x.values())
    elif isinstance(x, (list, tuple)):
        children = list(x)
    elif type(x) in _OBJECTS:
        children = list(vars(x).values())
    else:
        return
    for c in children:
        see_into(c, depth - 1)


class _Held:
    """An unhashable static attribute, keyed by identity."""

    __slots__ = ("v",)

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return type(other) is _Held and other.v is self.v

    def __hash__(self):
        return id(self.v)

    def __repr__(self):
        return f"<{type(self.v).__name__} at {id(self.v):#x}>"


def _is_state(v) -> bool:
    return isinstance(v, (torch.Tensor, list, tuple, dict)) or type(v) in pytree.SUPPORTED_NODES


def _static(v):
    try:
        hash(v)
        return v
    except TypeError:
        return _Held(v)


_DYNAMIC = "_fgraph_dynamic"  # in an unflattened object: its children's names


def _dynamic_names(d: dict) -> list[str]:
    """The attributes that are children: state values, and those an object unflattened from leaves had as such."""
    kept = d.get(_DYNAMIC, ())  # (its leaves may be anything: torch's broadcasting unflattens zeros)
    return [k for k, v in d.items() if k != _DYNAMIC and (k in kept or _is_state(v))]


def _register_object(cls: type) -> None:
    def parts(x):
        d = vars(x)
        dyn = _dynamic_names(d)
        ctx = (tuple(dyn), tuple((k, _static(v)) for k, v in d.items() if k not in dyn and k != _DYNAMIC))
        return [d[k] for k in dyn], ctx, dyn

    def flatten(x):
        values, ctx, _ = parts(x)
        return values, ctx

    def flatten_with_keys(x):
        values, ctx, dyn = parts(x)
        return [(pytree.GetAttrKey(k), v) for k, v in zip(dyn, values)], ctx

    def unflatten(values, ctx):
        obj = object.__new__(cls)  # (no __init__: values may be fx proxies or fakes)
        d = vars(obj)
        d.update(zip(ctx[0], values))
        d.update((k, v.v if type(v) is _Held else v) for k, v in ctx[1])
        d[_DYNAMIC] = ctx[0]
        return obj

    _register_node(cls, flatten, unflatten, flatten_with_keys)
    _OBJECTS.add(cls)


def static_attrs(tree: Any, path: str = "") -> dict[str, Any]:
    """`path.attr -> value` for the static attributes of the objects seen into in `tree` (see_into)."""
    out = {}
    if type(tree) in _OBJECTS:
        dyn = _dynamic_names(vars(tree))
        for k, v in vars(tree).items():
            if k == _DYNAMIC:
                continue
            if k in dyn:
                out |= static_attrs(v, f"{path}.{k}")
            else:
                out[f"{path}.{k}"] = v
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out |= static_attrs(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out |= static_attrs(v, f"{path}[{i}]")
    return out


def is_seen_into(x) -> bool:
    """Whether `x` is an object of a plain class seen into (see_into)."""
    return type(x) in _OBJECTS


def _is_record(x) -> bool:
    return (attrs.has(type(x)) or dataclasses.is_dataclass(x)) and not isinstance(x, type)


def flatten_with_paths(tree: Any) -> tuple[list[tuple[KeyPath, Any]], pytree.TreeSpec]:
    """Flatten, registering attrs/dataclass types met on the way. Leaves come with their key paths."""
    while True:
        leaves, spec = pytree.tree_flatten(tree)
        new = {type(v) for v in leaves if _is_record(v)}
        if not new:
            paths = list(_key_paths((), tree))
            assert len(paths) == len(leaves)
            return list(zip(paths, leaves)), spec
        for cls in new:
            register(cls)


def _key_paths(path: KeyPath, x: Any):
    """Each leaf's key path, as torch's tree_flatten_with_path gives them, in tree_flatten's order.

    A node type registered without a flatten_with_keys_fn (`register_pytree_node(Node, flatten, unflatten)`, the
    common way) has its children keyed by index (`node[1]`), where torch raises a ValueError."""
    node = pytree.SUPPORTED_NODES.get(pytree._get_node_type(x))
    if node is None:
        yield path
    elif node.flatten_with_keys_fn is not None:
        for k, c in node.flatten_with_keys_fn(x)[0]:
            yield from _key_paths((*path, k), c)
    else:
        for i, c in enumerate(node.flatten_fn(x)[0]):
            yield from _key_paths((*path, pytree.SequenceKey(i)), c)


def tree_flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """pytree.tree_flatten, registering attrs/dataclass types met on the way.

    Outputs and a repeated function's values are records as much as arguments are (unregistered, one would be an
    opaque leaf hiding its tensors)."""
    leaves, spec = flatten_with_paths(tree)
    return [v for _, v in leaves], spec


def holds(tree: Any, leaves: list, spec: pytree.TreeSpec) -> bool:
    """Whether `tree` still holds these leaves (the same objects) in this structure (tree_flatten's result)."""
    now, now_spec = tree_flatten(tree)
    return now_spec == spec and len(now) == len(leaves) and all(a is b for a, b in zip(now, leaves))


def structure_key(spec: pytree.TreeSpec) -> tuple | None:
    """The dict keys and record static fields of a structure by type and value (static_key: TreeSpec compares them
    with ==, which merges 1, 1.0 and True), where any is not an int or a str (only then can == merge two); else
    None."""
    out, plain = [], True

    def visit(sp):
        nonlocal plain
        if sp.is_leaf():
            return
        if sp.type is dict or sp.type in _RECORDS:
            vals = tuple(sp.context)
            out.append(tuple(map(static_key, vals)))
            plain = plain and all(type(v) in (int, str) for v in vals)
        for c in _children(sp):
            visit(c)

    visit(spec)
    return None if plain else tuple(out)


def flattener(spec: pytree.TreeSpec):
    """A generated `tree -> its leaves` for one structure, or None when `tree` does not have it.

    The structure is what `spec` describes: node types and contexts (dict keys, attrs static fields, sequence
    lengths). torch's tree_flatten minus building a TreeSpec: the replay
    path flattens the batch argument on every call. Generated as straight-line Python per structure (one attribute
    or item read and one type check per node, no recursion), much cheaper than a recursive walk
    (docs/performance.md)."""
    env, lines, leaves = {"_nodes": pytree.SUPPORTED_NODES, "_tuple": tuple, "_typed": static_key}, [], []

    def const(v):
        env[f"c{len(env)}"] = v
        return f"c{len(env) - 1}"

    def emit(sp, var):
        if sp.is_leaf():  # a container (NamedTuples are tuples) where a leaf was: another structure
            lines.append(f"if type({var}) in _nodes or isinstance({var}, _tuple): return None")
            leaves.append(var)
            return
        typ, ctx, kids = sp.type, sp.context, _children(sp)
        names = [f"{var}_{i}" for i in range(len(kids))]
        if typ in _RECORDS:
            dynamic, static = _RECORDS[typ]
            lines.append(f"if type({var}) is not {const(typ)}: return None")
            if static:
                got = "".join(f"{var}.{n}, " for n in static)
                lines.append(f"if ({got}) != {const(ctx)}: return None")
                if not all(type(v) is str for v in ctx):  # (1, 1.0 and True are equal: by type and value too)
                    lines.append(f"if _typed(({got})) != {const(static_key(tuple(ctx)))}: return None")
            reads = [f"{var}.{n}" for n in dynamic]
        elif typ is dict:
            lines.append(f"if type({var}) is not dict or list({var}) != {const(list(ctx))}: return None")
            if not all(type(k) is str for k in ctx):  # (1, 1.0 and True are equal keys: by type and value too)
                lines.append(f"if _typed(_tuple({var})) != {const(static_key(tuple(ctx)))}: return None")
            reads = [f"{var}[{const(k)}]" for k in ctx]
        elif typ in (list, tuple) or pytree.is_namedtuple_class(typ):
            lines.append(f"if type({var}) is not {const(typ)} or len({var}) != {len(kids)}: return None")
            reads = [f"{var}[{i}]" for i in range(len(kids))]
        elif typ is type(None):
            lines.append(f"if {var} is not None: return None")
            reads = []
        else:  # another registered node type: torch's own flatten of it, checked like the rest
            walk = const(_walker(sp))
            lines.append(f"{var}_l = []")
            lines.append(f"if not {walk}({var}, {var}_l): return None")
            leaves.append(f"*{var}_l")
            return
        for n, r, k in zip(names, reads, kids):
            lines.append(f"{n} = {r}")
            emit(k, n)

    emit(spec, "x")
    src = "def flatten(x):\n" + "".join(f"  {ln}\n" for ln in lines) + f"  return [{', '.join(leaves)}]\n"
    exec(compile(src, f"<fgraph flattener {spec.type.__name__ if spec.type else 'leaf'}>", "exec"), env)
    return env["flatten"]


def _walker(spec):
    nodes = pytree.SUPPORTED_NODES
    if spec.is_leaf():

        def leaf(x, out):
            if type(x) in nodes or isinstance(x, tuple):  # a container (NamedTuples are tuples) where a leaf was
                return False
            out.append(x)
            return True

        return leaf
    typ, ctx, kids = spec.type, spec.context, [_walker(c) for c in _children(spec)]
    flatten = nodes[typ].flatten_fn

    def node(x, out):
        if pytree._get_node_type(x) is not typ:
            return False
        children, c = flatten(x)
        if len(children) != len(kids) or c != ctx:
            return False
        return all(k(ch, out) for k, ch in zip(kids, children))

    return node


def _children(spec):
    return spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs  # torch < 2.13


def unflattener(spec: pytree.TreeSpec):
    """`iterator of leaves -> tree` for a fixed structure: tree_unflatten without re-validating the spec."""
    if spec.is_leaf():
        return next
    unflatten, ctx = pytree.SUPPORTED_NODES[spec.type].unflatten_fn, spec.context
    kids = [unflattener(c) for c in _children(spec)]
    return lambda it: unflatten([k(it) for k in kids], ctx)


def check_static_fields(tree: Any, where: str) -> None:
    """Static fields must be hashable and must not hold tensors (a frozen tensor is a silent wrong answer)."""

    def visit(x, path):
        if type(x) in pytree.SUPPORTED_NODES and _is_record(x):
            for n, s in _fields(type(x)):
                v = getattr(x, n)
                if s:
                    if isinstance(v, torch.Tensor):
                        raise FgraphError(
                            f"{where}: {path}.{n} is a tensor in a static field",
                            "a static field is frozen into the signature; mark the field dynamic",
                        )
                    try:
                        hash(v)
                    except TypeError as e:
                        raise FgraphError(
                            f"{where}: static field {path}.{n} is unhashable ({type(v).__name__}: {e})",
                            "use a tuple or a frozen attrs class for static configuration",
                        ) from None
                else:
                    visit(v, f"{path}.{n}")
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(v, f"{path}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                visit(v, f"{path}[{i}]")

    visit(tree, where.split(": ")[-1] if ": " in where else "")
