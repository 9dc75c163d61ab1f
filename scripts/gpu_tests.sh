#!/usr/bin/env bash
# Every GPU test, on the device: from the repo root, with the GPU kit staged into .gpu/ (bash ../shared/gpu/stage.sh
# here, then carry [".gpu"]). Logs go to $OUT (or /tmp).
#   bash scripts/gpu_tests.sh             every GPU test, in separate processes (a CUDA error poisons a process,
#                                         and FlashInfer keeps wrappers per process): the single-GPU tests but
#                                         FlashInfer's, FlashInfer's, then FlashInfer's model tests with
#                                         FI.TENSOR_CORE_PLAN_PATHS off (the fallback), and (2+ GPUs) the TP/EP
#                                         tests (the TP bench: benchmarks/tp_bench.py). The lanes run side by
#                                         side, on one GPU too (timings are not what these check).
#   bash scripts/gpu_tests.sh PYTEST_ARGS  one pytest process with those arguments
set -o pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/activate.sh ]; then source .gpu/activate.sh >/dev/null; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-/tmp}"
t() { timeout -k 10 "${LANE_TIMEOUT:-560}" python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
if [ $# -gt 0 ]; then t "$@" 2>&1 | tee "$log/gpu_tests.log"; exit; fi
single="tests/test_capture_gpu.py tests/test_attention_gpu.py tests/test_moe_gpu.py tests/test_models_gpu.py tests/test_hf_example.py"
fi_tc="import sys, pytest, fgraph.ops._attn_flashinfer as FI; FI.TENSOR_CORE_PLAN_PATHS = False; \
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '-k', 'flashinfer', 'tests/test_models_gpu.py']))"
lane_rest() { t $single -k "not flashinfer" > "$log/gpu_tests-single.log" 2>&1; }
lane_fi() {
  t $single -k flashinfer > "$log/gpu_tests-flashinfer.log" 2>&1
  timeout -k 10 "${LANE_TIMEOUT:-560}" python3 -c "$fi_tc" > "$log/gpu_tests-flashinfer-tc-plan-paths-off.log" 2>&1
}
lane_multi() { t tests/test_tp_gpu.py tests/test_ep_gpu.py -k "not bench" > "$log/gpu_tests-multigpu.log" 2>&1; }
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$n" -ge 2 ]; then
  lane_multi & CUDA_VISIBLE_DEVICES=1 lane_rest & CUDA_VISIBLE_DEVICES=0 lane_fi & wait
else
  lane_rest & lane_fi & wait
fi
for f in "$log"/gpu_tests-*.log; do echo "== $f"; tail -n 15 "$f" | grep -E "passed|failed|error|FAILED|ERROR"; done
