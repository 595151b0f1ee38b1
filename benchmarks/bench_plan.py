"""The planner's speed and accuracy: the full 1T search on 3072 GPUs, and predictions vs published runs.

    python benchmarks/bench_plan.py [--repeats 7]

Speed: every (t, p, d, micro-batch, v, recomputation, sequence parallelism) layout of the 1T model
(Megatron SC'21 Table 1) on 3072 A100s, batch 3072, median of ``--repeats`` (target ≤ 1 s), plus
the GPT-3 search on 1024 GPUs and the whole ``modelpar plan`` command in a fresh interpreter.
Accuracy: predicted / measured for each run in ``modelpar.costmodel.published``, one run, side by side.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time

from modelpar.costmodel import assumptions_for, make_cluster, model_preset, plan
from modelpar.costmodel.published import compare


def timed_search(model: str, gpu: str, gpus: int, batch: int, repeats: int) -> tuple[float, int, int]:
    spec, cluster = model_preset(model), make_cluster(gpu, gpus)
    times, res = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        res = plan(spec, cluster, batch, assumptions_for(gpu))
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(res.ranked), sum(res.rejected.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    print("== search speed (median of", args.repeats, "runs; budget 1 s) ==")
    for model, gpu, gpus, batch in (("megatron-1t", "a100-80gb", 3072, 3072), ("gpt3-175b", "a100-80gb", 1024, 1536),
                                    ("llama3-405b", "h100-sxm", 16384, 2048)):
        sec, fit, dropped = timed_search(model, gpu, gpus, batch, args.repeats)
        print(f"{model:<12} {gpus:>6} {gpu}: {sec * 1e3:7.1f} ms, {fit} layouts fit, {dropped} dropped, "
              f"{sec:.3f}/1.0 s = {sec:.1%} of budget")
    cmd = [sys.executable, "-m", "modelpar", "plan", "--model", "megatron-1t", "--gpus", "3072", "--batch", "3072"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    print(f"`modelpar plan --model megatron-1t --gpus 3072 --batch 3072`, fresh interpreter: "
          f"{time.perf_counter() - start:.2f} s")

    print("\n== predicted / measured (TFLOP/s executed, or MFU, as each source reports) ==")
    rows = compare()
    print(f"{'run':<26} {'measured':>9} {'ours':>9} {'ratio':>6}  source")
    for run, pred, err in rows:
        fmt = "{:>9.1%}" if run.convention == "mfu" else "{:>9.0f}"
        print(f"{run.name:<26} {fmt.format(run.measured)} {fmt.format(pred)} {1 + err:>6.2f}  {run.source}")
    logs = [math.log(1 + err) for _, _, err in rows]
    mega = [math.log(1 + e) for r, _, e in rows if r.name.startswith(("Megatron", "Korthikanti"))]
    other = [math.log(1 + e) for r, _, e in rows if not r.name.startswith(("Megatron", "Korthikanti", "GPT-3"))]
    rms = lambda xs: math.exp(math.sqrt(sum(x * x for x in xs) / len(xs))) - 1  # noqa: E731
    print(f"rms error: Megatron-LM runs {rms(mega):.1%}, DeepSpeed + Llama 3 runs {rms(other):.1%}, "
          f"all runs {rms(logs):.1%}")


if __name__ == "__main__":
    main()
