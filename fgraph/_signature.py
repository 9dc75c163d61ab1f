"""Signatures, and the batch padding that maps a call with N tokens onto its bucket.

A signature is what one trace and one graph set are specialised to: static values (by type and value) × bucket × tree
structure × (shape, dtype, device) of every leaf, where batched leaves are counted at their padded size, so every N
in a bucket shares one signature, and the others by their strides too where they are not contiguous (a trace can
depend on them).
"""

from __future__ import annotations

import bisect
import functools
import inspect
import numbers
from typing import Any, NamedTuple

import attrs
import numpy as np
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from ._errors import EscapeError, SignatureError


@attrs.frozen
class Batched:
    """Marks a leaf whose `axis` carries the token (batch) axis. It is padded to bucket + `extra` along it.

    pad: a scalar fill value; "ramp" for offset arrays (a [S+1] array of segment starts): each padded row
    continues the last value by one, clamped at the bucket, so offsets stay monotonic and end at the padded
    total (the padding check takes the last real offset for the call's rows of the axis they index); or a
    callable (tensor, size) -> tensor of `size` along `axis` for any other rule.
    Outputs are cut back to the unpadded call's shape along every dim whose traced size is a batch size (from a
    bucket-1 trace, which has no symbols: a first dim of the bucket). Leaves the function uses as one batch must
    agree on their size; the non-batch dims are part of the signature. Ops that combine rows along the axis
    (sums, softmax, sort, ...) see the padded rows: fgraph logs them at trace time unless `mixes=True`.
    """

    axis: int = 0
    pad: Any = 0
    extra: int = 0
    # the function combines rows along this axis on purpose (padded rows masked by the function itself): fgraph
    # does not log the reductions, softmaxes, ... along it that it otherwise reports (fgraph/padding/_mixing.py)
    mixes: bool = False
    # whether the pad rows depend only on the call's length (a fill value), not on the data ("ramp", callables)
    fixed_tail: bool = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        if type(self.axis) is not int or self.axis < 0 or type(self.extra) is not int or self.extra < 0:
            raise SignatureError(
                f"Batched(axis={self.axis!r}, extra={self.extra!r}): both must be non-negative ints",
                "count the batch axis from the front (one Batched may cover leaves of different ranks), e.g. "
                "Batched(axis=1) for [H, N, D] leaves",
            )
        ramp = isinstance(self.pad, str) and self.pad == "ramp"
        if not (callable(self.pad) or ramp or isinstance(self.pad, numbers.Number)):
            raise SignatureError(
                f'Batched(pad={self.pad!r}): pad must be a number (the fill value), "ramp" or a callable '
                "(tensor, size) -> tensor",
                "Batched(pad=0) fills padded rows with zeros; see fgraph.Batched's docstring for the other two",
            )
        if not isinstance(self.mixes, bool):
            raise SignatureError(
                f"Batched(mixes={self.mixes!r}): mixes is a bool",
                "Batched(mixes=True) says the function combines rows along the axis on purpose",
            )
        if callable(self.pad) and not takes(self.pad, 2):
            raise SignatureError(
                f"Batched(pad={self.pad!r}): a pad callable is called as pad(tensor, size), which it cannot take",
                "give a callable of two arguments returning the tensor padded to `size` along the axis",
            )
        object.__setattr__(self, "fixed_tail", not callable(self.pad) and not ramp)

    def padded(self, x: torch.Tensor, size: int) -> torch.Tensor:
        if x.shape[self.axis] == size:
            return x
        shape = list(x.shape)
        shape[self.axis] = size
        out = x.new_empty(shape)
        self.pad_into(x, out)
        return out

    def pad_into(self, x: torch.Tensor, dst: torch.Tensor) -> None:
        """Write x padded into dst (its padded shape)."""
        have, size = x.shape[self.axis], dst.shape[self.axis]
        if have == size:
            dst.copy_(x)
        elif callable(self.pad):
            got = self.pad(x, size)
            if isinstance(got, torch.Tensor) and got.shape != dst.shape:
                raise SignatureError(
                    f"Batched(pad={getattr(self.pad, '__qualname__', self.pad)}) returned shape {list(got.shape)} "
                    f"for {size} rows along axis {self.axis}, not the padded leaf's shape {list(dst.shape)}",
                    "return the whole leaf padded: its rows, then the padded ones (size rows along the axis)",
                )
            dst.copy_(got)
        else:
            dst.narrow(self.axis, 0, have).copy_(x)
            tail = dst.narrow(self.axis, have, size - have)
            if self.pad == "ramp":
                last = x.narrow(self.axis, have - 1, 1) if have else x.new_zeros(1)
                steps = torch.arange(1, size - have + 1, dtype=x.dtype, device=x.device)
                tail.copy_(torch.clamp(last + steps, max=size - self.extra))
            else:
                tail.fill_(self.pad)

    def pad_into_numpy(self, x, dst, tail_valid: bool) -> bool:
        """pad_into through numpy views (the replay path: a few small rows cost far less than torch ops).

        With tail_valid, the pad rows already in dst are right for this length and only scalar pads may skip
        them. Returns whether dst's pad rows stay valid for a next call of the same length ("ramp" depends on
        data)."""
        have = x.shape[self.axis]
        if self.axis:  # a view with the batch axis first: the slicing below is then plain (and cheapest)
            dst, x = np.moveaxis(dst, self.axis, 0), np.moveaxis(x, self.axis, 0)
        dst[:have] = x
        if not self.fixed_tail:  # "ramp" offsets: continue the last one by one per padded row, up to the bucket
            size = dst.shape[0]
            last = int(dst[have - 1]) if have else 0
            dst[have:] = np.minimum(np.arange(last + 1, last + 1 + size - have), size - self.extra)
            return False
        if not tail_valid:
            dst[have:] = self.pad
        return True  # (callable pads never come here: they take the torch path)

    def padded_shape(self, x: torch.Tensor, bucket: int) -> tuple[int, ...]:
        shape = list(x.shape)
        shape[self.axis] = bucket + self.extra
        return tuple(shape)

    def family_shape(self, shape: tuple[int, ...]) -> tuple[int | None, ...]:
        """The shape traces are shared over: the batch axis None, every other dim part of it."""
        return tuple(None if d == self.axis else s for d, s in enumerate(shape))

    def real(self, x: torch.Tensor) -> int:
        return x.shape[self.axis] - self.extra


