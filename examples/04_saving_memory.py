"""§4 Saving memory: 1F1B, interleaved 1F1B (and ZB-H1 beyond the reference).

Part 1: 1F1B has GPipe's bubble but holds K − d microbatches on device d instead of M.
Part 2: interleaving v = 2 chunks halves the bubble time at the cost of more transfers and
activations. Part 3: the bubble vs M, without and with transfer cost.
"""

from __future__ import annotations

from modelpar.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from modelpar.simulate import Costs, simulate
from modelpar.simulate.ascii import ascii_chart
from modelpar.simulate.report import headline, metrics_table, sweep_table


def part1() -> None:
    """§4.1: 1F1B K = 4, M = 8: 33 units, 27.3%, peak held microbatches [4, 3, 2, 1]."""
    print("== Part 1: 1F1B (PipeDream-Flush) ==")
    timeline = simulate(one_f_one_b(4, 8))
    print(headline(timeline))
    print(ascii_chart(timeline))
    print(f"GPipe holds {simulate(gpipe(4, 8)).peak_activations} on the same step")
    print()


def part2() -> None:
    """§4.2: interleaved K = 4, M = 8, v = 2: bubble time halved, device 0 holds 5.5."""
    print("== Part 2: interleaved 1F1B, v = 2 (lower case = second chunk) ==")
    plain, inter = simulate(one_f_one_b(4, 8)), simulate(interleaved_1f1b(4, 8, 2))
    print(headline(inter))
    print(ascii_chart(inter))
    print(f"bubble time per device: {plain.idle[0]:g} -> {inter.idle[0]:g} units (1/v)")
    print(f"device 0 peak: {plain.peak_activations[0]:g} -> {inter.peak_activations[0]:g}; "
          f"transfers: {plain.transfers} -> {inter.transfers}")
    print(metrics_table([simulate(s) for s in (gpipe(4, 8), one_f_one_b(4, 8), interleaved_1f1b(4, 8, 2), zb_h1(4, 8))]))
    print()


def part3() -> None:
    """§4.1–4.2: with transfer 0.2, 1F1B's bubble exceeds GPipe's and v = 4 loses to v = 2."""
    print("== Part 3: bubble vs M, without and with transfer cost ==")
    specs = ["gpipe", "1f1b", ("interleaved", 2), ("interleaved", 4), "zb-h1"]
    print(sweep_table(specs, 4, (4, 8, 16, 32, 64), costs=(Costs(), Costs(transfer=0.2))))
    print()


def main() -> None:
    part1()
    part2()
    part3()


if __name__ == "__main__":
    main()
