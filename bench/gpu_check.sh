#!/usr/bin/env bash
# The whole GPU check of the CUDA path in one run (docs/cuda.md): install the carried wheels,
# build FlashInfer's kernels, run tests/unit/test_gpu.py, run bench/gpu.py. Every log and the
# benchmark's results land in $OUT (at most 8 files come back from the device machine).
#
#   bash bench/gpu_check.sh [OUT]      # from the repo root, on the GPU machine, .whl/ carried
#
# Stage limits (seconds) add up to 560 s (JIT 240, tests 120, bench 200, of which 120 start new
# stages); override with JIT_S, TEST_S, BENCH_S, BENCH_BUDGET_S. Give the run timeout_s 590.
set -uo pipefail
OUT=${1:-${OUT:-gpu_results}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD RADIXSERVE_REQUIRE_FLASHINFER=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # H200; FlashInfer compiles for these only
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
PY=${PY:-python3}
start=$(date +%s)
stamp() { echo "== $(( $(date +%s) - start )) s: $*"; }

{
  stamp install
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvcc --version | tail -2
  $PY -c "import torch, flashinfer; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__)"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

# JIT: three builds in parallel (bf16 and fp16 prefill/tensor-core decode, bf16 CUDA-core decode)
stamp jit | tee "$OUT/jit.log"
for case in "bfloat16 1" "bfloat16 4" "float16 4"; do
  MAX_JOBS=6 timeout "${JIT_S:-240}" $PY -m bench.flashinfer_jit $case >>"$OUT/jit.log" 2>&1 &
done
wait
tail -n 40 "$OUT/jit.log"

stamp tests | tee "$OUT/test_gpu.log"
timeout "${TEST_S:-120}" $PY -m pytest -q -rs -p no:cacheprovider --timeout 100 tests/unit/test_gpu.py 2>&1 | tee -a "$OUT/test_gpu.log"

stamp bench | tee "$OUT/bench.log"
timeout "${BENCH_S:-200}" $PY -m bench.gpu --out "$OUT" --budget-s "${BENCH_BUDGET_S:-120}" 2>&1 | tee -a "$OUT/bench.log"
stamp done
