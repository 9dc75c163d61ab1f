"""Research code as it is written: what a jitted callable is and the tensors it reads.

A callable is a function, a method, a module, a bound method, a function with positional-only parameters, *args or
**kwargs. The tensors it reads without taking them as arguments are module parameters and buffers, closed-over and
global tensors.

Those tensors are lifted into extra inputs of the traced function (torch.compile lifts constants the same way):
each call reads their current values and they become non-static leaves named by where they live (`self.lin.weight`,
`scale`), read in place like parameters. While tracing, fakes are swapped in where the real tensors live (module
reparametrization, closure cells, globals) and swapped back after.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import attrs
import torch
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module

from .._errors import FgraphError, SignatureError
from .._fx import user_code, user_module
from .._pytree import flatten_with_paths
from .._signature import Guard, path_str, torch_state
from ._places import MAX_GUARDS, Place, global_names, guardable, read, restore, write


class Inlined:
    """A callable that fgraph inlines when it is called while a trace runs (fgraph.Jitted).

    Its `fn` is traced as part of the caller's program, so the tensors `fn` reads are read by the caller too."""

    fn: object


def describe(fn) -> tuple[str, inspect.Signature]:
    """The name and call signature of what fgraph.jit was given (a module: its forward's)."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__, inspect.signature(fn.forward)
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) or type(fn).__name__
    try:
        return name, inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise SignatureError(
            f"fgraph.jit: cannot read the signature of {name} ({e})",
            "jit a Python function, method or nn.Module"
            + ("" if callable(fn) else "; options go by keyword: fgraph.jit(f, static=[...]) or @fgraph.jit(...)"),
        ) from None


def plain_signature(sig: inspect.Signature) -> bool:
    """Every parameter can be passed by name (what Jitted's replay path binds): no positional-only or *args."""
    return all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in sig.parameters.values())


@attrs.frozen(eq=False)
class LiftedModule:
    """A lifted module (its parameters and buffers are lifted leaves) and its name."""

    name: str
    module: torch.nn.Module


@attrs.frozen
class Origin:
    """Where a lifted leaf comes from: its index into modules + slots, and its key in its module (None for a slot)."""

    index: int
    key: str | None


class LazyParameters(Exception):
    """A lifted module holds parameters not made yet (torch's lazy modules make them in their first forward)."""

    def __init__(self, what: str, fix: str):
        super().__init__(what)
        self.what, self.fix = what, fix