def takes(fn, n: int) -> bool:
    """Whether `fn` can be called with n positional arguments (a user's hook, checked where it is given)."""
    try:
        inspect.signature(fn).bind(*[None] * n)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): taken as it is
        pass
    return True


@functools.lru_cache(maxsize=256)
def _holds(dtype: torch.dtype, pad) -> bool:
    """Whether a leaf of `dtype` holds the fill value as given (nan, 1e30 or 0.5 in an int64 leaf does not)."""
    try:
        v = torch.full((), pad, dtype=dtype, device="cpu").item()
    except (RuntimeError, TypeError, ValueError, OverflowError):
        return False
    return dtype.is_floating_point or dtype.is_complex or v == pad


def default_buckets(max_size: int = 512) -> tuple[int, ...]:
    """vLLM's capture sizes: 1, 2, 4, multiples of 8 up to 256, then multiples of 16 up to 512."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
    return tuple(s for s in sizes if s <= max_size)


def bucket_for(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest bucket >= n, or None when n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class Aval(NamedTuple):
    """An abstract value (JAX's aval): a tensor's (shape, dtype, device), or a Python value (by value).

    Of a leaf (leaf_of: what signatures are made of), or of a tensor in a trace (aval_of: what plan hooks see)."""

    shape: tuple[int | None, ...] | None  # None: a Python value; a None dim: symbolic in a trace
    dtype: torch.dtype | type | None  # a Python value's type
    device: str | None  # str(tensor.device): "cpu", "cuda:0"; a Python float's hex
    value: Any = None
    strides: tuple[int, ...] | None = None  # a leaf's strides where it is not contiguous (see leaf_of)

    def __str__(self):
        if self.shape is None:
            return f"{type(self.value).__name__}={self.value!r}"
        strides = f" strides {list(self.strides)}" if self.strides is not None else ""
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}@{self.device}{strides}"


def leaf_of(x: Any, spec: Batched | None = None, bucket: int | None = None) -> Aval:
    """A leaf's abstract value; a batched leaf counts at its padded shape (its device is where it came from).

    A leaf without the batch axis is traced and read in its own layout, and strides change what a trace records
    (reshape is a view of a contiguous tensor, a copy of a transposed one): a non-contiguous one is keyed by its
    strides. Batched leaves are padded into contiguous buffers, so theirs never matter."""
    if isinstance(x, torch.Tensor):
        if spec is not None:
            shape = spec.padded_shape(x, bucket) if bucket is not None else tuple(x.shape)
            return Aval(shape, x.dtype, str(x.device))
        return Aval(tuple(x.shape), x.dtype, str(x.device), None, None if x.is_contiguous() else x.stride())
    # by value and type: 2, 2.0 and True are equal in Python but trace to int64, float32 and bool results; a
    # float's hex tells 0.0 from -0.0 (1 / (x * s) is +inf or -inf); every nan is one object (nan != nan, and its
    # hash is its id: each new nan would be a new signature)
    if type(x) is float:
        return Aval(None, float, x.hex(), _NAN if x != x else x)
    return Aval(None, type(x), None, x)


_NAN = float("nan")


def aval_of(t: torch.Tensor) -> Aval:
    """A traced (fake) tensor's abstract value: its symbolic (batch) dims are None, the others ints."""
    return Aval(tuple(None if isinstance(d, torch.SymInt) else d for d in t.shape), t.dtype, str(t.device))


class TorchState(NamedTuple):
    """Torch's global settings that a trace, or the kernels its graphs captured, depend on.

    The ones torch.compile guards too: the default dtype (`torch.zeros(3)`), the autocast contexts in force (the
    dtype of every matmul under them), and float32 matmul precision (TF32 kernels or not); and inference mode: a
    capture under it makes fgraph's buffers inference tensors, which no call outside it may write in place, and one
    outside it cannot write the inference tensors a caller made under it, so each mode captures its own."""

    default_dtype: torch.dtype
    autocast: tuple  # (device type, dtype) of each autocast context in force
    matmul_precision: str
    inference_mode: bool = False

    def __repr__(self) -> str:  # what differs from torch's defaults, as explain shows a signature
        parts = [f"autocast({d}, {str(t).removeprefix('torch.')})" for d, t in self.autocast]
        if self.default_dtype is not torch.float32:
            parts.append(f"default dtype {str(self.default_dtype).removeprefix('torch.')}")
        if self.matmul_precision != "highest":
            parts.append(f"matmul precision {self.matmul_precision}")
        if self.inference_mode:
            parts.append("inference mode")
        return "[" + ", ".join(parts) + "]"


def torch_state() -> TorchState | None:
    """The settings in force, or None at torch's defaults (the usual case: signatures then do not show them).

    On every call's fast path: three reads at the defaults, the tuple only when one differs."""
    dtype, precision = torch.get_default_dtype(), torch.get_float32_matmul_precision()
    inference = torch.is_inference_mode_enabled()
    if dtype is torch.float32 and precision == "highest" and not inference and not _any_autocast():
        return None
    autocast = tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))
    return TorchState(dtype, autocast, precision, inference)


