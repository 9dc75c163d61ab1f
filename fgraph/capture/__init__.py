"""The capture stage: a checked program becomes graphs and buffers.

Per signature an `Entry` (its program's own top level, its graphs, input buffers and counters) that warms up,
captures (PIECEWISE: a graph per piece between breaks; FULL: one graph) and runs calls; CUDA graphs that own their
memory and workspaces; the input buffers batched leaves are padded into; the `Slots` a graph reads by address (in
place or copied); Inductor compiling pieces before capture, their small matmuls as `fgraph::linear` (gated
activations and the RMSNorms they read inside them: `fgraph::linear_glu`, `fgraph::norm_linear`).
"""

from ._buffers import DoneEvent as DoneEvent
from ._entry import Entry as Entry
from ._entry import Stats as Stats
from ._gemv import counts as linear_counts  # noqa: F401 (fgraph::linear's picks, by name here)
from ._graphs import CudaGraph as CudaGraph
from ._graphs import capture_session as capture_session
from ._graphs import new_pool as new_pool
from ._graphs import ran as ran
from ._inductor import CompileFailed as CompileFailed
from ._inductor import compiler as compiler
from ._inductor import inductor_options as inductor_options
from ._slots import Slots as Slots
from ._small_m import kernels_made as kernels_made
