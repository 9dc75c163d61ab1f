"""fgraph: JAX-style functional tracing over PyTorch that captures CUDA graphs per static signature.

The stages a call goes through, each a folder: `fgraph.trace` (a call becomes a checked program), `fgraph.padding`
(what padding a call to its bucket can change), `fgraph.capture` (the program becomes graphs and buffers); break
primitives plug in through `fgraph.extend`, and fgraph's own live in `fgraph.ops`.
"""

from ._config import config as config
from ._errors import CaptureError as CaptureError
from ._errors import EscapeError as EscapeError
from ._errors import FgraphError as FgraphError
from ._errors import RunError as RunError
from ._errors import SignatureError as SignatureError
from ._errors import TraceError as TraceError
from ._modes import Mode as Mode
from ._primitives import PlanCall as PlanCall
from ._primitives import Primitive as Primitive
from ._primitives import Support as Support
from ._primitives import primitive as primitive
from ._pytree import field as field
from ._pytree import register as register
from ._signature import Aval as Aval
from ._signature import Batched as Batched
from ._signature import Signature as Signature
from ._signature import default_buckets as default_buckets
from .function import Jitted as Jitted
from .function import disable_jit as disable_jit
from .function import explain as explain
from .function import jit as jit
from .trace import Piece as Piece
from .trace import Program as Program
from .trace import repeated as repeated