def _any_autocast() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", _any_autocast)  # one C call where torch has it


def static_key(v: Any) -> Any:
    """What a static value is keyed by: its type and value; a float by its hex, a tuple's items each so."""
    t = type(v)
    if t is float:  # 0.0 and -0.0 apart (1 / (x * s) is +inf or -inf), a nan equal to a nan
        return t, v.hex()
    return (t, tuple(map(static_key, v))) if issubclass(t, tuple) else (t, v)


class Static(tuple):
    """A static argument in a signature: the pair (name, value), keyed by the value's type as well as by it.

    jax.jit's rule: 1, True and 1.0 are equal in Python and hash alike, but trace to int64, bool and float32 results,
    so each is a signature of its own. Where fgraph goes further (static_key): floats by their hex, as non-static
    Python scalars are (0.0 and -0.0 apart, nan equal to nan), and a tuple's items each by type and value ((1, 2)
    and (True, 2) apart, where jax compares the tuples by ==); other values by their type and their own == (a frozen
    attrs class compares its fields so). Still a (name, value) pair: `dict(sig.statics)["routine"]` is the value as
    passed."""

    __slots__ = ()

    def __new__(cls, name: str, value: Any):
        return tuple.__new__(cls, (name, value))

    def __getnewargs__(self):
        return tuple(self)

    def __eq__(self, other):
        if not isinstance(other, tuple) or len(other) != 2:
            return NotImplemented
        return self[0] == other[0] and static_key(self[1]) == static_key(other[1])

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash((self[0], static_key(self[1])))


class Guard(Static):
    """A guarded Python value the trace read (`SCALE`, `self.temp`), as a signature entry: compared as a Static is,
    listed by explain on a line of its own rather than in the signature's one-line description."""

    __slots__ = ()


