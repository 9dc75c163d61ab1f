"""One error base class; every message says what, where (function, key path, line), one fix, and its docs page."""

from __future__ import annotations

# The way out of a transformers cache that grows per call (a DynamicCache), for every error that meets one: the class
# is code the user cannot change, so the fix is how the model is called
GROWING_CACHE_FIX = (
    "use a fixed-size cache written in place: transformers' generate(..., "
    'cache_implementation="static") or a StaticCache; or no cache: use_cache=False'
)


def transformers_cache(obj) -> bool:
    """Whether `obj` is one of transformers' KV caches (DynamicCache, StaticCache, ...): a subclass of its Cache."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(obj).__mro__)


class FgraphError(Exception):
    """Base of fgraph's errors. `str(e)` = what went wrong, then 'Fix: ...', then 'See: docs/errors.md#<class>'.

    A new subclass needs a section of its own in docs/errors.md, headed by its name (the anchor is the class name
    in lower case)."""

    def __init__(self, what: str, fix: str | None = None):
        self.what, self.fix = what, fix
        see = f"\nSee: docs/errors.md#{type(self).__name__.lower()}"
        super().__init__(what + (f"\nFix: {fix}" if fix else "") + see)


class TraceError(FgraphError):
    """The function cannot be traced into a static graph (host sync, value-dependent control flow, ...)."""


class SignatureError(FgraphError):
    """A call's arguments do not fit the function's declared statics, buckets or captured signatures."""


class CaptureError(FgraphError):
    """A configuration that cannot be captured (e.g. a NEVER-capturable primitive kept inside a graph), or a CUDA
    graph capture that failed."""


class RunError(FgraphError):
    """The traced program failed when run on real tensors before any graph was recorded: the warm-up before a
    capture, or the first run on the CPU, where nothing is captured (an index out of range, which fake tensors do
    not check while tracing)."""


class EscapeError(TraceError):
    """A value made while tracing left the trace (stored in a global, closure, attribute, hook or logger), or such
    a value was later used (jax.jit's UnexpectedTracerError)."""
