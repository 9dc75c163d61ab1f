#!/usr/bin/env bash
# Every GPU test, on the device (one H200): from the repo root, with the GPU kit staged into .gpu/
# (bash ../shared/gpu/stage.sh here, then carry [".gpu"]). Writes the log to $OUT when set.
set -o pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/activate.sh ]; then source .gpu/activate.sh; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m pytest -q -m gpu -p no:cacheprovider "${@:-tests}" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
