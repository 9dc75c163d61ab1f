#!/usr/bin/env bash
# The benchmarks behind the README, on the device (repo root, carrying .gpu), one part per call so each fits
# the 10-minute limit:  bash scripts/bench_all.sh PART    with PART one of
#   grid05    Qwen2.5-0.5B: every cell, eager / graph / torch.compile peers, fgraph per backend, capture cost
#   grid8b    Llama-3-8B: the same cells (KV over 30 GB skipped), no capture cost
#   inductor  fgraph FULL with Inductor-compiled pieces (FA2) on the target cells, both models
#   serve     continuous batching, PIECEWISE vs FULL_AND_PIECEWISE per attention backend (0.5B)
#   attention the attention microbenchmark
# Rows are appended to $OUT/<part>/*.jsonl as they are measured, so a part cut short keeps what it measured.
set -uo pipefail
source .gpu/activate.sh >/dev/null
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results}"
part="${1:?usage: bash scripts/bench_all.sh grid05|grid8b|inductor|serve|attention}"
mkdir -p "$OUT/$part"
cells="1024:1 1024:8 1024:64 1024:256 8192:1 8192:64"
case "$part" in
  grid05) timeout 570 python3 -m benchmarks.decode_bench --models qwen2.5-0.5b --cells $cells --compile-modes \
            --capture --out "$OUT/$part" ;;
  grid8b) timeout 570 python3 -m benchmarks.decode_bench --models llama3-8b --cells $cells --compile-modes \
            --out "$OUT/$part" ;;
  inductor) timeout 570 python3 -m benchmarks.decode_bench --cells 1024:1 1024:64 --backends flash_attn \
            --modes FULL --compile-modes FULL --no-peers --out "$OUT/$part" ;;
  serve) timeout 570 python3 -m benchmarks.serve_bench --out "$OUT/$part" ;;
  attention) timeout 570 python3 -m benchmarks.attention_bench --out "$OUT/$part" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac 2>&1 | grep -v "^DEBUG" | tee "$OUT/$part/log.txt"
