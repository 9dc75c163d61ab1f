"""The trace stage: a call becomes a checked program.

make_fx with the batch axis traced as a symbol (`trace`), the checks a trace must pass (host syncs, writes into
arguments not donated: `check`), errors that name the user's line and key paths, `repeated`, the callable and the
tensors it reads without taking them (`Lifted`, `invoke`), the split at break primitives (`split`, `Program`), and
`Traced`: one trace, checked and split, shared by the signatures it fits; other libraries' ops a CUDA graph cannot
hold, traced as device-only equivalents (`foreign_decompositions`); torch 2.11's fake slices as 2.12's while fgraph
traces and compiles (`fake_slices`).
"""

from ._autograd import check_transforms as check_transforms
from ._autograd import refuse_backward as refuse_backward
from ._callable import Inlined as Inlined
from ._callable import LazyParameters as LazyParameters
from ._callable import Lifted as Lifted
from ._callable import check_call as check_call
from ._callable import context as context
from ._callable import describe as describe
from ._callable import invoke as invoke
from ._callable import plain_signature as plain_signature
from ._foreign import foreign_decompositions as foreign_decompositions
from ._foreign import grouped_mm_by_expert as grouped_mm_by_expert
from ._lifted_view import LiftedView as LiftedView
from ._make import tracing as tracing
from ._repeated import repeated as repeated
from ._slice_compat import fake_slices as fake_slices
from ._split import Piece as Piece
from ._split import Program as Program
from ._split import op_summary as op_summary
from ._split import split as split
from ._state_change import InitialisesState as InitialisesState
from ._state_change import initialises as initialises
from ._state_change import uninitialised as uninitialised
from ._traced import Traced as Traced
