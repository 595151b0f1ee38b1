#!/usr/bin/env bash
# Everything a lent GPU should measure for modelpar, in one command (docs/performance.md), most wanted first:
#   tests      the CUDA-only tests (`pytest -m cuda tests`: compiled blocks, the chunked loss, fp8, offload's
#              side stream, numerics, generation on the GPU)
#   calibrate  benchmarks/gpu_calibrate.py: `modelpar calibrate` on this GPU, then its configurations predicted
#              beside measured (step time and peak allocated memory; issue 38)
#   single355  benchmarks/gpu_single.py at 355M: modelpar (eager, --compile per block and per stage) beside the
#              hand-written anchor,
#              with a torch.profiler table of modelpar's compiled step (PROFILE_RUN=modelpar for eager; issue 36)
#   dualpipe   benchmarks/gpu_dualpipe_overlap.py: DualPipe-V's pairs on two streams against back to back (issue 39)
#   single1b   benchmarks/gpu_single.py at 1.06B: --compile, fp8 and the compiled anchor
#   fp8curve   benchmarks/gpu_fp8_curve.py: fp8's loss curve beside two bf16 seeds
#   compiled   benchmarks/gpu_calibrate.py --compile on calibrate's profile: the same configurations with each
#              block compiled, their layers priced from the profile's compiled layer (issue 38)
# STEPS picks and orders them (default: all, in this order); a step whose time limit no longer fits in
# BUDGET_S (default 540 s: a device call may run 600) is skipped and named, so one call never runs past its
# limit and loses the logs. Figures and logs go to $OUT (default ./gpu-out). From the repository root:
#   bash benchmarks/gpu_session.sh                                   # as much as 9 minutes hold
#   STEPS="single1b fp8curve" bash benchmarks/gpu_session.sh         # the rest, in a second call
set -uo pipefail
OUT=${OUT:-gpu-out}
STEPS=${STEPS:-tests calibrate single355 dualpipe single1b fp8curve compiled}
BUDGET_S=${BUDGET_S:-540}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
START=$SECONDS

# step NAME LIMIT_S COMMAND...: run it under timeout LIMIT_S if LIMIT_S still fits the budget, its log in $OUT/NAME.log
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - (SECONDS - START)))
  if [ "$limit" -gt "$left" ]; then
    echo "== $name: skipped (needs ${limit} s, ${left} s of the budget left)" | tee -a "$OUT/skipped.txt"
    return
  fi
  echo "== $name (at most ${limit} s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^\[" | tail -25
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
for s in $STEPS; do
  case $s in
    tests) step tests "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rs -m cuda tests ;;
    calibrate) step calibrate "${CALIBRATE_S:-300}" python3 benchmarks/gpu_calibrate.py --measure-compiled \
      --out "$OUT/gpu_profile.json" ;;
    single355) step single355 "${BENCH_S:-260}" python3 benchmarks/gpu_single.py --sizes 355m \
      --json "$OUT/gpu_single_355m.json" --runs "${RUNS_355M:-modelpar,anchor,modelpar --compile,modelpar --compile stage,anchor compiled}" \
      --profile "$OUT/profile.txt" --profile-run "${PROFILE_RUN:-modelpar --compile}" ;;
    dualpipe) step dualpipe "${DUALPIPE_S:-60}" python3 benchmarks/gpu_dualpipe_overlap.py ;;
    single1b) step single1b "${BENCH_1B_S:-220}" python3 benchmarks/gpu_single.py --sizes 1b \
      --json "$OUT/gpu_single_1b.json" --runs "${RUNS_1B:-modelpar --compile,modelpar --compile fp8,anchor compiled}" ;;
    fp8curve) step fp8curve "${FP8_S:-200}" python3 benchmarks/gpu_fp8_curve.py --json "$OUT/fp8_curve.json" ;;
    compiled) step compiled "${COMPILED_S:-300}" python3 benchmarks/gpu_calibrate.py --compile \
      --profile "$OUT/gpu_profile.json" ;;
    *) echo "unknown step '$s'; known: tests calibrate single355 dualpipe single1b fp8curve compiled"; exit 2 ;;
  esac
done
