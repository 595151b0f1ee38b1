"""§2 GPipe: micro-batches, the clock-cycle table, the bubble, throughput vs one device.

Part 1: HW5's clock_cycles. Part 2: the GPipe timeline and its bubble (K − 1)/(M + K − 1),
checked against the simulator. Part 3: the throughput table, with and without transfer cost.
Part 4: micro-batches are not free — measured t(b) ≈ α + β·b, step time vs M, and M*.
"""

from __future__ import annotations

from modelpar.schedules import clock_cycles, gpipe
from modelpar.simulate import Costs, bubble_fraction_of_step, min_microbatches_for_bubble, pipeline_speedup, simulate
from modelpar.simulate.ascii import ascii_chart


def part1() -> None:
    """§2.2: wave k holds every (microbatch i, stage j) with i + j = k."""
    print("== Part 1: clock_cycles (HW5 Problem 2.1) ==")
    print("clock_cycles(3, 3):")
    for k, wave in enumerate(clock_cycles(3, 3)):
        print(f"  k = {k}: {wave}")
    waves = len(list(clock_cycles(2, 3)))
    print(f"clock_cycles(2, 3) has {waves} waves; "
          f"clock_cycles(0, 4): {list(clock_cycles(0, 4))}")
    waves = clock_cycles(-1, 3)  # a generator: no error yet
    try:
        next(waves)
    except ValueError as err:
        print(f"clock_cycles(-1, 3) raises on the first iteration: ValueError({err})")
    print()


def part2() -> None:
    """§2.3: GPipe K = 4, M = 8 takes 33 units with a 27.3% bubble; the formula agrees."""
    print("== Part 2: the bubble (backward = 2 x forward) ==")
    timeline = simulate(gpipe(ranks=4, microbatches=8))
    print(f"K = 4, M = 8: step {timeline.step_time:g} units, bubble {timeline.bubble:.1%}")
    print(ascii_chart(timeline))
    diff = max(
        abs(simulate(gpipe(ranks=k, microbatches=m)).bubble - bubble_fraction_of_step(stages=k, microbatches=m))
        for k in range(1, 9) for m in range(1, 65)
    )
    print(f"max |simulated - (K - 1)/(M + K - 1)| over K <= 8, M <= 64: {diff:.1e}")
    cells = (f"K={k}: {bubble_fraction_of_step(stages=k, microbatches=4 * k):.1%}" for k in (2, 4, 8, 16))
    print("M = 4K is not negligible:   " + ", ".join(cells))
    print("smallest M for bubble < 5%: " + ", ".join(
        f"K={k}: {min_microbatches_for_bubble(k, 0.05)} = 19(K-1) + 1" for k in (2, 4, 8, 16)
    ))
    print()


def part3() -> None:
    """§2.3: throughput relative to the whole model on one device, K·M/(M + K − 1)."""
    print("== Part 3: throughput vs one device ==")
    ms = (1, 4, 8, 32)
    for transfer in (0.0, 0.5):
        print(f"transfer = {transfer:g} forward".ljust(22) + "".join(f"{'M = ' + str(m):>9}" for m in ms))
        for k in (2, 4, 8):
            cells = [simulate(gpipe(ranks=k, microbatches=m), Costs(transfer=transfer)).speedup for m in ms]
            print(f"  K = {k}".ljust(22) + "".join(f"{c:8.2f}x" for c in cells))
    print(f"formula K = 8, M = 32: {pipeline_speedup(stages=8, microbatches=32):.2f}x")
    print()


def part4() -> None:
    """§2.4: time an MLP stage on b rows, fit α + β·b, step 3(M + K − 1)(α + βN/M), M* = √((K − 1)βN/α)."""
    import torch  # parts 1-3 are pure Python; only this part measures

    from modelpar.bench import microbatch_table, mlp_stage, optimal_microbatches, predicted_step_time

    print("== Part 4: micro-batches are not free (measured on this machine, 1 thread per stage) ==")
    torch.manual_seed(0)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scan = microbatch_table(mlp_stage(128), lambda b: torch.randn(b, 128), batch=1024, stages=4,
                                microbatch_counts=[2**i for i in range(9)], repeats=5)
    finally:
        torch.set_num_threads(saved)
    print(scan.format())
    print(f"fastest measured M = {scan.best_measured.microbatches}, formula M* = {scan.m_star:.1f} "
          "(reference: alpha 60-80 us, M* about 15-17; timings vary run to run)")
    steps = ", ".join(f"M = {m}: {predicted_step_time(0.2, 0.01, 1024, 4, m):.1f} ms" for m in (4, 16, 64))
    print(f"exercise 3 (K = 4, t(b) = 0.2 + 0.01 b ms, N = 1024): {steps}; "
          f"M* = {optimal_microbatches(0.2, 0.01, 1024, 4):.1f}")
    print()


def main() -> None:
    part1()
    part2()
    part3()
    part4()


if __name__ == "__main__":
    main()
