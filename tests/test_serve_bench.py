"""benchmarks/serve_bench.py on the CPU (--smoke: tiny preset, torch attention): the engines of a backend serve the
same workload several times with the modes alternating, and the row of each mode carries every run."""

import json

from benchmarks import serve_bench, summarize


def test_serve_bench_alternates_the_modes_and_reports_paired_gains(tmp_path, capsys):
    serve_bench.main(["--smoke", "--repeats", "3", "--out", str(tmp_path)])
    d = json.load(open(tmp_path / "serve.json"))
    rows = {r["mode"]: r for r in d["rows"]}
    assert set(rows) == {"PIECEWISE", "FULL_AND_PIECEWISE"} and d["info"]["repeats"] == 3
    for r in rows.values():
        assert len(r["throughput_runs"]) == 3 and min(r["throughput_runs"]) <= r["throughput_tok_s"]
        assert r["mismatched_requests"] == 0 and r["fallbacks"] == {"unseen": 0, "oversize": 0, "cap": 0, "oom": 0}
        assert r["replays"] > 0  # every run after the warm-up replays captured (host stand-in) graphs
    assert "gain_paired" not in rows["PIECEWISE"]
    runs = zip(rows["FULL_AND_PIECEWISE"]["throughput_runs"], rows["PIECEWISE"]["throughput_runs"])
    assert sorted([f / p - 1 for f, p in runs])[1] == rows["FULL_AND_PIECEWISE"]["gain_paired"]  # median of 3
    table = summarize.report([d["info"]] + d["rows"])
    assert "| tiny | torch | FULL_AND_PIECEWISE |" in table and "| 3 |" in table
    assert "output throughput over PIECEWISE with identical greedy tokens (torch)" in capsys.readouterr().out
