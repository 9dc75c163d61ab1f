"""The capture stage: a checked program becomes graphs and buffers.

Per signature an `Entry` (its program's own top level, its graphs, input buffers and counters) that warms up,
captures (PIECEWISE: a graph per piece between breaks; FULL: one graph) and runs calls; CUDA graphs that own their
memory and workspaces; the input buffers batched leaves are padded into; the `Slots` a graph reads by address (in
place or copied). Compiled pieces (`fgraph.compile`) are made here, before a signature's warm-up.
"""

from ._buffers import DoneEvent as DoneEvent
from ._entry import Entry as Entry
from ._entry import Stats as Stats
from ._graphs import CudaGraph as CudaGraph
from ._graphs import abandoned as abandoned
from ._graphs import capture_session as capture_session
from ._graphs import new_pool as new_pool
from ._graphs import ran as ran
from ._graphs import refiller as refiller
from ._slots import Slots as Slots
