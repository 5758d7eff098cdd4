#!/usr/bin/env bash
# The whole GPU check of the CUDA path in one run (docs/cuda.md): install the carried wheels,
# build FlashInfer's kernels, run the GPU tests, run bench/gpu.py. Every log and the
# benchmark's results land in $OUT (at most 8 files come back from the device machine).
#
#   bash bench/gpu_check.sh [OUT]      # from the repo root, on the GPU machine, .whl/ carried
#
# The run is made to be the only one a lease allows, so it adapts instead of stopping:
# - .whl/*.whl is installed into /tmp/site; a FlashInfer that does not import, or whose kernels
#   all fail to build, is replaced by .whl/alt/flashinfer*.whl (another release) when carried;
# - each JIT case that fails deselects only its own tests; without the bf16 GQA-4 module the
#   FlashInfer tests are not run (they would each try the build again) and the benchmark
#   measures torch_native.
# Stage limits (seconds) add up to 570 s (install 20, JIT 160, tests 240, bench 150 of which
# 90 start new stages); override with JIT_S, TEST_S, BENCH_S, BENCH_BUDGET_S. Give the run
# timeout_s 590 (docs/cuda.md says what each stage took on the H200). The tests print one line
# each (-v), so a stage cut off by its limit still says which passed.
set -uo pipefail
OUT=${1:-${OUT:-gpu_results}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD RADIXSERVE_REQUIRE_FLASHINFER=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # H200; FlashInfer compiles for these only
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
PY=${PY:-python3}
start=$(date +%s)
stamp() { echo "== $(( $(date +%s) - start )) s: $*"; }
pip_install() { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
fi_imports() { $PY -c "import torch, flashinfer; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__)"; }
alt_used=0
use_alt() {  # the other carried FlashInfer release, once
  [ "$alt_used" = 0 ] && ls .whl/alt/flashinfer*.whl >/dev/null 2>&1 || return 1
  alt_used=1
  echo "-- switching to $(ls .whl/alt/flashinfer*.whl)"
  rm -rf /tmp/site/flashinfer /tmp/site/flashinfer_python-*
  pip_install .whl/alt/flashinfer*.whl
}

{
  stamp install
  pip_install .whl/*.whl
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  nvcc --version | tail -2
  lscpu | grep -E "Model name|^CPU\(s\)"
  fi_imports || { use_alt && fi_imports; }
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

# JIT: the four modules in parallel (bf16 and fp16 prefill/tensor-core decode, bf16 CUDA-core
# decode, bf16 queries over fp8_e4m3 KV)
CASES=("bfloat16 4" "bfloat16 1" "float16 4" "bfloat16 4 --kv-cache-dtype fp8_e4m3")
declare -A built
jit_all() {  # $1: seconds
  local pids=() i
  for i in "${!CASES[@]}"; do
    MAX_JOBS=4 timeout "$1" $PY -m bench.flashinfer_jit ${CASES[$i]} >>"$OUT/jit.log" 2>&1 &
    pids[$i]=$!
  done
  for i in "${!CASES[@]}"; do
    if wait "${pids[$i]}"; then built[$i]=1; else built[$i]=0; fi
  done
}
stamp jit | tee "$OUT/jit.log"
jit_start=$(date +%s)
JIT_S=${JIT_S:-160}
jit_all "$JIT_S"
spent=$(( $(date +%s) - jit_start ))
if [ "${built[0]}" = 0 ] && [ $(( JIT_S - spent )) -ge 90 ] && use_alt >>"$OUT/jit.log" 2>&1; then
  stamp "jit again with $(fi_imports 2>&1 | tail -1)" | tee -a "$OUT/jit.log"
  jit_all $(( JIT_S - spent ))
fi
for i in "${!CASES[@]}"; do echo "JIT ${CASES[$i]}: $([ "${built[$i]}" = 1 ] && echo built || echo FAILED)"; done | tee -a "$OUT/jit.log"
grep -E "error|Error" "$OUT/jit.log" | head -n 20

# tests: each failed JIT case deselects its own tests
deselect=()
[ "${built[1]}" = 1 ] || deselect+=("not bf16-mha")
[ "${built[2]}" = 1 ] || deselect+=("not fp16-gqa4")
[ "${built[3]}" = 1 ] || deselect+=("not fp8 and not quantized")
[ "${built[0]}" = 1 ] || deselect=("sampler")
kexpr=$(IFS=@; echo "${deselect[*]}" | sed 's/@/ and /g')
stamp "tests ${kexpr:+(-k '$kexpr')}" | tee "$OUT/test_gpu.log"
timeout "${TEST_S:-240}" $PY -m pytest -v -rs -p no:cacheprovider --timeout 100 --continue-on-collection-errors --durations 0 \
  -m gpu ${kexpr:+-k "$kexpr"} tests/unit/test_gpu.py tests/unit/test_scattered_attention.py 2>&1 | tee -a "$OUT/test_gpu.log"

stamp bench | tee "$OUT/bench.log"
[ "${built[0]}" = 1 ] || { echo "no FlashInfer module: the benchmark measures torch_native"; rm -rf /tmp/site/flashinfer; } | tee -a "$OUT/bench.log"
timeout "${BENCH_S:-150}" $PY -m bench.gpu --out "$OUT" --budget-s "${BENCH_BUDGET_S:-90}" 2>&1 | tee -a "$OUT/bench.log"
stamp done
