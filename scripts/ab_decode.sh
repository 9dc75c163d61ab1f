#!/usr/bin/env bash
# The decode step of an older commit against this tree, in one device call: each tree's decode_bench runs in its own
# process, alternating (old, new, old, new), with the same arguments, and the timing rows of each are printed with
# their side and round. For a change between runs that no same-process comparison covers (a regression, or host
# drift between machines): the torch.compile peer is the same code on both sides, so it says how much is drift.
#
# usage (device, repo root, .gpu carried): bash scripts/ab_decode.sh OLD_COMMIT [decode_bench arguments...]
#   e.g. bash scripts/ab_decode.sh 5207540 --models qwen2.5-0.5b --cells 1024:1 --modes FULL+C --peers compile
#   (CPU check: bash scripts/ab_decode.sh 5207540 --smoke --cells 64:1 --modes FULL --peers none)
# The arguments must exist in both versions (decode_bench before 2026-12-01 has no --rounds or --kernels). Each run
# gets --no-host and a budget of AB_BUDGET_S seconds (default 200); outputs go to $OUT/ab (or /tmp/ab).
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1
shift
if [ -f .gpu/activate.sh ] && command -v nvidia-smi >/dev/null; then source .gpu/activate.sh >/dev/null; fi
tree="$(mktemp -d)/old"
git worktree add -q --detach "$tree" "$old"
trap 'git worktree remove --force "$tree"' EXIT
out="${OUT:-/tmp}/ab"
for round in 1 2; do
  for side in old new; do
    dir=$([ "$side" = old ] && echo "$tree" || pwd)
    (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" python3 -m benchmarks.decode_bench "$@" --no-host \
      --budget-s "${AB_BUDGET_S:-200}" --compile-est-s 20 --cell-est-s 10 --name "$side-$round" \
      --out "$out/$side-$round" 2>&1 | grep -E '^\| [0-9]|^\| ctx' | sed "s/^/$side $round: /") || true
  done
done
