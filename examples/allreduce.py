"""The tensor-parallel all-reduce on GPUs: torch's symmetric-memory one-shot all-reduce for the small messages of
a decode or mixed step, NCCL for the rest, as one traceable op that CUDA graphs capture.

A decode step of a TP model all-reduces a [N, dim] activation twice per layer (after the attention output and
the MLP down projections) plus once for the embedding: 65 messages of a few KiB to a few MiB for Llama-3-8B.
NCCL's ring all-reduce spends most of its time on launch and protocol latency at these sizes. The one-shot
all-reduce instead has every rank read its peers' buffers directly over NVLink (symmetric memory: each rank's
workspace is mapped into every other rank's address space) and sum them, behind a barrier on signal pads at
entry (every peer has written its input) and at exit (every peer is done reading before the workspace is
reused). It needs no NVLink multicast (NVLS), which the machine keeps off for NCCL.

`symm_all_reduce(x, group)` is a `torch.library` custom op with a fake rule, so fgraph traces it as one node
inside the graph pieces (it is not a break): eager, PIECEWISE and FULL graphs all run the same kernels.
Messages up to ONE_SHOT_MAX_BYTES go one-shot through the group's workspace (made by `setup`); larger ones, or a
group without a workspace, go through NCCL's functional all-reduce, as before.
"""

from __future__ import annotations

import torch

import fgraph

# A world-2 one-shot reads one peer's message over NVLink: it stays ahead of NCCL's ring well past decode sizes
# (8B: [64, 4096] bf16 = 512 KiB); a mixed step of 512 tokens is 4 MiB.
ONE_SHOT_MAX_BYTES = 8 << 20

_WORKSPACES: dict[str, torch.Tensor] = {}  # group name -> this rank's symmetric workspace (uint8)


def setup(group: str, device: torch.device, nbytes: int = ONE_SHOT_MAX_BYTES) -> None:
    """Allocate and map this rank's symmetric workspace for `group`. Collective: every rank of the group calls
    it, with the same size, before any step that all-reduces through it is traced or run."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        raise fgraph.FgraphError(
            f"all_reduce='symm': torch {torch.__version__} has no symmetric memory ({e})",
            "use all_reduce='nccl' (the default on torch without it)",
        ) from None
    if device.type != "cuda":
        raise fgraph.FgraphError(
            f"all_reduce='symm' needs CUDA devices; this rank runs on {device}",
            "use all_reduce='nccl' (gloo on CPU)",
        )
    if group in _WORKSPACES:
        return
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buf, group)
    _WORKSPACES[group] = buf


def one_shot(nbytes: int, group: str) -> bool:
    """Whether a message of `nbytes` goes one-shot (else NCCL): the rule `symm_all_reduce` applies per call."""
    ws = _WORKSPACES.get(group)
    return ws is not None and nbytes <= ws.numel() and nbytes % 16 == 0


@torch.library.custom_op("fgraph_examples::symm_all_reduce", mutates_args=())
def symm_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of `x` over the ranks of `group` (a new tensor, like funcol.all_reduce)."""
    x = x.contiguous()
    nbytes = x.numel() * x.element_size()
    if not one_shot(nbytes, group):
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group))
    slot = _WORKSPACES[group][:nbytes].view(x.dtype).view(x.shape)  # offset 0: aligned for the vector loads
    out = torch.empty_like(x)
    ops = torch.ops.symm_mem
    if hasattr(ops, "one_shot_all_reduce_copy_out"):  # the copy into the workspace inside the same kernel
        ops.one_shot_all_reduce_copy_out(slot, x, "sum", group, out)
    else:
        slot.copy_(x)
        ops.one_shot_all_reduce_out(slot, "sum", group, out)
    return out


@symm_all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
