"""Mixture-of-experts as one break primitive: router + gated-MLP experts (+ optional shared expert).

    out = sum_{e in topk(x)} w_e(x) * down_e(silu(gate_e(x)) * up_e(x))  +  sigmoid(g . x) * shared(x)

`torch.ops.fgraph.moe(out, hidden, router_w, w13, w2, shared_w13, shared_w2, shared_gate, top_k, scoring,
renormalize, backend)` writes `out [N, dim]`. Backends (the `backend` string decides capture support):

  local      all E experts on this device. Static shapes, no host sync: capturable (Support.ALWAYS).
  allgather  expert parallel: rank r holds experts [r*El, (r+1)*El). All-gather of hidden/routing and
             reduce-scatter of the partial outputs, fixed sizes: capturable (Support.ALWAYS). Every rank
             must call with the same N (pad to a globally agreed bucket).
  all2all    expert parallel in the shape of DeepEP's high-throughput mode: each token goes once to every
             rank that holds one of its experts; the per-rank counts go through the host (`.tolist()`),
             then all_to_all_single with data-dependent split sizes: Support.NEVER (always a break).

Communication is torch.distributed on the default group (NCCL on GPU, gloo on CPU), initialised by the
caller; with no process group the EP backends run as world size 1 (all2all still syncs with the host).

Expert layouts (how the experts of one rank are applied to (token, expert) pairs; all loop-free over
experts and free of host syncs, so the local backend can sit inside a CUDA graph):
  grouped  sort pairs by expert, searchsorted offsets, torch._grouped_mm twice. Reads each expert's weights
           once and does exactly the routed flops; the default wherever _grouped_mm takes the dtype
           (CPU: fp32/bf16/fp16; CUDA: bf16 with dims % 8 == 0).
  dense    every expert on every token, combined with a [N, El] weight matrix: El/k times the flops but
           one plain matmul per projection; the fallback once the pairs cover most experts.
  gather   gather the k expert matrices per token and einsum: copies weights, fine at decode sizes only.
  loop     HF-style Python loop over hit experts (nonzero -> host sync): reference for the benchmark only.
Measured (`python -m fgraph.ops.moe [cuda]`), CPU fp32, 1 thread, E=32 dim=1024 inter=512 k=4, ms/call:
  N=1: grouped 1.9, dense 15.1, gather 5.8, loop 1.9  | N=8: 12.3, 37.5, 143, 12.9
  N=64: 28.4, 112, 1107, 29.7                         | N=512: 88.8, 735, (gather skipped), 92.7
grouped matches the loop's work (CPU _grouped_mm is itself per-group) without the loop's host syncs and
per-expert launches, which is what dominates a GPU decode step; dense/gather are the fallbacks.
"""

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fgraph.extend import FgraphError, Support, field, primitive, register

BACKENDS = ("local", "allgather", "all2all")
SCORINGS = ("softmax", "sigmoid")