class Lifted:
    """The tensors a callable reads without taking them as arguments.

    Where they live, found at jit time and again at the first call (globals a decorated function reads are often
    assigned after it), read per call (`values`), swapped for fakes while tracing (`installed`)."""

    def __init__(self, fn, params: set[str]):
        self.fn, self.params, self.rescanned = fn, params, False
        self.scan()
        self.names: dict[str, Origin] = {}  # lifted leaf name -> where it comes from, filled by values()
        # the lifted leaves that require grad, by name (values() reads them as data, detached; the trace gives them
        # their flag back: torch picks kernels by it, matmul folding a 3-D input into one GEMM where the weight
        # requires grad), and those whose flag is not their kind's default (a Parameter's True, any other tensor's
        # False): a signature entry, none in the common case
        self.grads, self.grad_names, self.flipped = False, frozenset(), Flipped()

    def scan(self):
        fn = self.fn
        self.modules: list[LiftedModule] = []  # their parameters and buffers
        self.slots: list[Place] = []  # tensors held by a cell, global, container item or attribute
        # Python values the trace bakes in (`SCALE = 2.0`, `self.temp`, `CFG["act"]`), where they live, as slots
        # are: each call's signature holds them (`context`), so a changed one is another signature
        self.guards: list[Place] = []
        self.unguarded: list[str] = []  # containers too large to guard value by value (explain lists them)
        self.objects: set[str] = set()  # of those, values of no guardable kind (Lifted._unguarded)
        # the containers walked into (CONFIG, a closure's list), where each lives, with the object found there and its
        # length: the places above hold the containers themselves, so a name rebound to a new one, or one grown or
        # shrunk, means a scan again (moved)
        self.containers: list[tuple[Place, object, int]] = []
        self.tree: list[tuple[torch.nn.Module, list]] = []  # each lifted module's submodules as scanned
        self._taken, self._seen = set(self.params), set()
        self._callable(fn)

    def _callable(self, fn):
        if isinstance(fn, torch.nn.Module):
            self._module("self", fn)
            self._function(type(fn).forward, 0)
        elif isinstance(fn, types.MethodType):
            self._holder("self", fn.__self__, getattr(fn.__func__, "__code__", None))
            self._function(fn.__func__, 0)
        elif isinstance(fn, functools.partial):  # partial(step, params): its positional arguments, by parameter name
            # (its keywords are defaults of its signature: arguments)
            names = _positional_names(fn.func)
            for i, a in enumerate(fn.args):
                self._value(names[i] if i < len(names) else f"args[{i}]", a, "parg", fn, i, 1)
            self._callable(fn.func)
        elif isinstance(fn, Inlined):  # a jitted function jitted again (a jitted method's too): what it reads
            if id(fn) not in self._seen:
                self._seen.add(id(fn))
                self._callable(fn.fn)
        elif not user_code(fn) and getattr(fn, "__wrapped__", None) is not None and id(fn) not in self._seen:
            # a library's wrapper (torch.func.grad, vmap, functools.wraps): what the wrapped callable reads
            self._seen.add(id(fn))
            self._callable(fn.__wrapped__)
        else:
            self._function(fn, 0)

    def __bool__(self):
        return bool(self.modules or self.slots or self.guards)

    def moved(self) -> bool:
        """Whether a container walked into is no longer where it was found (`CONFIG = {...}` rebound), or a lifted
        module's submodules are not the ones scanned (one replaced: its values are guarded anew)."""
        return any(read(p.kind, p.holder, p.key) is not v or len(v) != n for p, v, n in self.containers) or any(
            list(m.modules()) != subs for m, subs in self.tree
        )

    def reads_tensors(self) -> bool:
        """Whether it reads tensors (not only guarded Python values): what a backward through its outputs needs."""
        return bool(self.modules or self.slots)

    def roots(self) -> set[str]:
        """The names that donate= may give for lifted state (`self`: a module's buffers, updated in place)."""
        return {x.name.split(".")[0] for x in [*self.modules, *self.slots]}

    def _name(self, name: str) -> str:
        base, k = name, 2
        while name in self._taken:
            name, k = f"{base}#{k}", k + 1
        self._taken.add(name)
        return name

    def training(self) -> tuple[str, ...]:
        """The lifted modules in training mode, by name (a whole module as its name).

        Dropout and batch norm trace differently in training, and `model.eval()` after a call must not replay
        the training trace."""
        names = []
        for lm in self.modules:
            name, m = lm.name, lm.module
            flags = [sub.training for sub in m.modules()]
            if all(flags):
                names.append(name)
            elif any(flags):
                names.extend(f"{name}.{k}" for k, sub in m.named_modules() if sub.training)
        return tuple(names)

    def _module(self, name: str, m: torch.nn.Module, code=None):
        if id(m) in self._seen:
            return
        self._seen.add(id(m))
        name = self._name(name)
        self.modules.append(LiftedModule(name, m))
        self.tree.append((m, list(m.modules())))
        for sub_name, sub in m.named_modules():  # plain tensor attributes (neither parameter nor buffer)
            # and the Python values its forward names (`self.temp`): a name its code does not hold is not read
            # (every forward in its MRO: super().forward(x); the jitted method's own code for `self`)
            named = set()
            for c in type(sub).__mro__:
                f = vars(c).get("forward")
                if hasattr(f, "__code__"):
                    named.update(global_names(f.__code__))
            if code is not None and sub is m:
                named.update(global_names(code))
            inst = vars(sub)
            cls = [k for k in sorted(named - inst.keys()) if hasattr(type(sub), k)]  # class attributes read too
            for k in [*inst, *cls]:  # (`scale = 2.0` in the class body, an instance's own set later)
                v = inst[k] if k in inst else getattr(type(sub), k)
                at = f"{name}.{sub_name}.{k}" if sub_name else f"{name}.{k}"
                if isinstance(v, torch.Tensor):
                    if k in inst:
                        self.slots.append(Place(at, "attr", sub, k))
                elif k in named and k != "training" and not k.startswith("_"):
                    if guardable(v):
                        self.guards.append(Place(at, "attr", sub, k))
                    elif k in inst and isinstance(v, (dict, list)):  # `self.perm = [2, 0, 1]`: item by item
                        self._value(at, v, "attr", sub, k, 1)

    def _holder(self, name: str, obj, code=None):
        """`self` of a bound method: a module, or an object whose tensor / module attributes the method reads."""
        if isinstance(obj, torch.nn.Module):
            self._module(name, obj, code)
            return
        inst = getattr(obj, "__dict__", {})
        if code is not None and not isinstance(obj, type):
            # class attributes its method reads (`scale = 2.0` in the class body), read through the instance: a
            # change to the class's, or an instance's own set later, is another signature (as a module's are)
            names = set(global_names(code)) - set(inst)
            self._attributes(name, obj, type(obj), {k for k in names if hasattr(type(obj), k) and k[0] != "_"})
        if id(obj) in self._seen:  # scanned already: a bound method of it among its attributes (`self.cb = self.g`,
            return  # a classmethod's class holding that classmethod)
        self._seen.add(id(obj))
        slots = [k for c in type(obj).__mro__ for k in getattr(c, "__slots__", ()) if hasattr(obj, k)]
        for k in [*inst, *slots]:
            self._value(f"{name}.{k}", getattr(obj, k), "attr", obj, k, 1)

    def _value(self, name, v, kind, holder, key, depth):
        if isinstance(v, torch.Tensor):
            self.slots.append(Place(self._name(name), kind, holder, key))
        elif isinstance(v, torch.nn.Module):
            self._module(name, v)
        elif isinstance(v, Inlined):  # called while this traces, it is inlined: what it reads is read here
            self._value(name, v.fn, kind, holder, key, depth)
        elif isinstance(v, types.MethodType) and user_code(v.__func__):
            self._holder(name, v.__self__, getattr(v.__func__, "__code__", None))
            self._function(v.__func__, depth + 1)
        elif isinstance(v, types.FunctionType) and user_code(v):
            # the function itself (`helper = other`, `OPS["act"] = lambda ...`): by identity, and what it reads
            self.guards.append(Place(name, kind, holder, key))
            self._function(v, depth + 1)
        elif isinstance(v, functools.partial) and user_code(v.func):
            self.guards.append(Place(name, kind, holder, key))
            for i, a in enumerate(v.args):
                self._value(f"{name}.args[{i}]", a, "parg", v, i, depth + 1)
            self._value(f"{name}.func", v.func, "attr", v, "func", depth)
        elif guardable(v):
            self.guards.append(Place(name, kind, holder, key))
        elif isinstance(v, (dict, list)) and depth <= 3 and len(v) <= 4096:  # CONFIG["w"]: swapped in the container
            self.containers.append((Place(name, kind, holder, key), v, len(v)))
            self.guards.append(Place(f"len({name})", "len", v, None))  # an item appended, popped or a key added
            items = list(v.items() if isinstance(v, dict) else enumerate(v))
            plain = [(k, x) for k, x in items if guardable(x)]
            if len(plain) > MAX_GUARDS:
                self.unguarded.append(name)
            for k, x in items:
                if isinstance(
                    x, (torch.Tensor, torch.nn.Module, dict, list, types.FunctionType, functools.partial)
                ) or (len(plain) <= MAX_GUARDS and guardable(x)):
                    self._value(f"{name}[{k!r}]", x, "item", v, k, depth + 1)
                elif not guardable(x):
                    self._unguarded(f"{name}[{k!r}]", x)
        else:
            self._unguarded(name, v)

    def _unguarded(self, name, v):
        """A value the trace may bake in that no guard compares (an object, a set, a long tuple, a numpy scalar, a
        container past the scan's depth): listed by explain, refused under strict."""
        if v is None or isinstance(v, (types.ModuleType, type, torch.nn.Module, torch.Tensor)) or callable(v):
            return  # (modules such as `torch` and `F`, classes, functions and other callables: code, not values)
        if name not in self.unguarded:
            self.unguarded.append(name)
            self.objects.add(name)

    def _function(self, fn, depth: int):
        if not isinstance(fn, types.FunctionType) or id(fn) in self._seen or depth > 3:
            return
        self._seen.add(id(fn))
        code = fn.__code__
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                v = cell.cell_contents
            except ValueError:  # not yet assigned
                continue
            self._value(var, v, "cell", cell, None, depth)
        g, names = fn.__globals__, global_names(code)
        for var in names:
            if var in g:
                self._value(var, g[var], "global", g, var, depth)
            if isinstance(g.get(var), types.ModuleType) and user_module(g[var]):  # `cfg.SCALE` of the user's `cfg`
                self._attributes(var, g[var], g[var], set(names) & set(vars(g[var])))

    def _attributes(self, name: str, obj, owner, keys: set) -> None:
        """Guard each of `keys` (attribute names the code reads) whose value on `owner` is guardable, read through
        `obj`: a class's attributes through an instance (an instance's own set later shadows them), a module's."""
        for k in sorted(keys):
            at = f"{name}.{k}"
            if guardable(getattr(owner, k)) and (at, id(obj)) not in self._seen:
                self._seen.add((at, id(obj)))
                self.guards.append(Place(at, "attr", obj, k))

    # -- per call ----------------------------------------------------------------------------------------------
    def values(self) -> dict[str, torch.Tensor]:
        """The lifted tensors as they are now, by leaf name (a module's: `self.layers.0.weight`).

        `grads` says afterwards whether any of them requires grad (they are read as data: see refuse_backward)."""
        out, self.names, grads, flipped = {}, {}, [], []

        def take(leaf: str, v: torch.Tensor, origin: Origin) -> None:
            # read as data (same storage): a jitted call is inference, its outputs carry no autograd history
            out[leaf] = v.detach() if v.requires_grad else v
            self.names[leaf] = origin
            if v.requires_grad:
                grads.append(leaf)
            if v.requires_grad is not isinstance(v, torch.nn.Parameter):  # (a frozen weight, a buffer that does)
                flipped.append(leaf)

        for i, lm in enumerate(self.modules):
            name, m = lm.name, lm.module
            for k, v in [*m.named_parameters(), *m.named_buffers()]:
                if torch.nn.parameter.is_lazy(v):  # nn.LazyLinear before its first forward: no shape to trace
                    raise LazyParameters(
                        f"`{name}.{k}` is a lazy module's parameter, made by its first forward: this call runs "
                        "eagerly, later ones are traced",
                        "run the module once before jitting it to trace its first call as well",
                    )
                take(f"{name}.{k}", v, Origin(i, k))
        for i, p in enumerate(self.slots, len(self.modules)):
            v = read(p.kind, p.holder, p.key)
            if isinstance(v, torch.Tensor):
                take(p.name, v, Origin(i, None))
        self.grads, self.grad_names, self.flipped = bool(grads), frozenset(grads), Flipped(flipped)
        return out

    @contextlib.contextmanager
    def installed(self, values: dict[str, torch.Tensor]):
        """Swap `values` (fakes, while tracing) in where the lifted tensors live; swap the originals back after."""
        with contextlib.ExitStack() as stack:
            for i, lm in enumerate(self.modules):
                mine = {o.key: values[leaf] for leaf, o in self.names.items() if o.index == i and leaf in values}
                stack.enter_context(_reparametrize_module(lm.module, mine, tie_weights=True))
            for i, p in enumerate(self.slots, len(self.modules)):
                o = self.names.get(p.name)
                if p.name in values and o is not None and o.index == i:
                    old = read(p.kind, p.holder, p.key)
                    write(p.kind, p.holder, p.key, values[p.name])
                    stack.callback(restore, p.kind, p.holder, p.key, values[p.name], old)
            yield


