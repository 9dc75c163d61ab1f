"""fgraph.jit's compile= default: Inductor-compiled pieces on CUDA (fgraph.config.compile_cuda), uncompiled graphs
elsewhere; `explain` and the capture summary say which is in effect. Under the default a signature whose piece
Inductor fails on runs uncompiled graphs, logged once and counted; compile= asked for by name makes it an error."""

import pytest
import torch

import fgraph
from fgraph.compile import compiler
from fgraph.function import Options

W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


def f(x, w):
    return torch.tanh(x @ w) * 2 + 1


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(n))


def test_the_default_compiles_cuda_signatures_only_while_its_switch_is_on(monkeypatch):
    monkeypatch.setattr(fgraph.config, "compile_cuda", True)  # (its default: the suite turns it off, conftest.py)
    opts = fgraph.jit(f).options
    assert opts.compile_default
    assert opts.compile_for("cuda:0") == {} and opts.compile_for("cpu") is None
    assert opts.compile_text("cuda:0").startswith("Inductor (the default on CUDA")
    assert opts.compile_text("cpu") == "uncompiled graphs (the default on cpu; compile=True: Inductor)"
    monkeypatch.setattr(fgraph.config, "compile_cuda", False)
    assert opts.compile_for("cuda:0") is None
    assert "fgraph.config.compile_cuda is off" in opts.compile_text("cuda:0")


@pytest.mark.parametrize(
    "given, want, text",
    [
        (False, None, "uncompiled graphs (compile=False)"),
        (True, {}, "Inductor (compile=True)"),
        ({"max_autotune": False}, {"max_autotune": False}, "Inductor (compile={'max_autotune': False})"),
    ],
)
def test_a_compile_given_by_name_holds_on_every_device(given, want, text):
    opts = fgraph.jit(f, compile=given).options
    assert not opts.compile_default
    for device in ("cpu", "cuda:0"):
        assert opts.compile_for(device) == want and opts.compile_text(device) == text


def test_explain_and_the_capture_summary_say_which_is_in_effect(capsys):
    j = fgraph.jit(f, batch={"x": fgraph.Batched()}, buckets=[4])
    j.capture(rows(4), W)
    assert "; uncompiled graphs (the default on cpu; compile=True: Inductor)" in capsys.readouterr().err
    assert "  compile: uncompiled graphs (the default on cpu; compile=True: Inductor)" in str(fgraph.explain(j))
    assert "  compile: uncompiled graphs (compile=False)" in str(fgraph.explain(fgraph.jit(f, compile=False), W, W))


def failing(monkeypatch) -> list:
    """Inductor raising on every piece; the list counts its attempts."""
    attempts = []

    def lowering_fails(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("lowering failed")

    monkeypatch.setattr(compiler, "_assumed", lowering_fails)
    return attempts


def test_under_the_default_a_signature_inductor_fails_on_runs_uncompiled_logged_once_and_counted(monkeypatch, caplog):
    # (the default as on CUDA, here on the CPU: Inductor asked to compile every signature's pieces)
    monkeypatch.setattr(Options, "compile_for", lambda self, device: {} if self.compile_default else self.compile)
    attempts, failed = failing(monkeypatch), compiler.counts["failed"]
    j = fgraph.jit(f, batch={"x": fgraph.Batched()}, buckets=[2, 4])
    for n in (1, 3, 2, 4, 1):
        x = rows(n)
        assert torch.equal(j(x, W), f(x, W))
    assert len(attempts) == 1  # (a piece Inductor failed on is not compiled again for the next bucket)
    assert compiler.counts["failed"] == failed + 2  # each signature: buckets 2 and 4
    assert len(j.entries) == 2 and all(not e.compiled and e.uncompiled for e in j.entries.values())
    text = str(fgraph.explain(j))
    assert text.count("  uncompiled: Inductor failed on piece") == 2 and "RuntimeError: lowering failed" in text
    assert len([r for r in caplog.records if "runs uncompiled graphs" in r.getMessage()]) == 1


def test_a_compile_asked_for_by_name_that_inductor_fails_on_is_a_capture_error(monkeypatch):
    failing(monkeypatch)
    j = fgraph.jit(f, compile=True)
    with pytest.raises(fgraph.CaptureError, match=r"compile=True\).*RuntimeError: lowering failed") as e:
        j(rows(3), W)
    assert "compile=False" in e.value.fix and not j.entries
