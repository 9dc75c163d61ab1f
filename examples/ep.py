"""Expert parallelism for the MoE decoder (examples/qwen2_moe.py): data-parallel attention, experts sharded over
the ranks of the default process group (fgraph.ops.moe's allgather / all2all backends), and the engine that keeps
the ranks' steps paired. Process setup and launch are tensor parallelism's (examples/tp.py: init, launch).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from . import engine
from .request import Request
from .tp import TP


class EPEngine(engine.Engine):
    """An Engine per rank for expert parallelism (data-parallel attention, experts sharded): each rank serves its
    own requests, yet the MoE collectives pair every rank's steps, and allgather's sizes (inside the graphs) must
    match. So every step the ranks agree, in one small all-reduce, on the token count N (the largest) and the
    routine ("mixed" if any rank prefills); a rank pads its batch to N with one-token sequences on the scratch
    page, or runs a step of padding alone when it has nothing to do, until no rank has work (vLLM pads
    data-parallel ranks the same way: num_tokens_across_dp, dummy batches). Its steps go one by one (a step
    agrees before it schedules), not overlapped. A step that fails is undone on its rank only: the ranks' next
    agreements then disagree, so a fault is not recoverable across ranks (restart them all)."""

    overlap_supported = False

    def __init__(self, *a, tp: TP, **kw):
        self.tp = tp
        self._anyone_busy = None  # what the last step's agreement said, for the run loop's next busy()
        super().__init__(*a, **kw)

    def _agree(self, n: int, mixed: bool, busy: bool) -> list[int]:
        t = torch.tensor([n, int(mixed), int(busy)], device=self.device)
        return funcol.all_reduce(t, "max", self.tp.group).tolist()  # (a host sync: one per step, not two)

    def busy(self) -> bool:
        """Whether any rank has work: every rank steps until none has. Right after a step, the answer that step's
        agreement gave (any rank busy as it began: at worst one step of padding more at the end); otherwise (a new
        run) an agreement of its own."""
        anyone, self._anyone_busy = self._anyone_busy, None
        return bool(self._agree(0, False, super().busy())[2]) if anyone is None else anyone

    def _step(self) -> list[Request]:
        busy = super().busy()

        def body():
            plan = self.schedule()
            n = sum(k for _, k in plan)
            N, mixed, anyone = self._agree(n, any(k != 1 for _, k in plan), busy)
            self._anyone_busy = bool(anyone)
            if N == 0:
                return []
            batch = self.make_batch(plan, pad_to=N)
            return self.advance(plan, self.run_batch(batch, "mixed" if mixed else "decode"))

        return self._atomic(body)
