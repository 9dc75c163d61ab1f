#!/usr/bin/env bash
# The cuBLAS-workspace spec (tests/test_workspace_gpu.py) on a commit before the fix and on this tree (device, repo
# root): bash scripts/ab_workspace.sh [OLD_COMMIT]  (default 3ae8a13, the last commit without it). Each old case runs
# in its own process (a replay into freed memory may poison it).
set -u
old="${1:-3ae8a13}"
base="${PYTHONPATH:-}"
t() { timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:logging --tb=short "$@" 2>&1 |
  grep -E "^E |passed|failed|rror" | head -12; }
git worktree add --detach /tmp/old "$old" > /dev/null 2>&1
cp tests/test_workspace_gpu.py /tmp/old/tests/
for k in clear compile nothing; do
  echo "== $old: $k"
  (cd /tmp/old && PYTHONPATH="/tmp/old${base:+:$base}" t tests/test_workspace_gpu.py -k "$k")
done
echo "== this tree: tests/test_workspace_gpu.py tests/test_capture_gpu.py"
PYTHONPATH="$PWD${base:+:$base}" t tests/test_workspace_gpu.py tests/test_capture_gpu.py
