"""The padding stage: what padding a call to its bucket can change in a traced program.

The batch symbols of a symbolic trace (`BatchAxes`), the mixing rules (a table keyed by op: padded rows reaching
real ones), the index flow they follow, random draws, the lengths a trace ties together, and how each output is
cut back to the unpadded call's size.
"""

from ._bounds import check_bounds as check_bounds
from ._bounds import declare_fix as declare_fix
from ._bounds import holds as holds
from ._bounds import index_bounds as index_bounds
from ._index_flow import Flow as Flow
from ._mixing import BatchAxes as BatchAxes
from ._mixing import Finding as Finding
from ._mixing import check_aliases as check_aliases
from ._mixing import check_lengths as check_lengths
from ._mixing import find_mixing as find_mixing
from ._mixing import size_guards as size_guards
from ._mixing import tied_lengths as tied_lengths
from ._outputs import cut_error as cut_error
from ._outputs import output_rows as output_rows
from ._outputs import output_sizes as output_sizes
from ._outputs import refuse_formatted_sizes as refuse_formatted_sizes
from ._outputs import refuse_opaque_outputs as refuse_opaque_outputs
from ._outputs import refuse_shrinking_outputs as refuse_shrinking_outputs
from ._random import random_draws as random_draws
