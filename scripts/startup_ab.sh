#!/usr/bin/env bash
# A first generate, cold: each row its own process with fresh Inductor and Triton caches (so an empty tuner cache
# too), alternating ROUNDS (default 2) times: fgraph's default, fgraph under each fgraph.config setting given, and
# torch.compile. Profiles (scripts/startup_profile.py: $OUT/startup_profile.jsonl, a line a row) and a log under
# $OUT (default .); each row's line gives the process's wall seconds, measured outside it.
#   ROUNDS=3 bash scripts/startup_ab.sh compile_workers=0             Hugging Face's generate (benchmarks/hf_bench.py),
#                                                                     torch.compile's static-cache recipe beside it
#   SUBJECT=cli ROUNDS=2 bash scripts/startup_ab.sh compile_workers=0 the CLI (benchmarks/startup_bench.py's cold
#                                                                     compiled row), its torch.compile peer beside it
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
ALL="hf_eager hf_eager_static hf_compile_static hf_fgraph_static hf_fgraph_static_compiled hf_fgraph_generate_default"
only() { for c in $ALL; do [ "$c" != "$1" ] && printf '%s ' "$c"; done; }
PRESET=(--preset qwen2.5-0.5b --backend auto)
for i in $(seq "${ROUNDS:-2}"); do
  for row in default "$@" compile; do
    # (as benchmarks/common.py's cold_env: a user's process sets no TRITON_CACHE_DIR; Inductor sets one)
    export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_HOME=$(mktemp -d)
    unset TRITON_CACHE_DIR
    profile=(scripts/startup_profile.py --tag "${row//=/-}-$i")
    case $row in default | compile) ;; *) profile+=(--config "$row") ;; esac
    if [ "${SUBJECT:-hf}" = cli ]; then
      cli=(--module examples.generate -- --num-prompts 8 --max-new-tokens 64 --no-progress "${PRESET[@]}" --compile)
      cmd=("${profile[@]}" "${cli[@]}")
      [ "$row" = compile ] && cmd=(-m benchmarks.startup_bench --child torch_compile "${PRESET[@]}")
    else
      hf=(--batches 1 --new 16 --first-only)
      cmd=("${profile[@]}" -- "${hf[@]}" --skip $(only hf_fgraph_generate_default))
      [ "$row" = compile ] && cmd=("${profile[@]}" -- "${hf[@]}" --skip $(only hf_compile_static))
    fi
    t0=$EPOCHREALTIME
    python3 "${cmd[@]}" > "$OUT/startup_ab.row" 2>&1
    rc=$?
    wall=$(python3 -c "print(round($EPOCHREALTIME - $t0, 1))")
    cat "$OUT/startup_ab.row" >> "$OUT/startup_ab.log"
    echo "$row $i: rc $rc, wall $wall s $(grep -o '"first_generate_s": [0-9.]*' "$OUT/startup_ab.row" | tail -1)"
  done
done
rm -f "$OUT/startup_ab.row"
