"""jit: trace once per signature, split at breaks, capture each signature's graphs, dispatch calls to them."""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import time
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from . import _primitives as P
from . import capture as C
from ._errors import CaptureError, SignatureError
from ._pytree import check_static_fields, flatten_with_paths
from ._signature import Batched, Leaf, Signature, batch_specs, bucket_for, default_buckets, leaf_of, pad_count, path_str
from ._split import Mode, Program, breaks_filter, resolve_mode, split
from ._trace import check, trace

log = logging.getLogger("fgraph")


class config:
  """Process-wide switches (JAX's jax_explain_cache_misses / jax_log_compiles are the models)."""
  explain_cache_misses = False  # log, for each new signature, the closest previous one and what differs
  log_captures = False          # log every graph captured


_disabled = False


@contextlib.contextmanager
def disable_jit():
  """Run jitted functions as plain Python (the oracle every captured signature is tested against)."""
  global _disabled
  prev, _disabled = _disabled, True
  try:
    yield
  finally:
    _disabled = prev


class Call(NamedTuple):
  """One call, flattened and padded: everything dispatch needs."""
  sig: Signature
  statics: dict[str, Any]
  paths: list            # key path per leaf
  leaves: list           # padded leaves
  specs: list            # Batched | None per leaf
  n: int | None          # real tokens


class Stats:
  __slots__ = ("traces", "captures", "replays", "eager", "calls", "padded")

  def __init__(self):
    self.traces = self.captures = self.replays = self.eager = self.calls = self.padded = 0

  def as_dict(self):
    return {k: getattr(self, k) for k in self.__slots__}


