#!/usr/bin/env bash
# Everything a lent GPU should measure for modelpar, in one command (docs/performance.md):
#   1. the CUDA-only tests (compiled blocks, the chunked loss, fp8, numerics, generation on the GPU);
#   2. benchmarks/gpu_single.py: modelpar (eager, --compile, fp8) beside the hand-written anchor at 355M and 1B,
#      with a torch.profiler table of modelpar's compiled step (PROFILE_RUN=modelpar for eager);
#   3. optionally (GPU_CALIBRATE=1) benchmarks/gpu_calibrate.py: the cost model on this GPU.
# Figures and logs go to $OUT (default ./gpu-out). Run from the repository root:  bash benchmarks/gpu_session.sh
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rs \
  tests/test_compile.py tests/test_float8.py tests/test_numerics.py tests/test_generate.py tests/test_recompute.py \
  tests/test_pipe.py tests/test_workers.py -k "cuda or gpu or float8" 2>&1 | tee "$OUT/cuda_tests.log" | tail -15
# 355M: eager and compiled, both sides (+ the profile); 1B: compiled, fp8 and the compiled anchor
timeout "${BENCH_S:-200}" python3 benchmarks/gpu_single.py --sizes 355m --json "$OUT/gpu_single_355m.json" \
  --runs "${RUNS_355M:-modelpar,anchor,modelpar --compile,anchor compiled}" --profile "$OUT/profile.txt" \
  --profile-run "${PROFILE_RUN:-modelpar --compile}" 2>&1 \
  | tee "$OUT/gpu_single_355m.log" | grep -v "^\[" | tail -12
timeout "${BENCH_1B_S:-220}" python3 benchmarks/gpu_single.py --sizes 1b --json "$OUT/gpu_single_1b.json" \
  --runs "${RUNS_1B:-modelpar --compile,modelpar --compile fp8,anchor compiled}" 2>&1 \
  | tee "$OUT/gpu_single_1b.log" | grep -v "^\[" | tail -10
if [ "${GPU_CALIBRATE:-0}" = 1 ]; then
  timeout "${CALIBRATE_S:-240}" python3 benchmarks/gpu_calibrate.py --out "$OUT/gpu_profile.json" 2>&1 | tee "$OUT/gpu_calibrate.log" | tail -25
fi