# ----------------------------------------------------------------------------------------------- weights
@register
@attrs.frozen
class MoEWeights:
    """One MoE layer's parameters (a pytree). For EP backends w13/w2 hold only this rank's El = E/world experts."""

    router: torch.Tensor  # [E, dim]
    w13: torch.Tensor  # [El, 2*inter, dim]  rows: gate (w1) then up (w3)
    w2: torch.Tensor  # [El, dim, inter]
    shared_w13: torch.Tensor | None = None  # [2*shared_inter, dim]
    shared_w2: torch.Tensor | None = None  # [dim, shared_inter]
    shared_gate: torch.Tensor | None = None  # [1, dim]; None with a shared expert means gate 1
    top_k: int = field(static=True, default=2)
    scoring: str = field(static=True, default="softmax")
    renormalize: bool = field(static=True, default=False)

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def shard(self, rank: int, world: int) -> "MoEWeights":
        """This rank's slice of the experts (contiguous blocks: rank r holds [r*El, (r+1)*El))."""
        E = self.w13.shape[0]
        if E % world:
            raise FgraphError(
                f"MoEWeights.shard: {E} experts do not split over {world} ranks",
                "use a world size that divides the number of experts",
            )
        el = E // world
        return attrs.evolve(
            self,
            w13=self.w13[rank * el : (rank + 1) * el].contiguous(),
            w2=self.w2[rank * el : (rank + 1) * el].contiguous(),
        )

    @classmethod
    def random(
        cls,
        num_experts,
        dim,
        inter,
        shared_inter=0,
        *,
        top_k=2,
        scoring="softmax",
        renormalize=False,
        shared_gate=True,
        dtype=torch.float32,
        device="cpu",
        generator=None,
        scale=1.0,
    ):
        """Random weights with unit-ish activations (for tests and benchmarks)."""

        def r(*shape, fan_in):
            return (
                torch.randn(*shape, generator=generator, device=generator.device if generator else "cpu")
                * (scale / fan_in**0.5)
            ).to(dtype=dtype, device=device)

        sw13 = r(2 * shared_inter, dim, fan_in=dim) if shared_inter else None
        sw2 = r(dim, shared_inter, fan_in=shared_inter) if shared_inter else None
        sg = r(1, dim, fan_in=dim) if shared_inter and shared_gate else None
        return cls(
            r(num_experts, dim, fan_in=dim),
            r(num_experts, 2 * inter, dim, fan_in=dim),
            r(num_experts, dim, inter, fan_in=inter),
            sw13,
            sw2,
            sg,
            top_k=top_k,
            scoring=scoring,
            renormalize=renormalize,
        )


# ----------------------------------------------------------------------------------------------- routing
def route(hidden, router_w, top_k: int, scoring: str, renormalize: bool):
    """hidden [N, dim] -> (weights [N, k] in hidden's dtype, ids [N, k] int64).

    HF Qwen2-MoE/Mixtral order: logits in the hidden dtype, scores in >= fp32, top-k, optional renormalisation, cast
    back."""
    logits = hidden @ router_w.t()  # [N, E]
    sdt = torch.promote_types(hidden.dtype, torch.float32)
    scores = logits.to(sdt).softmax(-1) if scoring == "softmax" else logits.to(sdt).sigmoid()
    w, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.to(hidden.dtype), ids


def shared_expert(x, shared_w13, shared_w2, shared_gate):
    h = x @ shared_w13.t()  # [N, 2*Is]
    g, u = h.chunk(2, dim=-1)
    s = (F.silu(g) * u) @ shared_w2.t()  # [N, dim]
    return s if shared_gate is None else torch.sigmoid(x @ shared_gate.t()) * s


# ----------------------------------------------------------------------------------------------- layouts
# Each layout: x [N, dim], ids [N, k] int64 in [0, El] (El = "not on this rank": contributes 0), w [N, k]
# (0 where ids == El) -> [N, dim] = sum_j w[:, j] * expert_{ids[:, j]}(x).


def _grouped(x, ids, w, w13, w2):
    N, k = ids.shape
    el = w13.shape[0]
    flat = ids.reshape(-1)  # [P = N*k]
    order = flat.argsort(stable=True)  # pairs by expert, sentinel El last
    sorted_ids = flat[order]
    offs = torch.searchsorted(sorted_ids, torch.arange(el, device=x.device), right=True).to(torch.int32)  # [El]
    xs = x.index_select(0, order // k)  # [P, dim]
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [P, 2I]
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w2.transpose(1, 2), offs=offs)  # [P, dim]; rows >= offs[-1] undefined
    ws = w.reshape(-1)[order, None]
    y = torch.where(sorted_ids[:, None] < el, y * ws, 0)  # where, not *: undefined rows may be nan
    return torch.empty_like(y).index_copy_(0, order, y).view(N, k, y.shape[1]).sum(1)


