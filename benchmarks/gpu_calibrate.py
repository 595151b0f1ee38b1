"""One GPU: `modelpar calibrate`, then a local validation — short single-GPU runs beside their predictions.

1. Calibrates this GPU (GEMMs over a layer's shapes in bf16 and fp32, attention, element-wise work,
   op latency, the host's seconds per dispatched op: ``launch_s``) and writes the profile (``--out``,
   default gpu_profile.json).
2. Per model: the ops it dispatches (``training.dispatch.count_dispatch``) and its own kernels at its real
   shapes with CUDA events (SDPA attention, fused AdamW, autocast's casts: ``calibrate.model_kernels``).
3. Runs `modelpar train`'s loop in this process (a world of one, NCCL) for a grid of single-GPU
   configurations — two Llama-style model sizes × micro-batch counts × recomputation, bf16 — a few
   steps each, and prints the cost model's prediction on that profile beside the measured median
   step and the peak allocated memory (``LocalPrediction.allocated_bytes`` against
   ``torch.cuda.max_memory_allocated``), with the MAPE of each, then `modelpar plan --validate-local`'s table.

    python benchmarks/gpu_calibrate.py --measure-compiled  # a GPU: calibrate (the compiled layer too), 12 configurations
    python benchmarks/gpu_calibrate.py --compile --profile gpu_profile.json   # the same 12 compiled, on that profile
    python benchmarks/gpu_calibrate.py --smoke           # any machine: tiny models, 2 configurations (checks the script)

``--compile`` runs the configurations with each transformer block compiled (``TrainConfig.compile``), the
compile time left out (the median step after the first). The cost model prices their layers from the profile's
compiled layer (``layer_compiled``: ``modelpar calibrate --compile``, here ``--measure-compiled`` or ``--compile``
without ``--profile``); on a profile without it, as the eager runs (the summary's ``  compiled`` row says which).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics

import torch
import torch.distributed as dist

from modelpar.calibrate import calibrate
from modelpar.calibrate.model_kernels import measure_model_kernels
from modelpar.calibrate.validate_local import LocalCase, format_report
from modelpar.costmodel.profiles import busy_warning, load_profile, save_profile
from modelpar.distributed import free_port
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, train
from modelpar.training.dispatch import count_dispatch
from modelpar.training.prediction import predict_run


def _cases(smoke: bool, compiled: bool = False) -> list[LocalCase]:
    models = {"llama-h512": ModelConfig(arch="llama", hidden=512, heads=8, kv_heads=2, layers=8, seq_len=512),
              "llama-h1024": ModelConfig(arch="llama", hidden=1024, heads=16, kv_heads=4, layers=8, seq_len=1024)}
    if smoke:
        models = {"tiny": ModelConfig(arch="llama", hidden=64, heads=4, kv_heads=2, layers=2, seq_len=32)}
    base = TrainConfig(tp=1, pp=1, dp=1, steps=3 if smoke else 8, batch_size=16, eval_every=0, eval_batches=1,
                       warmup=1, precision="fp32" if smoke else "bf16", compile=compiled)
    out = []
    for name, model in models.items():
        for m in ((2,) if smoke else (1, 2, 4)):
            for recompute in ("none", "full"):
                cfg = dataclasses.replace(base, model=model, microbatches=m, recompute=recompute).check(1)
                out.append(LocalCase(name + (" compiled" if compiled else ""), cfg, False))
    return out


def _mape(pairs: list[tuple[float, float]]) -> str:
    """Mean absolute percentage error of (predicted, measured) pairs, or "-" without any."""
    return f"{100 * sum(abs(p / m - 1) for p, m in pairs) / len(pairs):.1f}%" if pairs else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny models on this machine's CPU (or GPU), 2 configurations")
    ap.add_argument("--out", default="gpu_profile.json", help="where to write the profile")
    ap.add_argument("--compile", action="store_true", help="the configurations with each block compiled (--compile)")
    ap.add_argument("--profile", help="price on this profile (an earlier run's --out) instead of calibrating again")
    ap.add_argument("--measure-compiled", action="store_true",
                    help="calibrate the compiled layer too (as modelpar calibrate --compile), for --compile runs later")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_calibrate.py: no GPU here; run with --smoke to check the script on this machine")
    if args.profile:
        profile, args.out = load_profile(args.profile), args.profile
    else:
        profile = calibrate(ranks=[1], dtypes=("fp32",) if not cuda else None, budget_s=0.02 if args.smoke else 0.05,
                            compiled=args.measure_compiled or args.compile)
        save_profile(profile, args.out)
    print(f"profile: {args.out} ({profile.name}, peak {profile.peak_tflops}, host {1e6 * (profile.launch(1) or 0):.1f} "
          "us per dispatched op)", flush=True)
    if busy := busy_warning(profile.cpu_busy):
        print(f"  warning: the profile was {busy}", flush=True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cases = _cases(args.smoke, args.compile)
    for name, cfg in {c.model: c.cfg for c in cases}.items():
        ops = count_dispatch(cfg.model, cfg.precision, cfg.loss_chunk > 0)
        kernels = measure_model_kernels(cfg.model, cfg.batch_size // cfg.microbatches, device, cfg.precision)
        print(f"  {name}: ops per layer {ops.layer_forward} forward / {ops.layer_backward} backward, head "
              f"{ops.head_forward} / {ops.head_backward}, step {ops.step(cfg.model.layers)}; kernels "
              + ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in kernels.items()), flush=True)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, device_id=device if cuda else None)
    try:
        done, steps, peaks = [], [], []
        for case in cases:
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            pred = predict_run(case.cfg, profile)
            r = train(case.cfg)
            item = case.cfg.param_dtype.itemsize
            case.predicted = {"step_time_s": pred.step_time_s, "bubble": pred.bubble,
                              **{f"{k}_bytes": v for k, v in pred.memory.items()}}
            case.measured = {"step_time_s": statistics.median(r.step_times[1:] or r.step_times), "bubble": 0.0,
                             "parameters_bytes": r.parameters_here * item, "gradients_bytes": r.gradient_bytes,
                             "optimizer_bytes": r.optimizer_state_bytes, "activations_bytes": r.activation_bytes or 0.0}
            steps.append((pred.step_time_s, case.measured["step_time_s"]))
            peak = ""
            if cuda:
                measured = torch.cuda.max_memory_allocated(device)
                peaks.append((pred.allocated_bytes, measured))
                peak = (f"; peak allocated {pred.allocated_bytes / 2**20:,.0f} MiB predicted, {measured / 2**20:,.0f} "
                        f"measured ({100 * (pred.allocated_bytes / measured - 1):+.1f}%)")
            print(f"  {case.name}: {1e3 * pred.step_time_s:.1f} ms predicted, {1e3 * case.measured['step_time_s']:.1f} "
                  f"ms measured ({100 * (pred.step_time_s / case.measured['step_time_s'] - 1):+.1f}%){peak}", flush=True)
            done.append(case)
        what = ""
        if args.compile:
            what = (" (compiled: layers priced from the profile's compiled layer)" if profile.layer_compiled else
                    " (compiled, priced as eager: the profile has no compiled layer)")
        print(f"step-time MAPE {_mape(steps)} over {len(steps)} configurations{what}; peak allocated memory MAPE "
              f"{_mape(peaks)}" + ("" if cuda else " (no GPU: not measured)"))
        print(format_report(done, profile))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