class Entry:
  """Everything fgraph keeps for one signature: its trace, its program, its mode and its graphs."""

  def __init__(self, jitted: "Jitted", call: Call):
    self.sig, self.stats = call.sig, Stats()
    fname = jitted.name
    self.device = _device_of(fname, call)
    tensor_ix = [i for i, x in enumerate(call.leaves) if isinstance(x, torch.Tensor)]
    self.batched_ix = [i for i in tensor_ix if call.specs[i] is not None]
    self.address_ix = [i for i in tensor_ix if call.specs[i] is None]
    self.tensor_ix, self.paths = tensor_ix, [path_str(p) for p in call.paths]
    self.out_spec = None
    consts = list(call.leaves)

    def flat_fn(*tensors):
      leaves = list(consts)
      for i, t in zip(tensor_ix, tensors):
        leaves[i] = t
      dyn = pytree.tree_unflatten(leaves, call.sig.treespec)
      out = jitted.fn(**dyn, **call.statics)
      out_leaves, self.out_spec = pytree.tree_flatten(out)
      return out_leaves

    t0 = time.perf_counter()
    # batched inputs may come from the host but live on the device inside the program
    example = [x if x.device.type == torch.device(self.device).type else torch.empty_like(x, device=self.device)
               for x in (call.leaves[i] for i in tensor_ix)]
    gm = trace(fname, flat_fn, example)
    self.stats.traces += 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ph_paths = {ph: self.paths[i] for ph, i in zip(placeholders, tensor_ix)}
    donated_roots = set(jitted.donate)
    check(fname, gm, ph_paths, lambda ph: ph_paths[ph].split("[")[0].split(".")[0] in donated_roots, self.device)
    is_break = breaks_filter(jitted.breaks)
    self.decode = call.statics.get(jitted.routine) == "decode"
    self.mode, self.reason = resolve_mode(fname, jitted.mode, self.decode, gm, is_break)
    self.program: Program = split(gm, is_break, {ph.name: ph_paths[ph] for ph in placeholders})
    self.trace_seconds = time.perf_counter() - t0
    # outputs: which are the caller's own tensors handed back (donated passthrough) and which get sliced to N
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    ph_pos = {ph: k for k, ph in enumerate(placeholders)}
    self.out_passthrough = {j: tensor_ix[ph_pos[o]] for j, o in enumerate(out_node.args[0]) if o in ph_pos}
    self.out_batched = [j for j, o in enumerate(out_node.args[0]) if j not in self.out_passthrough and
                        isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor) and
                        o.meta["val"].dim() > 0 and o.meta["val"].shape[0] == call.sig.bucket]
    self.plans = _plan_sites(gm, ph_pos, tensor_ix, call.specs)
    self.graphs: list = []
    self.full = None
    self.capture_seconds, self.pool_bytes = 0.0, 0
    self.buffers = None

  # -- running ----------------------------------------------------------------------------------------------
  def _inputs(self, call: Call):
    """The program's positional inputs: static buffers for batched leaves, the caller's tensors otherwise."""
    host = self.buffers.write([call.leaves[i] for i in self.batched_ix])
    args = [None] * len(call.leaves)
    for i, b in zip(self.batched_ix, self.buffers.dev):
      args[i] = b
    for i in self.address_ix:
      args[i] = call.leaves[i]
    return [args[i] for i in self.tensor_ix], dict(zip(self.batched_ix, host))

  def _plan(self, call: Call, host: dict[int, torch.Tensor], capturing: bool):
    for p, args, inputs in self.plans:
      P.plan_rules[p](P.PlanCall(p, args, {k: host[i] for k, i in inputs.items()}, call.sig.bucket,
                                 call.n if call.n is not None else 0, call.statics, capturing))

  def run(self, call: Call, copy_outputs: bool):
    st = self.stats
    st.calls += 1
    if call.n is not None:
      st.padded += call.sig.bucket - call.n
    args, host = self._inputs(call)
    if self.full is None and not self.graphs:
      st.eager += 1
    else:
      self._check_addresses(call)
      st.replays += 1
    self._plan(call, host, capturing=False)
    if self.full is not None:
      outs = self.full.replay()
    else:
      outs = self.program.module(*args)
    return self._outputs(call, outs, copy_outputs)

  def _outputs(self, call: Call, outs, copy_outputs: bool):
    outs = list(outs)
    for j, i in self.out_passthrough.items():
      outs[j] = call.leaves[i]
    if call.n is not None and call.n != call.sig.bucket:
      for j in self.out_batched:
        outs[j] = outs[j][:call.n]
    if copy_outputs:
      outs = [o.clone() if isinstance(o, torch.Tensor) and j not in self.out_passthrough else o
              for j, o in enumerate(outs)]
    return pytree.tree_unflatten(outs, self.out_spec)

  def _check_addresses(self, call: Call):
    ptrs = tuple(call.leaves[i].data_ptr() for i in self.address_ix)
    if ptrs != self.addresses:
      k = next(k for k, (a, b) in enumerate(zip(ptrs, self.addresses)) if a != b)
      raise SignatureError(f"fgraph.jit: {self.paths[self.address_ix[k]]} is not the tensor the graph of signature "
                           f"{self.sig.describe()} was captured with (graphs read state by address)",
                           "update state in place and pass the same tensors back (donate=[...]), "
                           "or call .reset() to drop the graphs after replacing them")

  # -- capturing -------------------------------------------------------------------------------------------
  def capture(self, call: Call, pool, warmups: int):
    """Warm up, then record this signature's graphs: the pieces (PIECEWISE) or the whole program (FULL)."""
    t0, mem0 = time.perf_counter(), C.pool_bytes(self.device)
    self.buffers = C.InputBuffers([(call.leaves[i].shape, call.leaves[i].dtype) for i in self.batched_ix],
                                  self.device)
    args, host = self._inputs(call)
    self.addresses = tuple(call.leaves[i].data_ptr() for i in self.address_ix)
    self._plan(call, host, capturing=True)
    for _ in range(warmups):
      self.program.module(*args)
    if self.device.startswith("cuda"):
      torch.cuda.synchronize()
    Graph = C.graph_class(self.device)
    if self.mode is Mode.PIECEWISE:
      runners = [PieceRunner(piece, Graph, pool) for piece in self.program.pieces]
      for r in runners:
        setattr(self.program.module, r.piece.name, r)
      self.program.module(*args)  # the runners capture on this first call, replay on later ones
      self.graphs = [r.graph for r in runners if not r.piece.is_break]
    elif self.mode is Mode.FULL:
      self.full = Graph(pool)
      self.full.capture(self.program.module, *args)
      self.graphs.append(self.full)
    self.stats.captures += len(self.graphs)
    if self.device.startswith("cuda"):
      torch.cuda.synchronize()
    self.capture_seconds = time.perf_counter() - t0
    self.pool_bytes = C.pool_bytes(self.device) - mem0


