#!/usr/bin/env bash
# The decode benchmark as run for the README (on the device, from the repo root, carrying .gpu):
#   bash scripts/bench_all.sh      -> $OUT/decode*.json, $OUT/decode*.png and the tables on stdout
set -uo pipefail
source .gpu/activate.sh >/dev/null
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results}"
# every cell, eager / graph / torch.compile peers, fgraph NONE / PIECEWISE / FULL per backend, capture cost
timeout 330 python3 -m benchmarks.decode_bench --cells 1024:1 1024:8 1024:64 1024:256 8192:1 8192:64 \
  --compile-modes --capture --out "$OUT/grid" 2>&1 | grep -v "^DEBUG\|Warning\|warn("
# fgraph FULL with Inductor-compiled pieces (FA2) on the target cells
timeout 200 python3 -m benchmarks.decode_bench --cells 1024:1 1024:64 --backends flash_attn --modes FULL \
  --compile-modes FULL --no-peers --out "$OUT/inductor" 2>&1 | grep -v "^DEBUG\|Warning\|warn("
