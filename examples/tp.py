"""Tensor parallelism for the dense decoder (examples/llama.py: Llama, Qwen2, Mistral) on torch.distributed, one process
per rank.

Megatron's layout, as in gpt-fast's tp.py and vLLM: each of W ranks holds
  attention  Hq/W query heads: the rows of wqkv (and bqkv) for its q heads and for the KV heads they read
             (Hkv/W of them, or the one they share, replicated, when Hkv < W), the matching columns of wo;
  MLP        I/W columns: those rows of the gate and up halves of w13, those columns of w2;
  vocab      ceil(V/W) rows of the embedding and of the head (zero rows pad the last rank's share);
  the rest   norms and RoPE frequencies, replicated.
A step then needs four collectives, all traceable functional ones (`_c10d_functional.all_reduce`,
`all_gather_into_tensor` + `wait_tensor` in the trace): an all-reduce of the embedding (each token's row lives
on one rank, the others add zeros), one after each attention output projection and MLP down projection (partial
sums over this rank's heads / columns), and an all-gather of the logits. They are ordinary ops of the trace,
not breaks, so fgraph captures them inside the CUDA graphs (NCCL supports capture) in every mode.

Every rank must run the same signatures in the same order, or a rank waits in a collective no other rank
joins (vLLM #25906: ranks padded different token counts, chose different graphs and hung; #30173: ranks chose
different capture modes). fgraph's dispatch depends only on the token count N and the statics, so `TPEngine`
keeps ranks in lockstep: every rank gets the same requests, every rank takes rank 0's sampled tokens, and
(`verify=True`) each step first checks that all ranks agree on (N, routine), turning a would-be hang into an
error. Launch: `launch(fn, world)` spawns the ranks here (gloo on CPU, NCCL on GPUs), or run under torchrun.
"""

from __future__ import annotations

import functools
import gc
import os
import pickle
import sys
import tempfile
import threading
import time
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn.functional as F
import tqdm.std

import fgraph

from . import allreduce, checkpoint, engine, llama
from .layers import linear