class Signature(NamedTuple):
    statics: tuple[tuple[str, Any], ...]  # Static pairs by name, then what the trace depends on (trace.context)
    bucket: int | None
    treespec: pytree.TreeSpec
    leaves: tuple[Aval, ...]

    def guards(self, guarded: bool = True) -> list:
        """The entries that are guarded Python values (`Guard`), or (False) every other one."""
        return [kv for kv in self.statics if isinstance(kv, Guard) is guarded]

    def describe(self) -> str:
        st = ", ".join(f"{k}={v!r}" for k, v in self.guards(False))
        return f"({st}{', ' if st else ''}bucket={self.bucket})"


class Call(NamedTuple):
    """One call, flattened, with its bucket found: everything dispatch needs.

    Batched leaves stay unpadded: the entry pads them into its input buffers."""

    sig: Signature
    statics: dict[str, Any]
    paths: list  # key path per leaf
    leaves: list  # leaves as passed (batched ones unpadded: the entry pads them into its buffers)
    specs: list  # Batched | None per leaf
    n: int | None  # real tokens
    bound: dict  # argument name -> value, as passed

    def padding_only(self, bucket: int) -> Call:
        """An all-padding call for `bucket`: each batched leaf cut to its `extra` rows (the entry pads it)."""
        specs = self.specs
        leaves = [x if s is None else x.narrow(s.axis, 0, s.extra) for x, s in zip(self.leaves, specs)]
        sig = self.sig._replace(bucket=bucket, leaves=tuple(leaf_of(x, s, bucket) for x, s in zip(leaves, specs)))
        return self._replace(sig=sig, leaves=leaves, n=0)


def path_str(path) -> str:
    """`state.k[3]` for the key path (MappingKey('state'), GetAttrKey('k'), SequenceKey(3))."""
    if not path:
        return "<root>"
    head, rest = path[0], path[1:]
    name = head.key if isinstance(head, pytree.MappingKey) else pytree.keystr((head,))
    return f"{name}{pytree.keystr(rest)}"


def check_leaves(fname: str, flat: list) -> None:
    """Check that a call's leaves are what a signature can be made of.

    Dense tensors (graphs read them by address and strides), and Python values, which are keyed by value, so
    hashable."""
    for p, x in flat:
        if isinstance(x, torch.Tensor):
            if isinstance(x, FakeTensor):  # the first use of a value that escaped a trace
                raise EscapeError(
                    f"fgraph.jit({fname}): {path_str(p)} is a fake tensor (shape {list(x.shape)}, "
                    f"{str(x.dtype).removeprefix('torch.')}, no data): a value that escaped an earlier trace, stored "
                    "outside the jitted function that made it",
                    "return the value from the jitted function that made it and pass it in (jitted functions are "
                    "pure, as under jax.jit); that function's trace raises EscapeError naming where it stored the "
                    "value, where its scan reaches it",
                )
            if x.layout is not torch.strided:
                raise SignatureError(
                    f"fgraph.jit({fname}): {path_str(p)} is a {str(x.layout).removeprefix('torch.')} tensor; fgraph "
                    "traces and captures dense (strided) tensors",
                    f"pass {path_str(p)}.to_dense()",
                )
        elif type(x).__hash__ is None:  # (tensors hash by identity)
            raise SignatureError(
                f"fgraph.jit({fname}): {path_str(p)}={x!r} is unhashable ({type(x).__name__}), and a "
                "Python value that is not a tensor is part of the signature",
                "pass a hashable value (ints or a tuple instead of a slice or a list), or a tensor",
            )


def batch_specs(
    fname: str, batch: dict[str, Any], dynamic: dict[str, Any], treespec: pytree.TreeSpec, leaves: list
) -> list[Batched | None]:
    """Broadcast the user's per-argument prefix trees of `Batched` onto the flat leaves of the call.

    A None leaf is an absent input (an optional mask), as an empty subtree under jax.jit: no batch axis, whatever is
    declared."""
    full = {k: batch.get(k) for k in dynamic}
    flat = pytree._broadcast_to_and_flatten(full, treespec, is_leaf=lambda x: isinstance(x, Batched) or x is None)
    if flat is None:
        raise SignatureError(
            f"fgraph.jit({fname}): batch= {batch!r} is not a prefix of the arguments' structure",
            "give, per argument name, a Batched or a tree of Batched/None matching that argument",
        )
    assert len(flat) == len(leaves)
    return [None if x is None else s for s, x in zip(flat, leaves)]


