#!/usr/bin/env bash
# Pipeline parallelism over NCCL, on one machine with 4 GPUs (or more): the checks that could not
# run where modelpar was built (CPUs only; a single GPU cannot hold two NCCL ranks).
#
#   bash benchmarks/gpu_pipeline.sh          # from the repository root; NPROC=8 for 8 GPUs
#
# 1. `modelpar train --tp 2 --pp 2 --backend nccl`: every dimension on NCCL, pipeline tensors on
#    the GPU, message sequence numbers checked on receipt (MODELPAR_CHECK_MESSAGES=1).
# 2. The same run with --pipeline-gloo (pipeline messages staged through host memory over gloo):
#    its training losses must equal run 1's to float32 rounding — the same lowered programs on
#    two backends.
# 3. A 4-stage `modelpar bench pipeline` under NCCL for GPipe, 1F1B, interleaved (v = 2) and
#    ZB-H1: measured vs simulated step time and bubble (CUDA-event timing), peak held
#    microbatches as simulated, no hang.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NPROC=${NPROC:-4}
OUT=${OUT:-gpu-pipeline-out}
# one line and exit 2 on a machine that cannot run it (t = 2 x p = 2 x d = NPROC / 4, one GPU per rank)
python -c "import sys; from modelpar.distributed.devices import require_gpus
if $NPROC % 4: sys.exit('gpu_pipeline.sh: NPROC must be a multiple of 4 (t = 2, p = 2, d = NPROC / 4), got $NPROC')
try: require_gpus($NPROC, 'gpu_pipeline.sh (NPROC=$NPROC)')
except ValueError as err: print(err, file=sys.stderr); sys.exit(2)"
mkdir -p "$OUT"
run() { torchrun --standalone --nproc-per-node "$NPROC" -m modelpar "$@"; }

echo "== 1. train t=2 p=2 on NCCL (pipeline on the GPU), messages checked"
MODELPAR_CHECK_MESSAGES=1 run train --tp 2 --pp 2 --dp $((NPROC / 4)) --backend nccl --steps 40 --eval-every 20 \
    --no-progress --out "$OUT/train-nccl"

echo "== 2. the same with the pipeline staged through gloo"
MODELPAR_CHECK_MESSAGES=1 run train --tp 2 --pp 2 --dp $((NPROC / 4)) --backend nccl --pipeline-gloo --steps 40 \
    --eval-every 20 --no-progress --out "$OUT/train-gloo"

python - "$OUT" <<'EOF'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/{d}/summary.json")) for d in ("train-nccl", "train-gloo"))
diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
print(f"losses NCCL vs gloo pipeline: max |difference| {diff:.2e} over {len(a['losses'])} steps")
assert diff < 1e-4, "the two pipeline backends trained differently"
EOF

echo "== 3. bench pipeline, 4 stages on NCCL"
for spec in "gpipe 1" "1f1b 1" "interleaved 2" "zb-h1 1"; do
    set -- $spec
    MODELPAR_CHECK_MESSAGES=1 torchrun --standalone --nproc-per-node 4 -m modelpar bench pipeline --backend nccl \
        --schedule "$1" --chunks "$2" --ranks 4 --microbatches 8 --width 1024 --blocks 2 --rows 1024 --steps 10 \
        --png "$OUT/bench-$1.png"
done
echo "all GPU pipeline checks passed; charts in $OUT/"
