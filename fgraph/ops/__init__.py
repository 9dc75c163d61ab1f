"""Break primitives: fgraph's own (`attention`, `moe`), and the op-author API to write one.

The op-author API is `fgraph.extend`, re-exported here."""

from fgraph.extend import Aval as Aval
from fgraph.extend import Batched as Batched
from fgraph.extend import FgraphError as FgraphError
from fgraph.extend import PlanCall as PlanCall
from fgraph.extend import Primitive as Primitive
from fgraph.extend import Support as Support
from fgraph.extend import executing as executing
from fgraph.extend import once_per_execution as once_per_execution
from fgraph.extend import primitive as primitive

from . import attention as attention
from . import moe as moe