def pad_count(fname: str, paths, leaves, specs) -> int | None:
    """N: the real token count of the call (max over batched leaves of size - extra)."""
    n = None
    for path, x, spec in zip(paths, leaves, specs):
        if spec is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise SignatureError(
                f"fgraph.jit({fname}): {path_str(path)} is declared Batched but is a {type(x).__name__}",
                "declare only tensor leaves as Batched",
            )
        if x.dim() <= spec.axis:
            raise SignatureError(
                f"fgraph.jit({fname}): {path_str(path)} has shape {list(x.shape)}, expected a batch axis {spec.axis}",
                "fix the leaf's shape or the Batched(axis=...)",
            )
        if spec.real(x) < 0:
            raise SignatureError(
                f"fgraph.jit({fname}): {path_str(path)} has {x.shape[spec.axis]} rows along axis {spec.axis}, fewer "
                f"than the {spec.extra} extra rows its Batched(extra={spec.extra}) declares",
                "a leaf declared Batched(extra=E) holds N + E rows: pass at least E rows, or lower extra",
            )
        if spec.pad == "ramp" and x.numel() != x.shape[spec.axis]:
            raise SignatureError(
                f"fgraph.jit({fname}): {path_str(path)} has shape {list(x.shape)}, but Batched(pad='ramp') continues "
                "a 1-D array of offsets along its axis",
                "declare offsets as a 1-D tensor, or give a fill value or a callable pad for this leaf",
            )
        if spec.fixed_tail and spec.pad != 0 and not _holds(x.dtype, spec.pad):
            raise SignatureError(
                f"fgraph.jit({fname}): {path_str(path)} is {str(x.dtype).removeprefix('torch.')}, which cannot hold "
                f"its Batched(pad={spec.pad!r}): the padded rows would not be filled with it",
                "give a fill value of the leaf's dtype (an int for integer leaves, 0 or 1 for bool ones)",
            )
        n = max(n or 0, spec.real(x))
    return n


def undeclared_batched(call: Call, lifted: set[str]) -> list[tuple[str, list[int], int]]:
    """(key path, shape, dim) of each tensor argument not declared Batched with a dim of the call's N rows.

    Module parameters and other lifted state (`lifted`: their leaf names) are not arguments. Where the call is
    padded, such an input is likely per-row data left out of batch= (an attention mask beside the input ids)."""
    found = []
    for path, x, spec in zip(call.paths, call.leaves, call.specs):
        if spec is None and isinstance(x, torch.Tensor) and path_str(path) not in lifted:
            dims = [d for d, size in enumerate(x.shape) if size == call.n]
            if dims:
                found.append((path_str(path), list(x.shape), dims[0]))
    return found


def device_of(fname: str, call, strict: bool = True) -> str:
    """The signature's device: where its non-batched tensors live (batched inputs may come from the host).

    strict=False: the accelerator's when they are split between it and the host, where a SignatureError says so
    otherwise (a call that runs eagerly may be the one that moves them: a lazily made cache)."""
    devs = {}
    for p, x, s in zip(call.paths, call.leaves, call.specs):
        if isinstance(x, torch.Tensor) and s is None:
            devs.setdefault(str(x.device) if x.device.type != "cuda" else f"cuda:{x.device.index or 0}", p)
    if not strict and len(devs) == 2 and "cpu" in devs:
        return next(d for d in devs if d != "cpu")
    if len(devs) > 1:
        (d1, p1), (d2, p2) = sorted(devs.items())[:2]
        raise SignatureError(
            f"fgraph.jit({fname}): {path_str(p1)} is on {d1} but {path_str(p2)} is on {d2}",
            "put params and state on one device (only Batched inputs may come from the host)",
        )
    tensors = [(p, x) for p, x in zip(call.paths, call.leaves) if isinstance(x, torch.Tensor)]
    device = next(iter(devs)) if devs else str(tensors[0][1].device) if tensors else "cpu"
    for p, x in tensors:  # batched rows are copied in from the host, never from another device
        if x.device.type != "cpu" and x.device != torch.device(device):
            raise SignatureError(
                f"fgraph.jit({fname}): {path_str(p)} is on {x.device}, but the call runs on {device}",
                f"put it on {device}, or on the host (Batched inputs may come from the host)",
            )
    return device
