"""§6 3D parallelism: pick (t, p, d) with a cost model.

Part 1 runs the reference's search for the 1T model of Megatron SC'21 Table 1 (128 layers,
h = 25600, 3072 A100, batch 3072) with the text's own model, then with the calibrated one.
Part 2 is §6.3's GPT-3 table: on 1024 GPUs with t = 8, bubble = (n/t - d)/B and the step time
barely moves. Part 3 summarises how far the planner is from published runs.
"""

from __future__ import annotations

from modelpar.costmodel import (
    DEFAULT,
    REFERENCE,
    ParallelConfig,
    engine_assumptions,
    estimate,
    make_cluster,
    model_preset,
    search,
)
from modelpar.costmodel.published import validate
from modelpar.costmodel.report import accuracy_summary, format_table


def part1() -> None:
    """§6.2: the 1T model. The text's model: full recomputation, plain 1F1B, matmuls at 75% of peak."""
    print("== Part 1: the 1T model on 3072 A100-80GB, batch 3072 (the text's model) ==")
    model, cluster = model_preset("megatron-1t"), make_cluster("a100-80gb", 3072)
    res = search(model, cluster, 3072, REFERENCE, v=1, recompute="full", sequence_parallel=False, zero=0)
    best = {}
    for e in res.ranked:
        best.setdefault((e.config.t, e.config.p), e)
    print(f"{'t':>3} {'p':>4} {'d':>3} {'step s':>7} {'TFLOP/s':>8} {'TP s':>6} {'TP link':>8} {'bubble':>7} {'mem GB':>7}")
    for (t, p), e in sorted(best.items()):
        if t in (4, 8, 16) and p in (16, 32, 64, 128):
            print(f"{t:>3} {p:>4} {e.config.d:>3} {e.step_time_s:>7.1f} {e.tflops_per_gpu:>8.1f} {e.time['tp']:>6.1f} "
                  f"{e.links['tp']:>8} {e.bubble_over_ideal_compute:>7.1%} {e.memory_gb:>7.1f}")
    win = res.ranked[0].config
    print(f"chosen: t = {win.t}, p = {win.p}, d = {win.d}; t = 16 puts the all-reduces on InfiniBand.")
    paper = ParallelConfig(8, 64, 6)
    ref = estimate(model, cluster, paper, 3072, REFERENCE)
    cal = estimate(model, cluster, ParallelConfig(8, 64, 6, 1, 2), 3072, engine_assumptions(DEFAULT, "megatron-2021"))
    print(f"paper's layout t = 8, p = 64: training state {ref.memory['state'] / 1e9:.1f} GB per GPU (t*p = 512), "
          f"{ref.tflops_per_gpu:.0f} TFLOP/s per GPU at 75% matmul efficiency;")
    print(f"  calibrated model, Megatron-LM as in SC'21 (GEMM curve, element-wise work, real link bandwidth, output "
          f"layer on the last stage, v = 2): {cal.tflops_per_gpu:.0f} TFLOP/s; measured 163 (52% of peak), "
          f"502 PFLOP/s in all.")
    full = search(model, cluster, 3072, DEFAULT)
    print("searching everything (v, micro-batch, selective recomputation, sequence parallelism), calibrated model:")
    print(format_table(full.ranked[:3]))
    print()


def part2() -> None:
    """§6.3: GPT-3 on 1024 GPUs, t = 8: the layouts that fit, their bubble and step time."""
    print("== Part 2: GPT-3 175B on 1024 A100, t = 8, batch 1536 (the text's model) ==")
    model, cluster = model_preset("gpt3-175b"), make_cluster("a100-80gb", 1024)
    res = search(model, cluster, 1536, REFERENCE, t=8, micro_batch=1, v=1, recompute="full", sequence_parallel=False,
                 zero=0)
    rows = sorted(res.ranked, key=lambda e: e.config.p)
    fastest = min(e.step_time_s for e in rows)
    print(f"{'p':>3} {'d':>3} {'m':>4} {'bubble':>7} {'(n/t-d)/B':>10} {'DP s':>6} {'step s':>7} {'vs best':>8} {'mem GB':>7}")
    for e in rows:
        c = e.config
        print(f"{c.p:>3} {c.d:>3} {e.microbatches:>4} {e.bubble_over_ideal_compute:>7.2%} {(1024 / 8 - c.d) / 1536:>10.2%} "
              f"{e.time['dp']:>6.3f} {e.step_time_s:>7.3f} {e.step_time_s / fastest - 1:>+8.2%} {e.memory_gb:>7.1f}")
    print(f"dropped: {dict(res.rejected)} (p = 4 needs {16 * model.params / 32 / 1e9:.0f} GB of state alone)")
    print()


def part3() -> None:
    """The calibrated model against published runs (each a `modelpar plan` command line), per source."""
    print("== Part 3: predicted vs published step time (the full table: modelpar plan --validate) ==")
    for name, err in accuracy_summary(validate()).items():
        print(f"  {name:<46} mean |error| {err:5.1%}")


def main() -> None:
    part1()
    part2()
    part3()


if __name__ == "__main__":
    main()
