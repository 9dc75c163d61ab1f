"""Errors that point the right way (issue #31), on an unmodified tiny Hugging Face Llama and plain functions: an
undeclared batch input names itself and the fix, CaptureError is raised for captures only, the retrace warning for
a shape axis suggests Batched(axis=...) with buckets, and the padding warnings of sequence buckets are explained."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import fgraph
from fgraph import Batched, RunError, SignatureError
from tests.test_semantics import MODES

pytest.importorskip("transformers")

from examples import hf_llama as H  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return H.tiny_llama("cpu")


def ids(b, t, seed=1):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_an_undeclared_batch_input_names_itself_and_the_fix(llama, mode):
    x, mask = ids(3, 5), torch.ones(3, 5, dtype=torch.long)
    f = fgraph.jit(llama, batch={"input_ids": Batched(0)}, buckets=[4, 8], mode=mode)
    with pytest.raises(SignatureError) as e:
        f(input_ids=x, attention_mask=mask, use_cache=False)  # padded to 4 rows; the mask has 3
    assert "attention_mask [3, 5] is not declared Batched, but its dim 0 has 3 rows" in e.value.what
    assert "padded to the bucket 4" in e.value.what
    assert e.value.fix.startswith("declare it Batched(axis=0): batch={..., 'attention_mask': fgraph.Batched(axis=0)}")
    # the fix works: declared, the mask is padded with the ids and the call equals eager
    f = fgraph.jit(llama, batch={"input_ids": Batched(0), "attention_mask": Batched(0)}, buckets=[4, 8], mode=mode)
    want = llama(input_ids=x, attention_mask=mask, use_cache=False).logits
    assert torch.equal(f(input_ids=x, attention_mask=mask, use_cache=False).logits, want)


def test_an_input_of_n_rows_that_is_not_the_cause_is_not_blamed():
    """A non-batched input with N rows is named only when the padded call fails: here nothing fails."""
    f = fgraph.jit(lambda x, m: (x + 1, m * 2), batch={"x": Batched(0)}, buckets=[4])
    x, m = torch.ones(3, 2), torch.ones(3, 5)
    got = f(x, m)
    assert torch.equal(got[0], x + 1) and torch.equal(got[1], m * 2)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_a_failed_first_run_on_the_cpu_is_not_called_a_capture_error(mode):
    """Fake tensors do not check index bounds: the traced program fails when it first runs. On the CPU nothing is
    captured (it runs eagerly), so that is a RunError, not a CaptureError."""
    f = fgraph.jit(lambda x, i: x[i], mode=mode)
    with pytest.raises(RunError) as e:
        f(torch.ones(3), torch.tensor([5]))
    assert not isinstance(e.value, fgraph.CaptureError)
    assert "failed in its first run (on the CPU nothing is captured" in e.value.what
    assert "IndexError: index 5 is out of bounds" in e.value.what and "fgraph.disable_jit()" in e.value.fix
    assert isinstance(e.value.__cause__, IndexError) and not f.entries  # dropped: the next call tries again


def test_the_retrace_warning_for_a_shape_axis_suggests_batched_with_buckets(caplog):
    """Prompts of many lengths: one signature per length. A shape cannot be passed as a tensor, so the warning
    names the dim that differs and suggests Batched(axis=d) with buckets."""
    f = fgraph.jit(lambda x: x * 2)
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for t in range(1, fgraph.config.warn_signatures + 2):
            f(torch.ones(2, t))
    (msg,) = [r.getMessage() for r in caplog.records if "signatures made by calls" in r.getMessage()]
    assert "tensor sizes differ per call, along dim 1 of x (a shape is part of the signature)" in msg
    assert msg.split("Fix: ")[1].startswith("declare x Batched(axis=1) in batch= with buckets=[...]")
    assert "as tensors" not in msg.split("Fix: ")[1]
    caplog.clear()
    g = fgraph.jit(lambda x, step: x * step)  # Python scalars by value: the fix stays "pass them as tensors"
    with caplog.at_level(logging.WARNING, logger="fgraph"):
        for step in range(fgraph.config.warn_signatures + 1):
            g(torch.ones(2), step)
    (msg,) = [r.getMessage() for r in caplog.records if "signatures made by calls" in r.getMessage()]
    assert "Fix: pass values that change per call as tensors" in msg and "tensor sizes differ" not in msg


@torch.no_grad()
def test_sequence_buckets_warn_only_where_causal_attention_under_a_mask_is_harmless(llama, caplog):
    """Batched(axis=1) pads prompts along the sequence to a bucket (docs/contract.md, sequence buckets). The padding
    warnings name the linear layers' flattening views (rows merged, then split back: row-wise) and attention's
    softmax and matmul over the keys, where the padded keys sit after every real query (causal) and are masked by
    the attention mask: real positions get eager's logits to float rounding. Batched(mixes=True) says so."""
    x, mask = ids(2, 5), torch.ones(2, 5, dtype=torch.long)
    want = llama(input_ids=x, attention_mask=mask, use_cache=False).logits
    for mixes in (False, True):
        caplog.clear()
        spec = Batched(axis=1, mixes=mixes)
        f = fgraph.jit(llama, batch={"input_ids": spec, "attention_mask": spec}, buckets=[4, 8, 16])
        with caplog.at_level(logging.WARNING, logger="fgraph"):
            got = f(input_ids=x, attention_mask=mask, use_cache=False).logits  # 5 positions padded to 8
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        ops = {r.getMessage().split("padding is visible: ")[1].split(" at ")[0] for r in caplog.records}
        assert ops == (set() if mixes else {"aten.view", "aten._softmax", "aten.bmm"}), ops


