#!/usr/bin/env bash
# The benchmarks behind the README, on the device (repo root, carrying .gpu), one part per device call. Each part
# has a 520 s budget inside a 570 s timeout: work that does not fit is skipped with the reason printed, and rows
# are appended to $OUT/<part>/*.jsonl as they are measured (a part cut short keeps them).
#   bash scripts/bench_all.sh PART      with PART one of
#   grid05    Qwen2.5-0.5B, ctx {1k, 8k} x B {1, 8, 64, 256}: eager / graph / torch.compile peers (FA2), fgraph
#             NONE / PIECEWISE / FULL per backend, host time per FULL call, capture cost (2 routines x default
#             buckets per backend)                                                              (~6-7 min)
#   grid8b    Llama-3-8B, the same cells (8k x 256 skipped: KV cache too large), no capture cost (~6-7 min)
#   serve     continuous batching on 0.5B, ~200 requests, PIECEWISE vs FULL_AND_PIECEWISE per backend (~4 min)
#   inductor  fgraph FULL+C (Inductor-compiled pieces, FA2), 1k x {1, 64}, both models            (optional)
#   attention the attention microbenchmark                                                      (optional)
#   smoke     CPU check of decode_bench, serve_bench and summarize (tiny preset; no GPU, no .gpu needed)
# Extra arguments after PART go to the benchmark (e.g. grid8b --peers eager graph: no torch.compile).
# Then, on the machine holding the fetched results:  python3 -m benchmarks.summarize RESULTS_DIR [...]
# Without $OUT, parts write to benchmarks/results/PART/, which git ignores: a run to publish replaces
# benchmarks/results/latest/ (with a RUNS.md of its commands; see docs/performance.md).
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:?usage: bash scripts/bench_all.sh grid05|grid8b|serve|inductor|attention|smoke}"
if [ "$part" != smoke ]; then source .gpu/activate.sh >/dev/null || exit 1; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results}"
dir="$OUT/$part"
mkdir -p "$dir"
run() { timeout -k 10 570 "$@"; }
case "$part" in
  grid05) run python3 -m benchmarks.decode_bench --models qwen2.5-0.5b --capture --name decode-0.5b --out "$dir" "${@:2}" ;;
  grid8b) run python3 -m benchmarks.decode_bench --models llama3-8b --name decode-8b --out "$dir" "${@:2}" ;;
  serve) run python3 -m benchmarks.serve_bench --out "$dir" "${@:2}" ;;
  inductor) run python3 -m benchmarks.decode_bench --cells 1024:1 1024:64 --backends flash_attn --modes FULL+C --peers none \
              --name decode-inductor --out "$dir" ;;
  attention) run python3 -m benchmarks.attention_bench --out "$dir" ;;
  smoke) python3 -m benchmarks.decode_bench --smoke --capture --name decode-smoke --out "$dir" \
         && python3 -m benchmarks.serve_bench --smoke --out "$dir" \
         && python3 -m benchmarks.summarize "$dir" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac 2>&1 | grep -v "^DEBUG" | tee "$dir/log.txt"
