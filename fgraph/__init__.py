"""fgraph: JAX-style functional tracing over PyTorch that captures CUDA graphs per static signature."""

from ._errors import CaptureError as CaptureError
from ._errors import FgraphError as FgraphError
from ._errors import SignatureError as SignatureError
from ._errors import TraceError as TraceError
from ._explain import explain as explain
from ._jit import Jitted as Jitted
from ._jit import config as config
from ._jit import disable_jit as disable_jit
from ._jit import jit as jit
from ._modes import Mode as Mode
from ._primitives import PlanCall as PlanCall
from ._primitives import Primitive as Primitive
from ._primitives import Support as Support
from ._primitives import primitive as primitive
from ._pytree import field as field
from ._pytree import register as register
from ._repeated import repeated as repeated
from ._signature import Aval as Aval
from ._signature import Batched as Batched
from ._signature import Signature as Signature
from ._signature import default_buckets as default_buckets
from ._split import Piece as Piece
from ._split import Program as Program
