"""fp8 against bf16 on one GPU: the loss curves of a short run, beside two bf16 runs' own spread (seeds 0 and 1).

`modelpar train`'s loop in this process at 355M (benchmarks/gpu_single.py's shape), eager, the same batches:
bf16 seed 0, bf16 seed 1 (what the curve varies by without any change) and fp8 seed 0. Printed: the mean
training loss over the last 10 steps of each, and |fp8 − bf16| beside |bf16 seed 1 − bf16 seed 0|.

    python benchmarks/gpu_fp8_curve.py [--steps 40] [--json curves.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_single import SIZES

from modelpar.distributed import free_port
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_fp8_curve.py: fp8 needs a GPU with float8 matrix units; this machine has no CUDA device")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    model = ModelConfig(arch="llama", vocab_size=256, seq_len=1024, **SIZES["355m"])
    curves = {}
    for name, precision, seed in (("bf16", "bf16", 0), ("bf16 seed 1", "bf16", 1), ("fp8", "fp8", 0)):
        cfg = TrainConfig(model=model, tp=1, pp=1, dp=1, microbatches=4, batch_size=32, steps=args.steps, warmup=10,
                          precision=precision, seed=seed, eval_every=0, eval_batches=1)
        result = train(cfg)
        curves[name] = result.losses
        stop = "" if result.stop is None else f" (stopped early: {result.stop})"
        print(name, [round(x, 3) for x in curves[name]], stop, flush=True)
    tail = {k: statistics.mean(v[-10:]) for k, v in curves.items()}
    print(f"\nmean loss of the last 10 of {args.steps} steps: " + ", ".join(f"{k} {v:.4f}" for k, v in tail.items()))
    print(f"|fp8 - bf16| = {abs(tail['fp8'] - tail['bf16']):.4f}; bf16's own spread |seed 1 - seed 0| = "
          f"{abs(tail['bf16 seed 1'] - tail['bf16']):.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(curves, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
