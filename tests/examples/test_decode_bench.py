"""benchmarks/decode_bench.py --kernels on the CPU (the profiler needs CUDA: the rows say so), and the kernel
counting and its summary on a synthetic profile, so that neither needs a GPU."""

import json

from benchmarks import decode_bench, kernels, summarize

L = 4  # layers of the synthetic step
STEP = [  # (name, launches per step, GPU µs per step) of a 4-layer step
    ("gemm_qkv", 4.0, 40.0),
    ("attention", 4.0, 30.0),
    ("gemm_o", 4.0, 20.0),
    ("rms_norm", 2 * L + 1.0, 9.0),  # every layer's two norms and the final one
    ("gemm_mlp", 8.0, 80.0),  # two per layer
    ("lm_head", 1.0, 50.0),
    ("Memcpy HtoD (Pinned -> Device)", 1.0, 2.0),
]


def test_layer_counts_count_the_launches_that_repeat_with_the_layers():
    got = kernels.layer_counts(STEP, L)
    assert got == {"kernels_per_step": 31.0, "kernels_per_layer": 7.8, "layer_kernels": 7}
    assert kernels.layer_counts([("k", 32.0, 1.0), ("step", 3.0, 1.0)], 32)["layer_kernels"] == 1
    assert kernels.layer_counts([], L) == {"kernels_per_step": 0, "kernels_per_layer": 0.0, "layer_kernels": 0}


def test_contender_kernels_fill_the_row_from_the_profile(monkeypatch):
    table = {"kernels_per_step": 31.0, "gpu_us_per_step": 231.0, "top": STEP, "rows": STEP}
    monkeypatch.setattr(kernels, "kernel_table", lambda call: table)
    row = kernels.contender_kernels({"fa2/FULL+C": None}, L, "cuda")
    assert row["fa2/FULL+C_layer_kernels"] == 7 and row["fa2/FULL+C_kernels_per_layer"] == 7.8
    assert row["fa2/FULL+C_kernels_per_step"] == 31.0 and row["fa2/FULL+C_gpu_us"] == 231.0
    assert row["fa2/FULL+C_top"][0] == ["gemm_qkv", 4.0, 40.0] and len(row["fa2/FULL+C_top"]) == len(STEP)
    assert kernels.contender_kernels({"fa2/FULL+C": None}, L, "cpu") == {"kernels_skipped": "needs CUDA"}

    def fails(call):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(kernels, "kernel_table", fails)
    got = kernels.contender_kernels({"compile": None}, L, "cuda:0")
    assert got == {"compile_kernels_error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}


def test_summary_shows_kernels_per_layer_and_the_target():
    cell = {"model": "m", "ctx": 1024, "batch": 1, "floor_ms": 1.0, "compile_ms": 2.0}
    for name, n in (("flash_attn/FULL+C", 5), ("compile", 9)):
        cell.update({f"{name}_ms": 1.5, f"{name}_layer_kernels": n, f"{name}_kernels_per_layer": n + 0.4})
        cell.update({f"{name}_kernels_per_step": L * (n + 0.4), f"{name}_top": [list(r) for r in STEP]})
    text = summarize.report([cell, {**cell, "batch": 64, "flash_attn/FULL+C_layer_kernels": 7}])
    assert "| ctx | B | compile | fa2 FULL+C |" in text
    assert "| 1024 | 1 | 9 / 9.4 (38) | 5 / 5.4 (22) |" in text
    assert "- target kernels per layer <= 6 (fa2 FULL+C, per-layer kernels): NOT met: 1/2 cells, most 7" in text
    assert "### m: top kernels per step, ctx 1024 B 1" in text and "    40.0 us    4.0x  gemm_qkv" in text


def test_smoke_with_kernels_records_that_they_need_cuda(tmp_path):
    decode_bench.main(
        ["--smoke", "--kernels", "--cells", "64:1", "--modes", "FULL", "--peers", "none", "--no-host"]
        + ["--rounds", "1", "--out", str(tmp_path)]
    )
    d = json.load(open(tmp_path / "decode.json"))
    (c,) = d["cells"]
    assert c["kernels_skipped"] == "needs CUDA" and "torch/FULL_ms" in c
    assert not [k for k in c if "_kernels_per" in k]
    assert "ctx 64 B 1: kernels: needs CUDA" in summarize.report(d["rows"])


def test_each_backend_is_compared_with_torch_compile_at_its_own_page_size():
    """FA2's FULL against "compile" (the peer backend's step, page 256), FlashInfer's against "flashinfer/compile"
    (the same step at page 16): never one backend's FULL against the other's page size."""
    cell = {"model": "m", "ctx": 1024, "batch": 1, "floor_ms": 1.0, "compile_ms": 3.0, "flashinfer/compile_ms": 2.0}
    cell.update({"flash_attn/FULL+C_ms": 2.0, "flashinfer/FULL+C_ms": 1.6})
    text = summarize.report([cell])
    assert "| fi compile |" in text
    assert "fa2 1.50x, fi 1.25x" in text  # 3.0 / 2.0 and 2.0 / 1.6 (not 3.0 / 1.6 = 1.88x)
    assert summarize.best_peer(cell, "flashinfer") == ("flashinfer/compile", 2.0)
    assert summarize.best_peer(cell) == ("compile", 3.0)


def test_host_time_is_measured_with_the_gpu_busy_and_idle(tmp_path):
    decode_bench.main(
        ["--smoke", "--cells", "64:1", "--modes", "FULL", "--peers", "none", "--rounds", "1", "--out", str(tmp_path)]
    )
    d = json.load(open(tmp_path / "decode.json"))
    (c,) = d["cells"]
    assert c["torch/FULL/idle_host_us"] > 0 and c["torch/FULL/host_us"] > 0


def test_auto_is_measured_as_the_default_pick_and_says_what_that_was(tmp_path):
    """`--backends auto`: what a user gets without naming a backend, labelled "auto" (a pair such as
    "triton/flash_attn" would not fit the "<backend>/<mode>" columns), with the backend it resolved to on record."""
    decode_bench.main(
        ["--models", "tiny", "--device", "cpu", "--backends", "auto", "--cells", "64:1", "--modes", "FULL"]
        + ["--peers", "none", "--no-host", "--rounds", "1", "--out", str(tmp_path)]
    )
    d = json.load(open(tmp_path / "decode.json"))
    (c,) = d["cells"]
    assert c["auto/FULL_err"] == 0.0 and "auto/FULL_ms" in c
    assert [r["resolves_to"] for r in d["rows"] if r.get("kind") == "resolved"] == ["torch"]
