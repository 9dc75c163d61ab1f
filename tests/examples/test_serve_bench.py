"""benchmarks/serve_bench.py on the CPU (--smoke: tiny preset, torch attention): the engines of a backend serve the
same workload several times with the modes alternating, and the row of each mode carries every run. A "+C" mode
serves Inductor-compiled pieces (here on --compiled-buckets: few buckets keep the CPU run short)."""

import json

from benchmarks import serve_bench, summarize


def test_serve_bench_alternates_the_modes_and_reports_paired_gains(tmp_path, capsys):
    modes = ["PIECEWISE", "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE+C"]
    serve_bench.main(
        ["--smoke", "--repeats", "3", "--modes", *modes, "--compiled-buckets", "8", "--out", str(tmp_path)]
    )
    d = json.load(open(tmp_path / "serve.json"))
    rows = {r["mode"]: r for r in d["rows"]}
    assert list(rows) == modes and d["info"]["repeats"] == 3
    for r in rows.values():
        assert len(r["throughput_runs"]) == 3 and min(r["throughput_runs"]) <= r["throughput_tok_s"]
        assert not any(r["fallbacks"].values())
        assert r["replays"] > 0  # every run after the warm-up replays captured (host stand-in) graphs
    assert all(rows[m]["mismatched_requests"] == 0 and "buckets" not in rows[m] for m in modes[:2])
    assert "gain_paired" not in rows["PIECEWISE"]
    runs = zip(rows["FULL_AND_PIECEWISE"]["throughput_runs"], rows["PIECEWISE"]["throughput_runs"])
    assert sorted([f / p - 1 for f, p in runs])[1] == rows["FULL_AND_PIECEWISE"]["gain_paired"]  # median of 3
    c = rows["FULL_AND_PIECEWISE+C"]  # Inductor's tokens may differ: counted, not raised
    assert c["buckets"] == [8, 64] and isinstance(c["mismatched_requests"], int)  # (64: max_batch_tokens)
    runs = zip(c["throughput_runs"], rows["FULL_AND_PIECEWISE"]["throughput_runs"])
    assert sorted([x / f - 1 for x, f in runs])[1] == c["gain_over_uncompiled"] and "gain_paired" in c
    table = summarize.report([d["info"]] + d["rows"])
    assert "| tiny | torch | FULL_AND_PIECEWISE |" in table and "| tiny | torch | FULL_AND_PIECEWISE+C |" in table
    assert "| 3 |" in table and "- FULL_AND_PIECEWISE+C (torch; Inductor-compiled pieces, buckets [8, 64]): " in table
    assert "output throughput over PIECEWISE with identical greedy tokens (torch)" in capsys.readouterr().out


def test_serve_bench_skips_compiled_engines_that_would_not_fit_and_reports_one_that_fails(tmp_path):
    """The budget counts --compile-est-s per +C engine (one compilation per distinct piece, whatever its buckets); an
    engine that fails to build is an error row, and the backend's other modes still run."""
    a = serve_bench.parse_args(["--smoke", "--modes", "PIECEWISE", "PIECEWISE+C", "--compiled-buckets", "1", "8"])
    assert a.compiled_buckets == [1, 8, 64] and serve_bench.estimate(a) == a.run_est_s + a.compile_est_s
    assert serve_bench.parse_args(["--smoke"]).compiled_buckets is None  # every bucket
    serve_bench.main(
        ["--smoke", "--modes", "PIECEWISE+C", "--budget-s", "20", "--run-est-s", "1", "--out", str(tmp_path)]
    )
    (row,) = json.load(open(tmp_path / "serve.json"))["rows"]
    assert row["mode"] == "PIECEWISE+C" and row["skipped"].startswith("time budget: needs ~31 s")
    serve_bench.main(["--smoke", "--repeats", "1", "--modes", "PIECEWISE", "BOGUS+C", "--out", str(tmp_path)])
    pw, bogus = json.load(open(tmp_path / "serve.json"))["rows"]
    assert pw["runs"] == 1 and bogus["error"].startswith("SignatureError: fgraph.jit(step): unknown mode 'BOGUS' Fix:")