def _positional_names(fn) -> list[str]:
    try:
        ps = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def guard_values(lifted: Lifted) -> tuple:
    """The guarded Python values as they are now, as signature entries (`Guard`: by type and value)."""
    return tuple(Guard(g.name, read(g.kind, g.holder, g.key)) for g in lifted.guards)


def invoke(jitted, dynamic: dict, statics: dict, install: bool = True):
    """Call the jitted callable with its arguments by name and its lifted tensors installed.

    Positional-only parameters, *args and **kwargs are spread back; the lifted tensors come from `dynamic` (the leaves
    named in Lifted.values). install=False: they are left where they live (a call run eagerly: the plain function
    on the module's own Parameters, not on their detached values, which pick other kernels)."""
    lifted = jitted.lifted
    swap = {k: dynamic[k] for k in lifted.names if k in dynamic} if lifted else {}
    merged = {**{k: v for k, v in dynamic.items() if k not in swap}, **statics}
    # required parameters by position (torch.func.grad's argnums count them), those with defaults by keyword: a
    # decorator that fills in a keyword the caller left out (transformers' `use_cache`) must not find it passed
    # by position as well
    args, kwargs = [], {}
    params = jitted.signature.parameters.values()
    spread = any(p.kind is p.VAR_POSITIONAL for p in params)  # then what comes before it goes by position
    for p in params:
        if p.name not in merged:
            continue
        v = merged[p.name]
        positional = p.kind is p.POSITIONAL_OR_KEYWORD and (spread or p.default is p.empty) and not kwargs
        if p.kind is p.POSITIONAL_ONLY or positional:
            args.append(v)
        elif p.kind is p.VAR_POSITIONAL:
            args.extend(v)
        elif p.kind is p.VAR_KEYWORD:
            kwargs.update(v)
        else:
            kwargs[p.name] = v
    with lifted.installed(swap) if swap and install else contextlib.nullcontext():
        return jitted.fn(*args, **kwargs)