def _dense(x, ids, w, w13, w2):
    N, k = ids.shape
    el = w13.shape[0]
    comb = x.new_zeros(N, el + 1).scatter_add_(1, ids, w)[:, :el]  # [N, El] routing weight per expert
    h = torch.einsum("nd,eid->nei", x, w13)  # [N, El, 2I]
    g, u = h.chunk(2, dim=-1)
    y = torch.einsum("nei,edi->ned", F.silu(g) * u, w2)  # [N, El, dim]
    return torch.einsum("ned,ne->nd", y, comb)


def _gather(x, ids, w, w13, w2):
    el = w13.shape[0]
    valid = ids < el
    safe = torch.where(valid, ids, 0)
    h = torch.einsum("nd,nkid->nki", x, w13[safe])  # [N, k, 2I]  (copies k matrices/token)
    g, u = h.chunk(2, dim=-1)
    y = torch.einsum("nki,nkdi->nkd", F.silu(g) * u, w2[safe])  # [N, k, dim]
    return torch.where(valid[..., None], y * w[..., None], 0).sum(1)


def _loop(x, ids, w, w13, w2):
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():  # host sync: benchmark baseline only
        if e >= w13.shape[0]:
            continue
        t, j = torch.nonzero(ids == e, as_tuple=True)
        g, u = (x[t] @ w13[e].t()).chunk(2, dim=-1)
        out.index_add_(0, t, ((F.silu(g) * u) @ w2[e].t()) * w[t, j, None])
    return out


LAYOUTS = {"grouped": _grouped, "dense": _dense, "gather": _gather, "loop": _loop}


