"""One GPU: `modelpar calibrate`, then a local validation — short single-GPU runs beside their predictions.

1. Calibrates this GPU (GEMMs over a layer's shapes in bf16 and fp32, attention, element-wise work,
   op latency) and writes the profile (``--out``, default gpu_profile.json).
2. Runs `modelpar train`'s loop in this process (a world of one, NCCL) for a grid of single-GPU
   configurations — two Llama-style model sizes × micro-batch counts × recomputation, bf16 — a few
   steps each, and prints the cost model's prediction on that profile beside the measured median
   step, rank 0's bytes, and the step-time MAPE, as `modelpar plan --validate-local` does on CPUs.
   On a GPU the peak allocated memory is printed too.

    python benchmarks/gpu_calibrate.py                   # a GPU: calibrate, then 12 configurations
    python benchmarks/gpu_calibrate.py --smoke           # any machine: tiny models, 2 configurations (checks the script)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import torch.distributed as dist

from modelpar.calibrate import calibrate
from modelpar.calibrate.validate_local import LocalCase, format_report
from modelpar.costmodel.profiles import save_profile
from modelpar.distributed import free_port
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, train
from modelpar.training.prediction import predict_run


def _cases(smoke: bool) -> list[LocalCase]:
    models = {"llama-h512": ModelConfig(arch="llama", hidden=512, heads=8, kv_heads=2, layers=8, seq_len=512),
              "llama-h1024": ModelConfig(arch="llama", hidden=1024, heads=16, kv_heads=4, layers=8, seq_len=1024)}
    if smoke:
        models = {"tiny": ModelConfig(arch="llama", hidden=64, heads=4, kv_heads=2, layers=2, seq_len=32)}
    base = TrainConfig(tp=1, pp=1, dp=1, steps=3 if smoke else 8, batch_size=16, eval_every=0, eval_batches=1,
                       warmup=1, precision="fp32" if smoke else "bf16")
    out = []
    for name, model in models.items():
        for m in ((2,) if smoke else (1, 2, 4)):
            for recompute in ("none", "full"):
                out.append(LocalCase(name, dataclasses.replace(base, model=model, microbatches=m, recompute=recompute)
                                     .check(1), False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on this machine's CPU (or GPU), 2 configurations")
    ap.add_argument("--out", default="gpu_profile.json", help="where to write the profile")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_calibrate.py: no GPU here; run with --smoke to check the script on this machine")
    profile = calibrate(ranks=[1], dtypes=("fp32",) if not cuda else None, budget_s=0.02 if args.smoke else 0.05)
    save_profile(profile, args.out)
    print(f"profile: {args.out} ({profile.name}, peak {profile.peak_tflops})", flush=True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, device_id=device if cuda else None)
    try:
        done = []
        for case in _cases(args.smoke):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            pred = predict_run(case.cfg, profile)
            r = train(case.cfg)
            item = case.cfg.param_dtype.itemsize
            case.predicted = {"step_time_s": pred.step_time_s, "bubble": pred.bubble,
                              **{f"{k}_bytes": v for k, v in pred.memory.items()}}
            case.measured = {"step_time_s": statistics.median(r.step_times[1:] or r.step_times), "bubble": 0.0,
                             "parameters_bytes": r.parameters_here * item, "gradients_bytes": r.gradient_bytes,
                             "optimizer_bytes": r.optimizer_state_bytes, "activations_bytes": r.activation_bytes or 0.0}
            peak = f", peak allocated {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if cuda else ""
            print(f"  {case.name}: {1e3 * case.measured['step_time_s']:.1f} ms measured, "
                  f"{1e3 * pred.step_time_s:.1f} ms predicted{peak}", flush=True)
            done.append(case)
        print(format_report(done, profile))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