def check_call(fname: str, lifted: Lifted, statics: dict, dynamic: dict) -> dict:
    """The slow path's checks of a call.

    A tensor passed as a static, gradients wanted through it; returns the dynamic arguments plus the lifted tensors'
    current values."""
    for k, v in statics.items():
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(v)):
            raise SignatureError(
                f"fgraph.jit({fname}): static argument {k!r} is (or holds) a tensor; a static is frozen into "
                "the signature by value, which a tensor does not have",
                f"remove {k!r} from static= (tensors are inputs), or pass a Python value (int(t), tuple(t.tolist()))",
            )
    if torch.is_grad_enabled():
        for path, x in flatten_with_paths(dynamic)[0]:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                raise FgraphError(
                    f"fgraph.jit({fname}): {path_str(path)} requires grad and grad mode is on, but a "
                    "jitted call is inference only: its outputs live in graph memory and carry no autograd history",
                    "call it under torch.no_grad() or torch.inference_mode(), pass x.detach(), or train with the "
                    "plain function (fgraph.disable_jit())",
                )
    if not lifted.rescanned or lifted.moved():  # the first call: what the function reads now (globals assigned
        lifted.rescanned = True  # after the decorator); a container rebound or a submodule replaced since: anew
        lifted.scan()
    return {**dynamic, **lifted.values()} if lifted else dynamic


def context(lifted: Lifted) -> tuple:
    """A call's signature entries for what its trace depends on beyond the arguments.

    torch's global settings when not at torch's defaults (autocast, default dtype, matmul precision), the lifted
    modules in training mode and the lifted tensors whose requires_grad is not their kind's default (as values()
    read them: the trace picks kernels by it)."""
    state, training = torch_state(), lifted.training() if lifted else ()
    guards = guard_values(lifted) if lifted else ()
    flipped = lifted.flipped if lifted else ()
    return (
        ((("<torch>", state),) if state else ())
        + ((("<training>", training),) if training else ())
        + ((("<requires_grad>", flipped),) if flipped else ())
        + guards
    )


class Flipped(frozenset):
    """Lifted leaves whose requires_grad is not their kind's default (a frozen Parameter, a buffer that requires
    grad), by name: a signature entry, shown by name (by count past three: a frozen model's every weight)."""

    def __repr__(self) -> str:
        return f"<not default: {', '.join(sorted(self))}>" if len(self) <= 3 else f"<not default: {len(self)} tensors>"
