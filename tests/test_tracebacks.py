"""An fgraph error raised while tracing shows the user's frames and fgraph's message (JAX's traceback filtering):
no torch.fx or fake-tensor frames, no fgraph frames, no raw torch error chained before it; the whole traceback and
chain are one switch away (fgraph.config.traceback_filtering, FGRAPH_TRACEBACK_FILTERING=off)."""

import os
import traceback

import pytest
import torch

import fgraph
from fgraph import Batched

FGRAPH, TORCH = os.path.dirname(fgraph.__file__), os.path.dirname(torch.__file__)


def shown(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))


def files(e: BaseException) -> list[str]:
    """The file of every frame of e's traceback and of the exceptions chained to it."""
    out = []
    while e is not None:
        out += [f.filename for f in traceback.extract_tb(e.__traceback__)]
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def branches(x):
    if x.sum() > 0:  # Python control flow on a tensor value
        x = x * 2
    return x


def mismatched(x, w):
    return x @ w  # a shape error, found by torch while tracing


def test_a_trace_error_shows_the_callers_line_the_functions_line_and_the_message():
    with pytest.raises(fgraph.TraceError) as e:
        fgraph.jit(branches)(torch.ones(3))
    text = shown(e.value)
    assert len(text.splitlines()) <= 12, text  # unfiltered: ~70 lines of torch.fx and fgraph frames
    assert files(e.value) == [__file__, __file__]  # this test's call, then `if x.sum() > 0:`
    assert "if x.sum() > 0:" in text and text.rstrip().endswith("See: docs/errors.md#traceerror")


def test_a_torch_error_while_tracing_is_quoted_not_chained():
    """torch's shape error is raised inside its meta kernel, a hundred frames under the user's `x @ w`: the message
    quotes it with the batch axis named; the frames shown are the user's."""
    with pytest.raises(fgraph.TraceError) as e:
        fgraph.jit(mismatched, batch={"x": Batched()}, buckets=[8])(torch.randn(3, 4), torch.randn(5, 4))
    text = shown(e.value)
    assert e.value.__cause__ is None and "The above exception" not in text and "RuntimeError:" not in text
    assert len(text.splitlines()) <= 14, text  # unfiltered: ~130 lines, torch's RuntimeError first
    assert files(e.value) == [__file__, __file__] and "return x @ w" in text
    assert "got [(batch axis of `x`), 4] X [5, 4]" in e.value.what
    assert "FGRAPH_TRACEBACK_FILTERING=off" in e.value.fix  # where torch's own error is


@pytest.mark.parametrize("switch", ["config", "environment"])
def test_one_switch_restores_the_whole_traceback_and_torchs_error(monkeypatch, switch):
    if switch == "config":
        monkeypatch.setattr(fgraph.config, "traceback_filtering", False)
    else:
        monkeypatch.setenv("FGRAPH_TRACEBACK_FILTERING", "off")
    with pytest.raises(fgraph.TraceError) as e:
        fgraph.jit(branches)(torch.ones(3))
    assert any(f.startswith(FGRAPH) for f in files(e.value)) and any(f.startswith(TORCH) for f in files(e.value))
    with pytest.raises(fgraph.TraceError) as e:
        fgraph.jit(mismatched, batch={"x": Batched()}, buckets=[8])(torch.randn(3, 4), torch.randn(5, 4))
    assert isinstance(e.value.__cause__, RuntimeError)  # torch's own error, chained
    assert "The above exception was the direct cause" in shown(e.value)
    assert "torch's error is chained as the cause" in e.value.fix


def test_capture_and_explain_cut_their_errors_to_the_users_frames():
    f = fgraph.jit(branches, batch={"x": Batched()}, buckets=[2])
    for run in (lambda: fgraph.explain(f, torch.ones(2)), lambda: f.capture(torch.ones(2), progress=False)):
        with pytest.raises(fgraph.TraceError) as e:
            run()
        assert not any(f.startswith((FGRAPH, TORCH)) for f in files(e.value)), shown(e.value)
        assert "if x.sum() > 0:" in shown(e.value)
