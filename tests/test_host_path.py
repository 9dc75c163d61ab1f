"""The host work around a replayed call does only what the call needs, and each shortcut holds exactly where its
check says: a one-piece program replays its graph alone, copies go by a plan made once per copied set, and the
replay path's alias check re-reads the written tensors' storages whenever they are other tensors."""

import pytest
import torch

import fgraph


def write(x, s):
    s["h"].add_(1)
    return x * 2


@torch.no_grad()
def test_a_fresh_tensor_over_memory_the_program_writes_is_refused_after_the_written_tensors_change():
    """The replay path keeps the storages a program writes per entry while the same written tensors are passed; a
    state passed as other tensors is read again, so a fresh input over its memory is refused as the slow path
    refuses it (a stale set would let the program write under a tensor it also reads)."""
    f = fgraph.jit(write, donate=["s"], mode="PIECEWISE")
    h = torch.zeros(4)
    for _ in range(3):
        f(torch.ones(4), {"h": h})  # the state passed as new dicts: read afresh by the replay path
    fast = f.stats()["total"]["fast"]
    for _ in range(2):
        h = torch.zeros(4)  # other written tensors
        f(torch.ones(4), {"h": h}), f(torch.ones(4), {"h": h})
    assert f.stats()["total"]["fast"] > fast
    with pytest.raises(fgraph.SignatureError):
        f(h[:4], {"h": h})
