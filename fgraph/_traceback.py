"""fgraph's errors show the user's frames, as JAX's traceback_util does: fgraph's and torch's own are left out.

An error raised while tracing unwinds through torch.fx's tracer, fake tensors' dispatch and fgraph's call path: a
hundred frames or more around the few of the user's (the function's own lines, and a library's it calls, such as
transformers'). None of them is where a fix goes. The whole traceback, and the torch error a trace error was made
from, are one switch away: `fgraph.config.traceback_filtering = False`, or `FGRAPH_TRACEBACK_FILTERING=off` in the
environment (read when an error is raised)."""

from __future__ import annotations

import functools
import os
import types

from . import _fx
from ._config import config
from ._errors import FgraphError


def filtering() -> bool:
    """Whether fgraph's errors are cut to the user's frames (both switches on)."""
    return config.traceback_filtering and os.environ.get("FGRAPH_TRACEBACK_FILTERING", "on").lower() != "off"


def cause(e: BaseException) -> BaseException | None:
    """What to raise an fgraph error `from` that is made from torch's error `e` (the message quotes what matters).

    Unfiltered, `e`; filtered, None, so that no torch error and its frames come before fgraph's message."""
    return e if not filtering() else None


def frames_of(e: BaseException):
    """The traceback for an fgraph error made from torch's error `e`: filtered, e's own, so that the user's lines that
    led to it show, since e is not chained; unfiltered, None (the error's own, with e chained as its cause)."""
    return e.__traceback__ if filtering() else None


def filter_traceback(e: BaseException) -> None:
    """Drop torch's and fgraph's frames from `e.__traceback__`, unless filtering is off.

    Called where an fgraph error leaves a jitted call; frames above it are added as it unwinds further."""
    if not filtering():
        return
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    inside = [_fx.in_framework(t.tb_frame.f_code.co_filename) for t in frames]
    for i, t in enumerate(frames):
        # code torch generates (make_fx's `<lambda>` in `<string>`) runs in globals of no module, between torch's
        # frames; a user's code without a file (`python -c`, a notebook cell) runs in __main__'s
        f = t.tb_frame
        if f.f_code.co_filename.startswith("<") and f.f_globals.get("__name__") is None and 0 < i < len(frames) - 1:
            inside[i] = inside[i - 1] and inside[i + 1]
    kept = None
    for t, drop in zip(reversed(frames), reversed(inside)):
        if not drop:
            kept = types.TracebackType(kept, t.tb_frame, t.tb_lasti, t.tb_lineno)
    e.__traceback__ = kept


class _UserFrames:
    """`with user_frames:` around a call into fgraph: an fgraph error leaves it with the user's frames only.

    (__exit__ edits the error's traceback and lets it go on: the with statement re-raises it as it is, adding no
    frame of its own.)"""

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if isinstance(e, FgraphError):
            filter_traceback(e)
        return False


user_frames = _UserFrames()


def boundary(fn):
    """`fn`, an entry point of fgraph's (capture, explain), whose fgraph errors leave with the user's frames only."""

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        with user_frames:
            return fn(*args, **kwargs)

    return entry
