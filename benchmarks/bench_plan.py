"""The planner's speed and accuracy: the full 1T search on 3072 GPUs, and the published runs' accuracy table.

    python benchmarks/bench_plan.py [--repeats 7]

Speed: every (t, p, d, micro-batch, v, recomputation, sequence parallelism, ZeRO stage) layout, even
and uneven pipelines, of the 1T model (Megatron SC'21 Table 1) on 3072 A100s, batch 3072, median of
``--repeats`` (budget 1 s), plus GPT-3 on 1024 A100s, Llama-3 405B on 16384 H100s and the whole
``modelpar plan`` command in a fresh interpreter. Accuracy: ``modelpar plan --validate``, the same table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from modelpar.costmodel import assumptions_for, make_cluster, model_preset, search
from modelpar.costmodel.published import validate
from modelpar.costmodel.report import format_accuracy


def timed_search(model: str, gpu: str, gpus: int, batch: int, repeats: int) -> tuple[float, float, int, int]:
    """Median wall and CPU seconds of the full search (CPU time is what a shared machine does not inflate)."""
    spec, cluster = model_preset(model), make_cluster(gpu, gpus)
    wall, cpu, fit, dropped = [], [], 0, 0
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        res = search(spec, cluster, batch, assumptions_for(gpu))
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        fit, dropped = len(res.ranked), sum(res.rejected.values())
    return statistics.median(wall), statistics.median(cpu), fit, dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    print("== search speed (median of", args.repeats, "runs; budget 1 s) ==")
    for model, gpu, gpus, batch in (("megatron-1t", "a100-80gb", 3072, 3072), ("gpt3-175b", "a100-80gb", 1024, 1536),
                                    ("llama3-405b", "h100-sxm", 16384, 2048)):
        sec, cpu, fit, dropped = timed_search(model, gpu, gpus, batch, args.repeats)
        print(f"{model:<12} {gpus:>6} {gpu}: {sec * 1e3:7.1f} ms wall, {cpu * 1e3:7.1f} ms CPU, {fit} layouts fit, "
              f"{dropped} dropped; {sec:.1%} of the 1 s budget")
    cmd = [sys.executable, "-m", "modelpar", "plan", "--model", "megatron-1t", "--gpus", "3072", "--batch", "3072"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    print(f"`modelpar plan --model megatron-1t --gpus 3072 --batch 3072`, fresh interpreter: "
          f"{time.perf_counter() - start:.2f} s")
    start = time.perf_counter()
    rows = validate()
    print(f"\n== accuracy (`modelpar plan --validate`, {len(rows)} runs in {time.perf_counter() - start:.2f} s) ==")
    print(format_accuracy(rows))


if __name__ == "__main__":
    main()
