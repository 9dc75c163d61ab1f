"""fgraph's own Triton kernels for compiled pieces: the `fgraph::linear` family (few-row matmuls, with a gated
activation, grouped over the same rows, or reading an RMSNorm), their tuner and the choices it keeps on disk,
`fgraph::sdpa_decode` (one query row's attention over a dense KV cache: a traced SDPA at decode), and
`after_prior` (`pdl_prologue()`), the programmatic-dependent-launch prologue every fgraph kernel opens with.

The attention's Triton kernels stay with their op (`fgraph.ops`): they are that op's backend, planned and dispatched
by it, and built on `fgraph.extend` alone like every op; these are called from the pieces Inductor compiles.
"""

from ._gemv import GROUP as GROUP
from ._gemv import MAX_ROWS as MAX_ROWS
from ._gemv import counts as linear_counts  # noqa: F401 (fgraph::linear's picks, by name here)
from ._gemv import seconds as linear_seconds  # noqa: F401 (its tuner's wall time)
from ._gemv_ops import compile_ahead as compile_ahead
from ._gemv_ops import glu_op as glu_op
from ._gemv_ops import group_op as group_op
from ._gemv_ops import norm_op as norm_op
from ._gemv_ops import op as op
from ._sdpa import op as sdpa_op  # noqa: F401 (fgraph::sdpa_decode, by name here)
from ._sdpa import serves as sdpa_serves  # noqa: F401
from ._workers import counts as compile_worker_counts  # noqa: F401 (candidates compiled in worker processes)


def pdl_prologue():
    """The Triton JIT function `after_prior(PDL)` (`_pdl`), imported on first use: importing it imports Triton."""
    from ._pdl import after_prior

    return after_prior
