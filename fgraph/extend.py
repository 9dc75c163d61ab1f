"""The op-author API: what a break primitive's module imports from fgraph (fgraph.ops imports only this).

A primitive is registered with `@primitive(name, support=..., plan=...)`: the function writes a caller-provided
`out` (vLLM's `*_with_output` convention), `support` says whether it may sit inside a CUDA graph, and an optional
`plan` hook runs on the host before every execution with a `PlanCall`. Host state a backend builds per execution
(FlashInfer's plan, say) is keyed by `executing()` or built through `once_per_execution(key, compute)`, so a
warm-up, a capture and each replay get their own. `DoneEvent` tells when a replay that read a host buffer is done.
"""

from ._config import config as config
from ._config import pdl_args as pdl_args
from ._errors import FgraphError as FgraphError
from ._primitives import PlanCall as PlanCall
from ._primitives import Primitive as Primitive
from ._primitives import Support as Support
from ._primitives import executing as executing
from ._primitives import once_per_execution as once_per_execution
from ._primitives import primitive as primitive
from ._pytree import field as field
from ._pytree import register as register
from ._signature import Aval as Aval
from ._signature import Batched as Batched
from .capture import DoneEvent as DoneEvent


def pdl_prologue():
    """The Triton JIT function `after_prior(PDL)`, a kernel's first statement where it honours fgraph.config.pdl (its
    launch arguments: `pdl_args(t)`). Imports Triton."""
    from .kernels import pdl_prologue as prologue

    return prologue()
