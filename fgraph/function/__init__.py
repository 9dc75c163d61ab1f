"""A jitted function: its options, its per-function state (signatures, traces, graphs, the replay path's keys) and
the call path that binds a call, finds or makes its signature and runs it; `explain` and `lower` read that state.
"""

from ._cache import Cache as Cache
from ._explain import explain as explain
from ._fastpath import guard_for as guard_for
from ._jit import OPTIONS as OPTIONS
from ._jit import Jitted as Jitted
from ._jit import disable_jit as disable_jit
from ._jit import jit as jit
from ._options import Options as Options
from ._shared import forget_all as forget_all
