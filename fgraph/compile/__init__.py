"""The compile stage: a signature's graph pieces compiled by Inductor before capture.

One compilation per distinct piece, symbolic in the batch axis and shared by every bucket, routine and layer whose
piece is the same graph (`compiler`, `Compiled`), checked against each call's sizes before it serves them
(`_assumed`); a CUDA piece's few-row matmuls rewritten into fgraph's own kernels first (`_small_m`, `fgraph.kernels`);
jit's compile= options checked (`inductor_options`).
"""

from ._assumed import Compilation as Compilation
from ._assumed import restored as restored
from ._inductor import Compiled as Compiled
from ._inductor import CompileFailed as CompileFailed
from ._inductor import compiler as compiler
from ._inductor import inductor_options as inductor_options
from ._inductor import residual_adds_out_of_gemms as residual_adds_out_of_gemms
from ._small_m import kernels_made as kernels_made