def grouped_ok(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether torch._grouped_mm can run this dtype/device/shape.

    The CUDA kernels need bf16, 16-byte aligned rows and sm80+."""
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return (
            x.dtype == torch.bfloat16
            and x.shape[-1] % 8 == 0
            and w13.shape[1] % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 0)
        )
    return False


def choose_layout(x, ids, w13) -> str:
    """Static per (shape, dtype, device), so one signature always runs the same kernels (replay-safe)."""
    if grouped_ok(x, w13):
        return "grouped"
    # No grouped kernel for this dtype/device: gather copies k matrices per token, which wins only while the
    # pairs touch few of the experts; past that, dense (El/k x the flops, one matmul per projection) wins.
    return "gather" if 2 * ids.numel() <= w13.shape[0] else "dense"


def experts(x, ids, w, w13, w2, layout: str | None = None):
    """Apply this rank's experts to routed pairs (see the layout comment above)."""
    if x.shape[0] == 0:  # an all2all rank that received no tokens
        return x.new_zeros(0, w2.shape[1])
    return LAYOUTS[layout or choose_layout(x, ids, w13)](x, ids, w, w13, w2)


# ----------------------------------------------------------------------------------------------- backends
def _world():
    """(rank, world, communicate) for the EP backends.

    With no process group the EP backends run alone (world 1, no collectives); with one,
    they always communicate, even at world size 1, so one GPU exercises the NCCL path."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _pack(ids, w, el_offset, el, dtype):
    """Routing rows to send: local expert ids (El where the expert is elsewhere) + weights, as one float tensor."""
    local = ids - el_offset
    valid = (local >= 0) & (local < el)
    return torch.cat([torch.where(valid, local, el).to(dtype), torch.where(valid, w.to(dtype), 0)], 1)


def _unpack(packed, k, dtype):
    return packed[:, :k].long(), packed[:, k:].to(dtype)


def _allgather(x, w, ids, w13, w2):
    """Each rank computes its experts' share for all ranks' tokens; reduce-scatter sums the shares back."""
    rank, world, comm = _world()
    N, k = ids.shape
    el = w13.shape[0]
    pdt = torch.promote_types(x.dtype, torch.float32)  # ids < 2^24 are exact in fp32
    packed = torch.cat([ids.to(pdt), w.to(pdt)], 1)  # [N, 2k]
    if comm:
        xg, pg = x.new_empty(world * N, x.shape[1]), packed.new_empty(world * N, 2 * k)
        dist.all_gather_into_tensor(xg, x.contiguous())
        dist.all_gather_into_tensor(pg, packed)
    else:
        xg, pg = x, packed
    gids, gw = _unpack(pg, k, pdt)
    lids, lw = _unpack(_pack(gids, gw, rank * el, el, pdt), k, x.dtype)
    y = experts(xg, lids, lw, w13, w2)  # [world*N, dim] partial sums
    if not comm:
        return y
    mine = x.new_empty(N, x.shape[1])
    dist.reduce_scatter_tensor(mine, y.contiguous())
    return mine


def _all2all(x, w, ids, w13, w2):
    """DeepEP-HT shaped dispatch/combine: counts through the host, data-dependent all_to_all sizes."""
    rank, world, comm = _world()
    N, k = ids.shape
    el, dim = w13.shape[0], x.shape[1]
    pdt = torch.promote_types(x.dtype, torch.float32)
    ranks = torch.arange(world, device=x.device)
    hit = ((ids // el)[None] == ranks[:, None, None]).any(-1)  # [W, N]: token t needs rank r
    dst, tok = hit.nonzero(as_tuple=True)  # sorted by rank, then token
    send = hit.sum(1)  # [W]
    recv = torch.empty_like(send)
    if comm:
        dist.all_to_all_single(recv, send)
    else:
        recv.copy_(send)
    send_n, recv_n = send.tolist(), recv.tolist()  # the host exchange
    x_send = x.index_select(0, tok)  # [S, dim]
    r_send = _pack(ids[tok], w[tok], dst[:, None] * el, el, pdt)  # [S, 2k]
    if comm:
        x_recv, r_recv = x.new_empty(sum(recv_n), dim), r_send.new_empty(sum(recv_n), 2 * k)
        dist.all_to_all_single(x_recv, x_send, recv_n, send_n)
        dist.all_to_all_single(r_recv, r_send, recv_n, send_n)
    else:
        x_recv, r_recv = x_send, r_send
    lids, lw = _unpack(r_recv, k, x.dtype)
    y = experts(x_recv, lids, lw, w13, w2)  # [R, dim], weighted by the receiver
    if comm:
        y_back = x.new_empty(len(tok), dim)
        dist.all_to_all_single(y_back, y.contiguous(), send_n, recv_n)
    else:
        y_back = y
    # combine deterministically (no atomics): one slot per (rank, token), then a fixed-order sum over ranks
    buf = x.new_zeros(world * N, dim).index_copy_(0, dst * N + tok, y_back)
    return buf.view(world, N, dim).sum(0)


def _check(hidden, router_w, w13, w2, top_k, scoring, backend):
    E, el = router_w.shape[0], w13.shape[0]
    if backend not in BACKENDS:
        raise FgraphError(f"moe: unknown backend {backend!r}", f"use one of {BACKENDS}")
    if scoring not in SCORINGS:
        raise FgraphError(f"moe: unknown scoring {scoring!r}", f"use one of {SCORINGS}")
    if not 0 < top_k <= E:
        raise FgraphError(f"moe: top_k={top_k} with {E} experts", "pick 1 <= top_k <= num_experts")
    world = 1 if backend == "local" else _world()[1]
    if el * world != E:
        raise FgraphError(
            f"moe[{backend}]: router has {E} experts but this rank holds {el} (world size {world})",
            "pass MoEWeights.shard(rank, world) for expert-parallel backends, full weights for local",
        )
    if w2.shape[0] != el or w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != hidden.shape[1]:
        raise FgraphError(
            f"moe: expert shapes w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match "
            f"hidden {tuple(hidden.shape)}",
            "w13 [El, 2*inter, dim], w2 [El, dim, inter]",
        )


# ----------------------------------------------------------------------------------------------- primitive
def _support(args):
    b = args.get("backend")
    if b == "all2all":
        return Support.NEVER, "all2all exchanges per-rank token counts through the host (data-dependent sizes)"
    return Support.ALWAYS, f"moe backend {b!r}: static shapes, no host sync"


@primitive("moe", support=_support)
def moe_p(
    out: torch.Tensor,
    hidden: torch.Tensor,
    router_w: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_w13: torch.Tensor | None,
    shared_w2: torch.Tensor | None,
    shared_gate: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    backend: str,
) -> None:
    """MoE layer: hidden [N, dim] -> out [N, dim] (see fgraph.ops.moe)."""
    _check(hidden, router_w, w13, w2, top_k, scoring, backend)
    w, ids = route(hidden, router_w, top_k, scoring, renormalize)
    if backend == "local":
        y = experts(hidden, ids, w, w13, w2)
    elif backend == "allgather":
        y = _allgather(hidden, w, ids, w13, w2)
    else:
        y = _all2all(hidden, w, ids, w13, w2)
    if shared_w13 is not None:
        y = y + shared_expert(hidden, shared_w13, shared_w2, shared_gate)
    out.copy_(y)


def moe(hidden: torch.Tensor, weights: MoEWeights, backend: str = "local") -> torch.Tensor:
    """hidden [N, dim] -> [N, dim]. Calls the break `torch.ops.fgraph.moe` with a fresh `out`."""
    out = torch.empty_like(hidden)
    moe_p(
        out,
        hidden,
        weights.router,
        weights.w13,
        weights.w2,
        weights.shared_w13,
        weights.shared_w2,
        weights.shared_gate,
        weights.top_k,
        weights.scoring,
        weights.renormalize,
        backend,
    )
    return out


def moe_reference(hidden: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    """Plain per-token reference in float64 (full weights): loops over tokens and their chosen experts."""
    wt = attrs.evolve(
        weights,
        **{
            f: (getattr(weights, f).double() if getattr(weights, f) is not None else None)
            for f in ("router", "w13", "w2", "shared_w13", "shared_w2", "shared_gate")
        },
    )
    x = hidden.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = wt.router @ x[t]  # [E]
        scores = logits.softmax(-1) if wt.scoring == "softmax" else logits.sigmoid()
        top, idx = scores.topk(wt.top_k)
        if wt.renormalize:
            top = top / top.sum()
        for p, e in zip(top.tolist(), idx.tolist()):
            g, u = (wt.w13[e] @ x[t]).chunk(2)
            out[t] += p * (wt.w2[e] @ (F.silu(g) * u))
        if wt.shared_w13 is not None:
            g, u = (wt.shared_w13 @ x[t]).chunk(2)
            s = wt.shared_w2 @ (F.silu(g) * u)
            out[t] += s if wt.shared_gate is None else torch.sigmoid(wt.shared_gate[0] @ x[t]) * s
    return out


def _bench(
    num_experts=32, dim=1024, inter=512, top_k=4, tokens=(1, 8, 64, 512), dtype=torch.float32, device="cpu", reps=5
):
    """Time the expert layouts (ms per call). `python -m fgraph.ops.moe [cuda]`."""
    import time

    w = MoEWeights.random(num_experts, dim, inter, top_k=top_k, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"E={num_experts} dim={dim} inter={inter} k={top_k} {dtype} {device}; ms/call")
    for n in tokens:
        x = torch.randn(n, dim, dtype=dtype, device=device)
        rw, ids = route(x, w.router, top_k, "softmax", False)
        row = {}
        for name in LAYOUTS:
            if (name == "grouped" and not grouped_ok(x, w.w13)) or (
                name == "gather" and n * top_k * inter * dim > 2**28
            ):
                continue
            experts(x, ids, rw, w.w13, w.w2, layout=name)
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                experts(x, ids, rw, w.w13, w.w2, layout=name)
            sync()
            row[name] = (time.perf_counter() - t0) / reps * 1e3
        cells = "  ".join(f"{k}={v:8.2f}" for k, v in row.items())
        print(f"  N={n:5d} {cells}  auto={choose_layout(x, ids, w.w13)}")


if __name__ == "__main__":
    import sys

    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    _bench(
        device=dev,
        dtype=torch.bfloat16 if dev == "cuda" else torch.float32,
        tokens=(1, 8, 64, 512, 4096) if dev == "cuda" else (1, 8, 64, 512),
    )