# torch >= 2.12 names it all_gather_single; 2.11 (the GPU image) has only all_gather_tensor: the same traced op
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@attrs.frozen
class TP:
    """This rank's place in the tensor-parallel group. Frozen and hashable: closed over by the step; `group` is
    the process group's name (what functional collectives take, and what the trace records)."""

    rank: int
    world: int
    group: str
    all_reduce_impl: str = "nccl"  # "symm": small messages one-shot through symmetric memory (examples/allreduce)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim], this rank's partial sum (its heads / MLP columns) -> the sum over ranks, on every rank
        if self.all_reduce_impl == "symm":
            return allreduce.symm_all_reduce(x, self.group)
        return funcol.all_reduce(x, "sum", self.group)

    def embed(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        # tokens: [N] global ids; table: [Vl, dim], rows [rank * Vl, (rank + 1) * Vl) of the vocab -> [N, dim]
        local = tokens - self.rank * table.shape[0]
        mine = (local >= 0) & (local < table.shape[0])
        x = F.embedding(torch.where(mine, local, 0), table)
        return self.all_reduce(torch.where(mine[:, None], x, 0))  # one rank holds each row: the sum is exact

    def lm_head(self, x: torch.Tensor, w: torch.Tensor, vocab_size: int) -> torch.Tensor:
        # x: [N, dim], w: [Vl, dim] -> this rank's logits vocab-major [Vl, N] -> gathered [W*Vl, N] (rank-major:
        # vocab order) -> [N, V]. Gathered token-major ([W*N, Vl]), the ranks' rows would sit around each other's
        # padded rows until a transpose put them back: right, but what fgraph's padding check reports
        y = _all_gather(linear(x, w).t().contiguous(), 0, self.group)
        return y.t()[:, :vocab_size].contiguous()


def init(
    rank: int | None = None,
    world: int | None = None,
    init_method: str = "env://",
    backend: str | None = None,
    timeout_s: float = 600,
    all_reduce: str = "auto",
) -> TP:
    """Join (or create) the default process group -> this rank's TP. rank/world default to torchrun's RANK and
    WORLD_SIZE; on CUDA each rank takes GPU LOCAL_RANK (else `rank`), NCCL, and gloo on CPU.
    all_reduce: "nccl" (functional collectives: NCCL, or gloo on CPU), "symm" (symmetric-memory one-shot for
    small messages, NCCL above: examples/allreduce.py) or "auto" (symm on CUDA with torch's symmetric memory)."""
    if all_reduce not in ("auto", "nccl", "symm"):
        raise fgraph.FgraphError(f"tp.init: all_reduce={all_reduce!r}", "use 'auto', 'nccl' or 'symm'")
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
        cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
        kw = {}
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
            kw["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(
            backend or ("nccl" if cuda else "gloo"),
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            **kw,
        )
    group = dist.group.WORLD.group_name
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if all_reduce == "auto":
        all_reduce = "symm" if device.type == "cuda" and dist.get_world_size() > 1 and _has_symm_mem() else "nccl"
    if all_reduce == "symm":
        allreduce.setup(group, device)
    return TP(dist.get_rank(), dist.get_world_size(), group, all_reduce)


def _has_symm_mem() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")


# ------------------------------------------------------------------------------------------------ sharding
def local_config(cfg: llama.LlamaConfig, world: int) -> llama.LlamaConfig:
    """The config one rank runs: its share of the q heads, KV heads and MLP columns (the vocab stays whole)."""
    if type(cfg) is not llama.LlamaConfig:
        raise fgraph.FgraphError(
            f"tensor parallelism: {type(cfg).__name__} is not supported (dense Llama/Qwen2/Mistral only)",
            "run MoE models with an expert-parallel moe_backend (allgather, all2all) instead",
        )
    Hq, Hkv, I = cfg.n_heads, cfg.n_kv_heads, cfg.intermediate
    if Hq % world or (Hkv % world and world % Hkv) or I % world:
        raise fgraph.FgraphError(
            f"tensor parallelism over {world} ranks: {Hq} q heads, {Hkv} KV heads and "
            f"{I} MLP columns must split evenly (KV heads may instead be replicated when {world} "
            f"is a multiple of them)",
            "pick a world size that divides them",
        )
    return attrs.evolve(cfg, n_heads=Hq // world, n_kv_heads=max(Hkv // world, 1), intermediate=I // world)


def sharder(cfg: llama.LlamaConfig, tp: TP):
    """`(what, value) -> this rank's shard` for checkpoint.assemble's `shard` hook; what: "layer" (a full
    llama.Layer), "embed" or "lm_head" ([V, dim]). Slices are copied so the full tensors can be freed."""
    local_config(cfg, tp.world)  # checks the split
    D, Hq, Hkv, I, r, W = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate, tp.rank, tp.world
    hq, hkv, il, vl = Hq // W, max(Hkv // W, 1), I // W, -(-cfg.vocab_size // W)
    q0 = r * hq
    kv0 = q0 // (Hq // Hkv)  # the KV head of this rank's first q head: its group's, replicated when Hkv < W
    q = slice(q0 * D, (q0 + hq) * D)
    k = slice((Hq + kv0) * D, (Hq + kv0 + hkv) * D)
    v = slice((Hq + Hkv + kv0) * D, (Hq + Hkv + kv0 + hkv) * D)
    cols = slice(r * il, (r + 1) * il)

    def rows(t, *parts):
        return torch.cat([t[p] for p in parts]).contiguous()

    def shard(what, x):
        if what in ("embed", "lm_head"):  # [V, dim] -> [Vl, dim]
            out = x.new_zeros(vl, x.shape[1])
            part = x[r * vl : (r + 1) * vl]
            out[: part.shape[0]] = part
            return out
        return attrs.evolve(
            x,
            wqkv=rows(x.wqkv, q, k, v),
            bqkv=None if x.bqkv is None else rows(x.bqkv, q, k, v),
            wo=x.wo[:, q].contiguous(),
            w13=rows(x.w13, cols, slice(I + cols.start, I + cols.stop)),
            w2=x.w2[:, cols].contiguous(),
        )

    return shard


def shard_params(params: llama.Params, cfg: llama.LlamaConfig, tp: TP) -> llama.Params:
    """Full params (e.g. llama.init_params, the same seed on every rank) -> this rank's shard."""
    s = sharder(cfg, tp)
    return attrs.evolve(
        params,
        embed=s("embed", params.embed),
        layers=[s("layer", l) for l in params.layers],
        lm_head=None if params.lm_head is None else s("lm_head", params.lm_head),
    )


def load(
    model_dir: str, tp: TP, dtype=None, device="cpu", allow_unused: bool = False
) -> tuple[llama.LlamaConfig, llama.Params]:
    """A full HF checkpoint -> (the global config, this rank's shard), one layer at a time."""
    cfg = checkpoint.read_config(model_dir)
    return checkpoint.load(model_dir, dtype, device, shard=sharder(cfg, tp), allow_unused=allow_unused)


def make_step(cfg: llama.LlamaConfig, tp: TP, backend: str = "torch", max_seq_len: int | None = None):
    """This rank's pure step (global config in): llama's forward on the local config, with tp's collectives."""
    return llama.make_step(local_config(cfg, tp.world), backend, max_seq_len, tp=tp)


# ------------------------------------------------------------------------------------------------ engine
class TPEngine(engine.Engine):
    """An Engine per rank, in lockstep: every rank serves the same requests and takes rank 0's tokens, and
    (verify) each step checks first that every rank runs the same N and routine, so the same signature (bucket,
    graphs, collectives) everywhere."""

    def __init__(self, *a, tp: TP, verify: bool = True, **kw):
        self.tp, self.verify = tp, verify
        super().__init__(*a, **kw)

    def run_batch(self, batch: llama.Batch, routine: str) -> torch.Tensor:
        if self.verify:
            n, r = batch.tokens.shape[0], int(routine == "decode")
            got = funcol.all_reduce(torch.tensor([n, -n, r, -r], device=self.device), "max", self.tp.group).tolist()
            if got[0] != -got[1] or got[2] != -got[3]:
                raise fgraph.FgraphError(
                    f"rank {self.tp.rank} of {self.tp.world}: step {self.steps} runs {n} tokens "
                    f"({routine}), another rank's differs; its collectives would wait forever",
                    "give every rank the same requests in the same order (TPEngine.add on all)",
                )
        return super().run_batch(batch, routine)

    def choose(self, logits: torch.Tensor, ready) -> list[int]:
        new = torch.tensor(super().choose(logits, ready), device=self.device)
        return funcol.broadcast(new, 0, self.tp.group).tolist()  # one choice, even if sampling diverged


def build(cfg: llama.LlamaConfig, params: llama.Params, tp: TP, verify: bool = True, **kw) -> TPEngine:
    """examples.engine.build for one rank (global config, this rank's params): its KV heads in the cache, its
    step, a TPEngine; the other keywords are engine.build's."""
    return engine.build(
        local_config(cfg, tp.world),
        params,
        make_step=functools.partial(llama.make_step, tp=tp),
        cls=functools.partial(TPEngine, tp=tp, verify=verify),
        **kw,
    )


# ------------------------------------------------------------------------------------------------ processes
def _rank_main(rank, fn, world, args, init_method, backend, result, all_reduce="auto"):
    torch.set_num_threads(max(1, torch.get_num_threads() // world))  # ranks share the host's cores
    # tqdm's default lock holds a multiprocessing semaphore, which _exit_cleanly's os._exit never releases: the
    # resource tracker warned of leaks at the end of every tensor-parallel run
    tqdm.std.tqdm.set_lock(threading.RLock())
    tp = init(rank, world, init_method, backend, timeout_s=600, all_reduce=all_reduce)
    try:
        out = fn(tp, *args)
        if rank == 0:
            with open(result, "wb") as f:
                pickle.dump(out, f)
    finally:
        gc.collect()  # graphs captured with the communicator go before it (fgraph's objects hold cycles)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.destroy_process_group()
    _exit_cleanly()


def _exit_cleanly():
    """End a rank whose work is done and saved without the interpreter's teardown: there a gloo rank was seen to
    abort after every check had passed ("terminate called without an active exception": a library thread still
    joinable at exit), which the parent reads as a failed rank. An exception above never gets here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _join(ctx, timeout: float) -> bool:
    """ctx.join, with a grace period: ranks that fail alike (they run in lockstep) each end on their own, not
    SIGTERMed, and the exception carries every rank's exit code (`exit_codes`)."""
    try:
        return ctx.join(timeout=timeout, grace_period=10.0)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        e.exit_codes = [p.exitcode for p in ctx.processes]
        raise


def launch(fn, world: int, *args, timeout_s: float | None = None, backend: str | None = None, all_reduce: str = "auto"):
    """Run `fn(tp, *args)` in `world` spawned processes, one per rank (fn: a module-level function); returns
    rank 0's result (all_reduce: as `init` takes it). A rank's exception is re-raised here; past `timeout_s`
    every rank is killed (a rank stuck in a collective never returns) and this raises."""
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "result.pkl")
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, world, args, f"file://{d}/store", backend, result, all_reduce),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + (timeout_s or float("inf"))
        try:
            while not _join(ctx, min(1.0, max(0.01, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise fgraph.FgraphError(
                        f"tensor-parallel launch: {world} ranks did not finish in {timeout_s} s "
                        "(a rank waiting in a collective the others never joined?); killed them",
                        "feed every rank identical batches (see examples/tp.py), or raise timeout_s",
                    )
        finally:
            for p in ctx.processes:  # only the ranks started here
                if p.is_alive():
                    p.kill()
                    p.join()
        with open(result, "rb") as f:
            return pickle.load(f)
