"""One error base class; every message says what, where (function, key path, line) and one fix."""

from __future__ import annotations


class FgraphError(Exception):
    """Base of fgraph's errors. `str(e)` = what went wrong, then 'Fix: ...'."""

    def __init__(self, what: str, fix: str | None = None):
        self.what, self.fix = what, fix
        super().__init__(what + (f"\nFix: {fix}" if fix else ""))


class TraceError(FgraphError):
    """The function cannot be traced into a static graph (host sync, value-dependent control flow, ...)."""


class SignatureError(FgraphError):
    """A call's arguments do not fit the function's declared statics, buckets or captured signatures."""


class CaptureError(FgraphError):
    """A configuration that cannot be captured (e.g. a NEVER-capturable primitive kept inside a graph)."""
