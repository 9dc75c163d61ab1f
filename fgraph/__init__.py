"""fgraph: JAX-style functional tracing over PyTorch that captures CUDA graphs per static signature."""

from ._errors import CaptureError as CaptureError, FgraphError as FgraphError
from ._errors import SignatureError as SignatureError, TraceError as TraceError
from ._explain import explain as explain
from ._jit import Jitted as Jitted, config as config, disable_jit as disable_jit, jit as jit
from ._primitives import PlanCall as PlanCall, Primitive as Primitive, Support as Support
from ._primitives import primitive as primitive
from ._pytree import field as field, register as register
from ._repeated import repeated as repeated
from ._signature import Aval as Aval, Batched as Batched, Signature as Signature, default_buckets as default_buckets
from ._split import Mode as Mode, Piece as Piece, Program as Program