class PieceRunner(torch.nn.Module):
  """Stands in for one piece of the program: captures a graph piece on its first call and replays it after;
  a break piece runs eagerly every time and copies any tensors it returns into stable buffers."""

  def __init__(self, piece, Graph, pool):
    super().__init__()
    self.piece, self.module, self.graph, self.out = piece, piece.module, None, None
    self._Graph, self._pool = Graph, pool

  def forward(self, *args):
    if self.piece.is_break:
      out = self.module(*args)
      if self.out is None:
        self.out = out
      else:
        for old, new in zip(pytree.tree_leaves(self.out), pytree.tree_leaves(out)):
          if isinstance(old, torch.Tensor) and old is not new:
            old.copy_(new)
      return self.out
    if self.graph is None:
      self.graph = self._Graph(self._pool)
      return self.graph.capture(self.module, *args)
    return self.graph.replay()


def _plan_sites(gm, ph_pos, tensor_ix, specs):
  """Plan hooks to run per call: one per distinct (primitive, constant args, batched inputs it reads)."""
  sites = {}
  for node in gm.graph.nodes:
    p = P.primitive_of(node)
    if p is None or p not in P.plan_rules:
      continue
    inputs = {k: tensor_ix[ph_pos[v]] for k, v in P.node_args(node).items()
              if isinstance(v, fx.Node) and v in ph_pos and specs[tensor_ix[ph_pos[v]]] is not None}
    args = P.constant_args(node)
    key = (p, repr(sorted(args.items())), tuple(sorted(inputs.items())))
    sites.setdefault(key, (p, args, inputs))
  return list(sites.values())


def _device_of(fname: str, call: Call) -> str:
  """The signature's device: where its non-batched tensors live (batched inputs may come from the host)."""
  devs = {}
  for p, x, s in zip(call.paths, call.leaves, call.specs):
    if isinstance(x, torch.Tensor) and s is None:
      devs.setdefault(str(x.device) if x.device.type != "cuda" else f"cuda:{x.device.index or 0}", p)
  if len(devs) > 1:
    (d1, p1), (d2, p2) = sorted(devs.items())[:2]
    raise SignatureError(f"fgraph.jit({fname}): {path_str(p1)} is on {d1} but {path_str(p2)} is on {d2}",
                         "put params and state on one device (only Batched inputs may come from the host)")
  if devs:
    return next(iter(devs))
  batched = [x for x, s in zip(call.leaves, call.specs) if isinstance(x, torch.Tensor)]
  return str(batched[0].device) if batched else "cpu"


