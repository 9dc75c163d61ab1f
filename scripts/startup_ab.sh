#!/usr/bin/env bash
# The HF first generate, cold: each row its own process with fresh Inductor and Triton caches (so an empty tuner cache
# too), alternating ROUNDS (default 2) times: fgraph's default, fgraph under each fgraph.config setting given, and
# torch.compile's static-cache recipe. Profiles (scripts/startup_profile.py: $OUT/startup_profile.jsonl, a line a row)
# and a log under $OUT (default .).
#   ROUNDS=3 bash scripts/startup_ab.sh compile_workers=0
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
ALL="hf_eager hf_eager_static hf_compile_static hf_fgraph_static hf_fgraph_static_compiled hf_fgraph_generate_default"
only() { for c in $ALL; do [ "$c" != "$1" ] && printf '%s ' "$c"; done; }
for i in $(seq "${ROUNDS:-2}"); do
  for row in default "$@" compile; do
    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
    args=(--batches 1 --new 16 --first-only)
    case $row in
      compile) args+=(--skip $(only hf_compile_static)) ;;
      default) args+=(--skip $(only hf_fgraph_generate_default)) ;;
      *) args+=(--config "$row" --skip $(only hf_fgraph_generate_default)) ;;
    esac
    python3 scripts/startup_profile.py --tag "${row//=/-}-$i" -- "${args[@]}" >> "$OUT/startup_ab.log" 2>&1
    echo "$row $i: $(grep -o '"first_generate_s": [0-9.]*' "$OUT/startup_ab.log" | tail -1)"
  done
done