def in_a_fresh_process(script: str) -> dict:
    """The JSON object the script prints last, run in a new interpreter from the repository root (what fgraph sees
    into is process-wide: these errors are a first call's)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root)
    assert run.stdout.strip(), run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@torch.no_grad()
def test_a_dynamic_cache_returned_by_a_plain_call_names_the_way_out_generate_does():
    """`model(ids)` leaves use_cache at its default: the model makes a DynamicCache and returns it. The class is
    transformers', so the fix is how the model is called, the same as for a DynamicCache under generate."""
    from examples import hf_generate as G

    # (in a fresh process: once any call has donated a DynamicCache, fgraph sees into the class process-wide, and a
    # returned one is then an output like any other, not an error)
    script = (
        "import json, torch, fgraph\n"
        "from examples import hf_generate as G\n"
        "try:\n"
        "    fgraph.jit(G.tiny('qwen2'))(torch.randint(0, 128, (2, 5)))\n"
        "except fgraph.TraceError as e:\n"
        "    print(json.dumps({'what': e.what, 'fix': e.fix}))\n"
    )
    plain = in_a_fresh_process(script)
    assert (
        f"output {G.cache_parameter(G.tiny('qwen2'))} is transformers' DynamicCache (use_cache=True, the default)"
        in plain["what"]
    )
    assert "use_cache=False" in plain["fix"] and "StaticCache" in plain["fix"]
    assert "register" not in plain["fix"] and "dataclass" not in plain["fix"]
    model = G.tiny("qwen2")
    G.jit_forward(model)
    with pytest.raises(fgraph.TraceError) as grown:  # generate's default cache grows per step
        model.generate(ids(2, 5), max_new_tokens=3, do_sample=False)
    assert "grown" in grown.value.what and plain["fix"] == grown.value.fix  # one way out, said once


@torch.no_grad()
def test_an_undonated_cache_error_shows_the_models_lines_not_torchs():
    """The recipe without donate=: transformers' cache update reads the StaticCache's tensors, which fgraph does not
    see into. The traceback runs from the call through generate and the model's code to that line, then fgraph's
    message: no raw AssertionError of fake tensors chained before it, no torch.fx or fgraph frame (235 lines, ~80).
    (In a fresh process: once any call has donated a StaticCache, fgraph sees into the class process-wide, and the
    error is then the write in place into it, raised at the end of the trace.)"""
    script = (
        "import json, os, traceback, torch, fgraph\n"
        "from examples import hf_generate as G\n"
        "model = G.tiny('qwen2')\n"
        "model.forward = fgraph.jit(model.forward)  # donate= left out\n"
        "try:\n"
        "    G.generate(model, torch.randint(0, 128, (2, 5)), 3)\n"
        "except fgraph.TraceError as e:\n"
        "    print(json.dumps({'what': e.what, 'fix': e.fix, 'cause': e.__cause__ is not None,\n"
        "        'text': ''.join(traceback.format_exception(e)),\n"
        "        'frames': [f.filename for f in traceback.extract_tb(e.__traceback__)],\n"
        "        'internal': [os.path.dirname(fgraph.__file__), os.path.dirname(torch.fx.__file__)]}))\n"
    )
    e = in_a_fresh_process(script)
    text, frames = e["text"], e["frames"]
    assert "is read by the function but is not one of its inputs" in e["what"] and "donate" in e["fix"]
    assert not e["cause"] and "AssertionError" not in text and "FakeTensor" not in text
    assert frames[-1].endswith("cache_utils.py") and not any(f.startswith(tuple(e["internal"])) for f in frames)
    assert len(text.splitlines()) <= 100, text