class Jitted:
  """A function traced and captured per signature. Call it like the original; see `jit`."""

  def __init__(self, fn, *, static=(), donate=(), batch=None, buckets=None, mode="FULL_AND_PIECEWISE",
               breaks=None, strict=False, copy_outputs=False, routine="routine", warmups=1):
    self.fn, self.name = fn, getattr(fn, "__name__", repr(fn))
    self.signature = inspect.signature(fn)
    params = self.signature.parameters
    for kind, names in (("static", static), ("donate", donate), ("batch", list(batch or {}))):
      for a in names:
        if a not in params:
          raise SignatureError(f"fgraph.jit({self.name}): {kind}= names {a!r}, which is not a parameter of "
                               f"{self.name}{self.signature}", f"use one of {list(params)}")
    self.static, self.donate, self.batch = tuple(static), tuple(donate), dict(batch or {})
    self.buckets = tuple(sorted(buckets)) if buckets is not None else default_buckets()
    try:
      self.mode = Mode(mode.upper() if isinstance(mode, str) else mode)
    except ValueError:
      raise SignatureError(f"fgraph.jit({self.name}): unknown mode {mode!r}",
                           f"use one of {[m.value for m in Mode]}") from None
    if breaks is not None:
      unknown = [b for b in breaks if b not in P.registry]
      if unknown:
        raise SignatureError(f"fgraph.jit({self.name}): breaks= names unknown primitives {unknown}",
                             f"registered primitives are {sorted(P.registry)}")
    self.breaks, self.strict, self.copy_outputs = breaks, strict, copy_outputs
    self.routine, self.warmups = routine, warmups
    self.entries: dict[Signature, Entry] = {}
    self.sealed, self.pool, self.fallbacks, self._logged = False, None, {"unseen": 0, "oversize": 0}, set()
    functools.update_wrapper(self, fn)

  # -- the call path ---------------------------------------------------------------------------------------
  def _bind(self, args, kwargs, pad=True) -> Call:
    try:
      bound = self.signature.bind(*args, **kwargs)
    except TypeError as e:
      raise SignatureError(f"fgraph.jit({self.name}): {e}", f"call it as {self.name}{self.signature}") from None
    bound.apply_defaults()
    statics, dynamic = {}, {}
    for k, v in bound.arguments.items():
      (statics if k in self.static else dynamic)[k] = v
    for k, v in statics.items():
      try:
        hash(v)
      except TypeError:
        raise SignatureError(f"fgraph.jit({self.name}): static argument {k}={v!r} is unhashable "
                             f"({type(v).__name__})", "pass a hashable value (a tuple instead of a list, a "
                             "frozen attrs class instead of a dict)") from None
    flat, treespec = flatten_with_paths(dynamic)
    paths, leaves = [p for p, _ in flat], [x for _, x in flat]
    specs = batch_specs(self.name, self.batch, dynamic, treespec, len(leaves))
    n = pad_count(self.name, paths, leaves, specs)
    bucket = None
    if n is not None:
      bucket = bucket_for(self.buckets, max(n, 1))
      if bucket is not None and pad:
        leaves = [s.padded(x, bucket + s.extra) if s is not None else x for x, s in zip(leaves, specs)]
    sig = Signature(tuple(sorted(statics.items(), key=lambda kv: kv[0])), bucket, treespec,
                    tuple(leaf_of(x) for x in leaves))
    return Call(sig, statics, paths, leaves, specs, n)

  def __call__(self, *args, **kwargs):
    if _disabled:
      return self.fn(*args, **kwargs)
    call = self._bind(args, kwargs)
    if call.n is not None and call.sig.bucket is None:
      return self._fallback("oversize", call, args, kwargs,
                            f"{call.n} tokens exceed the largest bucket {self.buckets[-1]}",
                            "raise buckets=[..., N] or split the batch")
    entry = self.entries.get(call.sig)
    if entry is None:
      if self.sealed:
        return self._fallback("unseen", call, args, kwargs, f"signature {call.sig.describe()} was not captured"
                              + self._closest(call.sig), f"add it to {self.name}.capture(...)")
      entry = self._new_entry(call)
      self._capture(entry, self._dummy(args, kwargs, call.sig.bucket) if call.n is not None else call)
    return entry.run(call, self.copy_outputs)

  def _fallback(self, kind, call, args, kwargs, what, fix):
    if self.strict:
      raise SignatureError(f"fgraph.jit({self.name}, strict=True): {what}", fix)
    if (kind, call.sig.statics) not in self._logged:
      self._logged.add((kind, call.sig.statics))
      log.warning("fgraph.jit(%s): %s; running eagerly (logged once). Fix: %s", self.name, what, fix)
    self.fallbacks[kind] += 1
    call = self._bind(args, kwargs, pad=False)
    device = _device_of(self.name, call)
    leaves = [x.to(device) if s is not None else x for x, s in zip(call.leaves, call.specs)]
    return self.fn(**pytree.tree_unflatten(leaves, call.sig.treespec), **call.statics)

  def _capture(self, entry: Entry, call: Call):
    graphed = entry.mode is not Mode.NONE
    entry.capture(call, self._pool(entry.device) if graphed else None, self.warmups if graphed else 0)

  def _pool(self, device):
    if self.pool is None:
      self.pool = C.new_pool(device)
    return self.pool

  def _new_entry(self, call: Call) -> Entry:
    for k, v in pytree.tree_unflatten(call.leaves, call.sig.treespec).items():
      check_static_fields(v, f"fgraph.jit({self.name}): {k}")
    if config.explain_cache_misses and self.entries:
      log.warning("fgraph.jit(%s): new signature %s%s", self.name, call.sig.describe(), self._closest(call.sig))
    entry = Entry(self, call)
    self.entries[call.sig] = entry
    return entry

  def _closest(self, sig: Signature) -> str:
    """The nearest known signature and the first thing that differs (JAX's explain_cache_misses)."""
    if not self.entries:
      return ""
    def diff(a: Signature, b: Signature):
      if a.statics != b.statics:
        return 3, f"static arguments {dict(b.statics)} vs {dict(a.statics)}"
      if a.treespec != b.treespec:
        return 2, "the tree structure of the arguments"
      if a.bucket != b.bucket:
        return 1, f"bucket {b.bucket} vs {a.bucket}"
      some = next(((i, x, y) for i, (x, y) in enumerate(zip(a.leaves, b.leaves)) if x != y), None)
      return 0, f"leaf #{some[0]}: {some[2]} vs {some[1]}" if some else "nothing"
    entry = min(self.entries.values(), key=lambda e: diff(sig, e.sig)[0])
    what = diff(sig, entry.sig)[1]
    if what.startswith("leaf #"):
      i = int(what[6:what.index(":")])
      what = f"{entry.paths[i]}: {sig.leaves[i]} (captured {entry.sig.leaves[i]})"
    return f"; closest captured signature {entry.sig.describe()} differs in {what}"

  # -- capture ---------------------------------------------------------------------------------------------
  def capture(self, *args, buckets=None, progress=True, **kwargs):
    """Trace and capture every signature up front, then seal: later unseen signatures never capture.

    Static keyword arguments may be lists (`routine=["decode", "mixed"]`): every combination is captured, for
    every bucket (largest first, so smaller graphs reuse the pool memory of larger ones). Batched inputs are
    replaced by all-padding dummies, so the padding values must be valid inputs for every kernel.
    """
    choices = {k: (v if isinstance(v, list) else [v]) for k, v in kwargs.items() if k in self.static}
    rest = {k: v for k, v in kwargs.items() if k not in self.static}
    todo = sorted(buckets or self.buckets, reverse=True)
    t0, n0, graphs = time.perf_counter(), len(self.entries), 0
    device = None
    from tqdm.auto import tqdm
    with contextlib.ExitStack() as stack:
      for combo in itertools.product(*choices.values()) if choices else [()]:
        statics = dict(zip(choices, combo))
        bar = tqdm(todo, desc=f"fgraph capture {self.name} {statics or ''}".rstrip(), disable=None if progress else True,
                   leave=False)
        for b in bar:
          call = self._dummy(args, {**rest, **statics}, b)
          if call.sig in self.entries:
            continue
          entry = self._new_entry(call)
          if device is None:
            device = entry.device
            stack.enter_context(C.capture_session(device))
          self._capture(entry, call)
          graphs += len(entry.graphs)
        bar.close()
    self.sealed = True
    secs = time.perf_counter() - t0
    gib = sum(e.pool_bytes for e in self.entries.values()) / 2**30
    if progress:
      print(f"fgraph: captured {graphs} graphs for {len(self.entries) - n0} signatures of {self.name} in "
            f"{secs:.1f} s, {gib:.2f} GiB", flush=True)
    return self

  def _dummy(self, args, kwargs, bucket) -> Call:
    """An all-padding call for `bucket`: each batched leaf cut to its `extra` rows, then padded."""
    call = self._bind(args, kwargs, pad=False)
    leaves = [x if s is None else s.padded(x.narrow(s.axis, 0, s.extra), bucket + s.extra)
              for x, s in zip(call.leaves, call.specs)]
    sig = call.sig._replace(bucket=bucket, leaves=tuple(leaf_of(x) for x in leaves))
    return call._replace(sig=sig, leaves=leaves, n=0)

  # -- introspection ---------------------------------------------------------------------------------------
  def stats(self) -> dict:
    """Counters: per signature (traces, captures, replays, eager, calls, padded) and totals."""
    per = {e.sig.describe(): e.stats.as_dict() for e in self.entries.values()}
    total = {k: sum(d[k] for d in per.values()) for k in Stats.__slots__}
    return {"signatures": per, "total": total, "fallbacks": dict(self.fallbacks)}

  def reset(self):
    """Drop every trace and graph (after replacing params or state with new tensors)."""
    self.entries.clear()
    self.sealed, self.pool = False, None


def jit(fn: Callable | None = None, **options) -> Jitted | Callable[[Callable], Jitted]:
  """Trace `fn` once per signature and capture CUDA graphs for it.

  static: argument names that are hashable Python values (a new value is a new signature).
  donate: argument names whose tensors the function may update in place (KV cache, state).
  batch: {argument name: Batched or a prefix tree of Batched/None}: leaves that carry the token axis.
  buckets: the padded token counts to capture (default vLLM's: 1, 2, 4, 8, ..., 256, 272, ..., 512).
  mode: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE (default); `routine` names the static
    argument whose value "decode" marks uniform decode signatures.
  breaks: primitive names that cut the graph (default: all registered primitives).
  strict: raise instead of running eagerly for unseen signatures or oversize batches.
  copy_outputs: return copies; by default outputs live in graph memory until the next replay of the same
    signature overwrites them.
  """
  if fn is None:
    return lambda f: Jitted(f, **options)
  return Jitted(fn, **options)
