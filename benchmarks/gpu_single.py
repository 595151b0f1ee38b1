"""One GPU, bf16: `modelpar train` (eager, --compile, fp8) beside a hand-written Llama loop (eager, compiled).

The anchor is benchmarks/gpu_anchor.py, a copy of the steering repo's shared/bench/gpu_anchor.py (a
nanoGPT/torchtitan-style Llama: RMSNorm, rotary, GQA through SDPA, SwiGLU, bf16 autocast, fused fp32
AdamW, whole-model torch.compile): what a user would write instead of modelpar for one GPU. Both train
the same shape with the same batch: 32 sequences of 1024 tokens a step as 4 micro-batches, clipping at
1.0. modelpar runs its whole trainer in this process (a world of one over NCCL: pipeline runner with
one stage, flat gradient buckets, the step's loss and norm agreed as on many ranks, the chunked head
and loss). Sizes: 355M (h 1024, L 32, 16 q / 4 kv heads, ffn 2816: the anchor as it is) and 1.06B (h
2048, L 24, ffn 5632: the anchor's globals set to it).

Printed, per size and run: tokens/s (median step after the first ones), MFU against the GPU's dense bf16
peak (the cost model's presets; ModelConfig.flops_per_token for both, the same model), peak memory
allocated, and the ratio to the anchor (eager to eager, compiled to compiled). Aims (issue 36): eager
>= 0.95x, --compile >= 1.0x the compiled anchor at 355M; MFU >= 45% at 1B with --compile, more with fp8.

    python benchmarks/gpu_single.py                          # everything (about 6 minutes on an H200)
    python benchmarks/gpu_single.py --sizes 355m --runs modelpar,anchor --json out.json
    python benchmarks/gpu_single.py --smoke                  # any machine: tiny shapes, a few steps
    python benchmarks/gpu_single.py --profile prof.txt --profile-run "modelpar --compile"   # + a profiler table
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import re
import statistics
import sys
import time
from argparse import Namespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_anchor as A

from modelpar.distributed import free_port
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, train
from modelpar.training.display import peak_tflops_of

SIZES = {"355m": dict(hidden=1024, layers=32, heads=16, kv_heads=4, ffn=2816),
         "1b": dict(hidden=2048, layers=24, heads=16, kv_heads=4, ffn=5632)}
SMOKE = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=192)
RUNS = {  # name -> (modelpar's TrainConfig changes, or None for the anchor, compiled?)
    "modelpar": ({}, False),
    "modelpar --compile": ({"compile": True}, True),
    "modelpar --compile stage": ({"compile": True, "compile_scope": "stage"}, True),  # the stage whole, one graph
    "modelpar --compile fp8": ({"compile": True, "precision": "fp8"}, True),
    "anchor": (None, False),
    "anchor compiled": (None, True),
}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def run_modelpar(model: ModelConfig, changes: dict, steps: int, batch: int, micro: int, warmup: int) -> dict:
    """tokens/s and peak memory of `modelpar train` at t = p = d = 1 in this process (a world of one)."""
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0) if cuda else None)
    settings = dict(model=model, tp=1, pp=1, dp=1, microbatches=micro, batch_size=batch, steps=steps, warmup=5,
                    precision="bf16", eval_every=0, eval_batches=1)
    cfg = TrainConfig(**{**settings, **changes})
    _free()
    t0 = time.perf_counter()
    result = train(cfg)
    return {"tokens_per_s": cfg.tokens_per_step / statistics.median(result.step_times[warmup:]),
            "peak_gib": _peak_gib(), "first_step_s": result.step_times[0], "wall_s": time.perf_counter() - t0,
            "compile_s": result.compile_seconds, "final_loss": result.losses[-1]}


def run_anchor(shape: dict, compiled: bool, steps: int, peak: float, smoke: bool) -> dict:
    """tokens/s and peak memory of the hand-written loop (gpu_anchor.run), its globals set to ``shape``."""
    if not smoke:  # the anchor's constants at this size (at 355M they are its own)
        A.h, A.L, A.nh, A.nkv, A.ffn = shape["hidden"], shape["layers"], shape["heads"], shape["kv_heads"], shape["ffn"]
        A.hd = A.h // A.nh
    A.args = Namespace(steps=steps, peak=peak, smoke=smoke, no_compile=not compiled)
    _free()
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        A.run(compiled)
    text = out.getvalue()
    rate = float(re.search(r"tokens/s ([\d,]+)", text).group(1).replace(",", ""))
    return {"tokens_per_s": rate, "peak_gib": float(re.search(r"peak mem ([\d.]+) GiB", text).group(1)),
            "wall_s": time.perf_counter() - t0, "line": text.strip()}


def profile_modelpar(model: ModelConfig, changes: dict, batch: int, micro: int, path: str) -> None:
    """A torch.profiler table (top CPU and CUDA time) of two steps of modelpar's trainer (``changes``: a run's)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    settings = dict(model=model, tp=1, pp=1, dp=1, microbatches=micro, batch_size=batch, steps=6, warmup=5,
                    precision="bf16", eval_every=0, eval_batches=1)
    cfg = TrainConfig(**{**settings, **changes})
    with profile(activities=acts, schedule=schedule(wait=3, warmup=1, active=2)) as prof:
        from modelpar.training import loop

        original = loop._Run.step

        def step(self, i):  # one profiler step per training step
            verdict = original(self, i)
            prof.step()
            return verdict

        loop._Run.step = step
        try:
            train(cfg)
        finally:
            loop._Run.step = original
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps: checks the script on any machine")
    ap.add_argument("--sizes", default="355m,1b", help="comma-separated: " + ", ".join(SIZES))
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of a modelpar run's step here")
    ap.add_argument("--profile-run", default="modelpar", help="the run --profile profiles (default: eager)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_single.py: no CUDA device; run with --smoke to check the script on this machine")
    if cuda:
        torch.cuda.set_device(0)
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    peak = peak_tflops_of(name) or 989.0
    steps, warmup = (4, 2) if args.smoke else (args.steps, args.warmup)
    batch, micro, seq = (8, 2, 64) if args.smoke else (32, 4, 1024)
    runs = [r.strip() for r in args.runs.split(",")]
    if args.smoke:
        runs = [r for r in runs if "fp8" not in r or cuda]
    figures: dict = {"device": name, "peak_tflops": peak, "torch": torch.__version__, "steps": steps, "sizes": {}}
    for size in args.sizes.split(","):
        shape = SMOKE if args.smoke else SIZES[size]
        model = ModelConfig(arch="llama", vocab_size=256, seq_len=seq, **shape)
        if args.smoke:
            A.h, A.L, A.nh, A.nkv, A.ffn, A.s, A.B, A.M = 64, 2, 4, 2, 192, 64, 8, 2
            A.hd = 16
        else:
            A.s, A.B, A.M = seq, batch, micro
        rows = figures["sizes"][size] = {"parameters": model.num_parameters(), "runs": {}}
        for run in runs:
            changes, compiled = RUNS[run]
            try:
                if changes is None:
                    got = run_anchor(shape, compiled, steps, peak, args.smoke)
                else:
                    got = run_modelpar(model, changes, steps, batch, micro, warmup)
            except Exception as err:  # one failed run must not lose the others' figures
                got = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            got["mfu"] = model.flops_per_token() * got.get("tokens_per_s", 0.0) / (peak * 1e12)
            rows["runs"][run] = got
            print(f"[{size}] {run}: {json.dumps(got)}", flush=True)
            if args.json:  # after every run: a run cut short by a time limit keeps the figures before it
                with open(args.json, "w") as f:
                    json.dump(figures, f, indent=1)
        if args.profile and not args.smoke and size == args.sizes.split(",")[0]:
            try:
                profile_modelpar(model, RUNS[args.profile_run][0] or {}, batch, micro, args.profile)
            except Exception as err:
                print(f"profile failed: {type(err).__name__}: {err}", flush=True)
    print(f"\n{name}, torch {torch.__version__}, peak {peak:g} TFLOP/s, batch {batch} x {seq} tokens as {micro} "
          f"micro-batches, median of steps {warmup + 1}..{steps}\n")
    print(f"{'size':>5} {'run':>24} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'vs anchor':>10} {'compile s':>9}")
    for size, rows in figures["sizes"].items():
        base = {c: rows["runs"].get("anchor compiled" if c else "anchor", {}).get("tokens_per_s") for c in (False, True)}
        for run, got in rows["runs"].items():
            if "error" in got:
                print(f"{size:>5} {run:>24}  failed: {got['error'][:80]}")
                continue
            anchor = base[RUNS[run][1]]
            ratio = f"{got['tokens_per_s'] / anchor:.3f}x" if anchor and RUNS[run][0] is not None else "-"
            comp = got.get("compile_s")
            print(f"{size:>5} {run:>24} {got['tokens_per_s']:>10,.0f} {100 * got['mfu']:>5.1f}% {got['peak_gib']:>9.1f} "
                  f"{ratio:>10} {comp if comp is None else round(comp, 1)!s:>9}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
