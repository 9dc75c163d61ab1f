#!/usr/bin/env bash
# Every GPU test, on the device: from the repo root, with the GPU kit staged into .gpu/ (bash ../shared/gpu/stage.sh
# here, then carry [".gpu"]). Logs go to $OUT (or /tmp).
#   bash scripts/gpu_tests.sh             every GPU test, in separate processes (a CUDA error poisons a process,
#                                         and FlashInfer keeps wrappers per process), one lane each:
#                                           single        the single-GPU tests but FlashInfer's, the models' and
#                                                         the kernels'
#                                           kernels       fgraph's Triton kernels' specs (fgraph::linear and its
#                                                         family, the triton attention, RoPE, the KV write, PDL)
#                                           models        tests/examples/test_models_gpu.py but FlashInfer's and the
#                                                         compiled ones
#                                           compiled      test_models_gpu's Inductor-compiled tests (-k compile:
#                                                         two tests, ~4 minutes of compiling) and
#                                                         test_compile_gpu's random model shapes
#                                           flashinfer    FlashInfer's
#                                           flashinfer-tc-plan-paths-off  FlashInfer's model tests with
#                                                         FI.TENSOR_CORE_PLAN_PATHS off (the fallback)
#                                           multigpu      the TP/EP tests (the TP bench: benchmarks/tp_bench.py)
#                                         The lanes run side by side, on one GPU too (timings are not what these
#                                         check).
#   LANES="single models" bash scripts/gpu_tests.sh   only those lanes (a device command has 10 minutes; all the
#                                         single-GPU lanes side by side took about 5 of them, the single lane the
#                                         longest, before the kernels lane was split off it)
#   bash scripts/gpu_tests.sh PYTEST_ARGS  one pytest process with those arguments; exits with pytest's status
#
# Exit status: 0 only if every lane that ran passed; 1 if any lane failed, or if no CUDA GPU is visible (then
# nothing was tested). Every lane runs to the end whatever the others do; the summary names each lane's result.
# A lane fails on any non-zero pytest status, including 5 ("no tests collected"): every lane selects tests that
# exist, so an empty lane means a test file was moved or a -k / -m filter stopped matching, and a silent pass would
# hide it. Tests that cannot run here (FlashInfer not installed, a feature the backend lacks) skip inside pytest,
# which still exits 0. The one lane skipped on purpose is multigpu on a machine with fewer than 2 GPUs: it is not
# started, the summary says so, and it does not fail the run (run it on nvidia-h200-x2).
set -o pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/activate.sh ]; then source .gpu/activate.sh >/dev/null; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-/tmp}"
limit="${LANE_TIMEOUT:-560}"
# --durations: the slowest tests, for balancing the lanes
t() { timeout -k 10 "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 "$@"; }
if [ $# -gt 0 ]; then
  t "$@" 2>&1 | tee "$log/gpu_tests.log"
  exit "$?"
fi
n=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null)
if [ "${n:-0}" -lt 1 ]; then
  echo "gpu_tests.sh: no CUDA GPU visible (torch.cuda.device_count() = ${n:-unavailable}); nothing was tested" >&2
  exit 1
fi
# every gpu-marked test of tests/ but the multi-GPU files (a new test file joins a lane without an edit here)
single="tests --ignore=tests/examples/test_tp_gpu.py --ignore=tests/examples/test_ep_gpu.py"
models=tests/examples/test_models_gpu.py
shapes=tests/compile/test_compile_gpu.py  # (compiled pieces over random model shapes: in the compiled lane)
# (a lane of their own: the single lane ran ~290 s of the suite's ~300 with them)
kernels="tests/kernels/test_linear.py tests/kernels/test_linear_kernels.py tests/kernels/test_norm_linear.py tests/ops/test_attention_triton.py tests/kernels/test_pdl.py
tests/kernels/test_sdpa.py tests/ops/test_rope.py tests/ops/test_kv_write.py"
fi_tc="import sys, pytest, fgraph.ops._attn_flashinfer as FI; FI.TENSOR_CORE_PLAN_PATHS = False; \
sys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '-k', 'flashinfer', 'tests/examples/test_models_gpu.py']))"
rcs=$(mktemp -d)
# lane NAME CMD...: runs CMD with its output in $log/gpu_tests-NAME.log and its exit status in $rcs/NAME
lane() {
  local name=$1
  shift
  "$@" > "$log/gpu_tests-$name.log" 2>&1
  echo "$?" > "$rcs/$name"
}
lane_rest() { lane single t $single --ignore=$models --ignore=$shapes ${kernels//tests\//--ignore=tests/} -k "not flashinfer"; }
lane_kernels() { lane kernels t $kernels -k "not flashinfer"; }
lane_models() { lane models t $models -k "not flashinfer and not compile"; }
lane_compiled() { lane compiled t $models $shapes -k "compile and not flashinfer"; }
lane_fi() {
  lane flashinfer t $single -k flashinfer
  lane flashinfer-tc-plan-paths-off timeout -k 10 "$limit" python3 -c "$fi_tc"
}
lane_multi() { lane multigpu t tests/examples/test_tp_gpu.py tests/examples/test_ep_gpu.py -k "not bench"; }
want="${LANES:-single kernels models compiled flashinfer flashinfer-tc-plan-paths-off multigpu}"
has() { [[ " $want " == *" $1 "* ]]; }
lanes=""
has single && lanes="$lanes single"
has kernels && lanes="$lanes kernels"
has models && lanes="$lanes models"
has compiled && lanes="$lanes compiled"
has flashinfer && lanes="$lanes flashinfer flashinfer-tc-plan-paths-off"
if [ "$n" -ge 2 ] && has multigpu; then lanes="$lanes multigpu"; fi
# side by side: on 2+ GPUs the single-GPU lanes on a GPU each, the multi-GPU lane on both
on() { if [ "$n" -ge 2 ]; then CUDA_VISIBLE_DEVICES=$1 "${@:2}"; else "${@:2}"; fi; }
if [[ " $lanes " == *" multigpu "* ]]; then lane_multi & fi
if has single; then on 1 lane_rest & fi
if has kernels; then on 0 lane_kernels & fi
if has models; then on 1 lane_models & fi
if has compiled; then on 0 lane_compiled & fi
if has flashinfer; then on 0 lane_fi & fi
wait
failed=0
for name in $lanes; do
  rc=$(cat "$rcs/$name" 2>/dev/null || echo "none")
  case "$rc" in
    0) verdict="passed" ;;
    5) verdict="FAILED: no tests collected (pytest exit 5)" ;;
    124 | 137) verdict="FAILED: timed out after $limit s (LANE_TIMEOUT)" ;;
    none) verdict="FAILED: the lane recorded no exit status" ;;
    *) verdict="FAILED: exit status $rc" ;;
  esac
  [ "$rc" = 0 ] || failed=1
  echo "== $name: $verdict ($log/gpu_tests-$name.log)"
  tail -n 15 "$log/gpu_tests-$name.log" 2>/dev/null | grep -E "passed|failed|error|FAILED|ERROR|no tests ran"
done
if [ "$n" -lt 2 ]; then echo "== multigpu: skipped ($n GPU here; it needs 2: run this on nvidia-h200-x2)"; fi
rm -rf "$rcs"
if [ "$failed" -ne 0 ]; then echo "gpu_tests.sh: at least one lane FAILED" >&2; fi
exit "$failed"
