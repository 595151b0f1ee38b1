"""§4 Saving memory: 1F1B, interleaved 1F1B (and ZB-H1 beyond the reference).

Part 1: 1F1B has GPipe's bubble but holds K − d microbatches on device d instead of M.
Part 2: interleaving v = 2 chunks halves the bubble time at the cost of more transfers and
activations. Part 3: the bubble vs M, without and with transfer cost. Part 4: activation
recomputation on the reference's tanh chain (n = 64): none (store all), every-k, recompute-all. Part 5:
GPipe with and without recomputation, the memory model of §4.3 against a measured pipeline.
"""

from __future__ import annotations

import torch

from modelpar.bench import measure_gpipe
from modelpar.recompute import gpipe_activation_memory, scaled_tanh_stages, strategy_table
from modelpar.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from modelpar.simulate import Costs, simulate
from modelpar.simulate.ascii import ascii_chart
from modelpar.simulate.tables import headline, metrics_table, sweep_table


def part1() -> None:
    """§4.1: 1F1B K = 4, M = 8: 33 units, 27.3%, peak held microbatches [4, 3, 2, 1]."""
    print("== Part 1: 1F1B (PipeDream-Flush) ==")
    timeline = simulate(one_f_one_b(ranks=4, microbatches=8))
    print(headline(timeline))
    print(ascii_chart(timeline))
    print(f"GPipe holds {simulate(gpipe(ranks=4, microbatches=8)).peak_held} on the same step")
    print()


def part2() -> None:
    """§4.2: interleaved K = 4, M = 8, v = 2: bubble time halved, device 0 holds 5.5."""
    print("== Part 2: interleaved 1F1B, v = 2 (lower case = second chunk) ==")
    plain, inter = simulate(one_f_one_b(ranks=4, microbatches=8)), simulate(interleaved_1f1b(ranks=4, microbatches=8, chunks=2))
    print(headline(inter))
    print(ascii_chart(inter))
    print(f"bubble time per device: {plain.idle[0]:g} -> {inter.idle[0]:g} units (1/v)")
    print(f"device 0 peak: {plain.peak_held[0]:g} -> {inter.peak_held[0]:g}; "
          f"transfers: {plain.transfers} -> {inter.transfers}")
    schedules = (gpipe(ranks=4, microbatches=8), one_f_one_b(ranks=4, microbatches=8),
                 interleaved_1f1b(ranks=4, microbatches=8, chunks=2), zb_h1(ranks=4, microbatches=8))
    print(metrics_table([simulate(s) for s in schedules]))
    print()


def part3() -> None:
    """§4.1–4.2: with transfer 0.2, 1F1B's bubble exceeds GPipe's and v = 4 loses to v = 2."""
    print("== Part 3: bubble vs M, without and with transfer cost ==")
    specs = ["gpipe", "1f1b", ("interleaved", 2), ("interleaved", 4), "zb-h1"]
    print(sweep_table(specs, 4, (4, 8, 16, 32, 64), costs=(Costs(), Costs(transfer=0.2))))
    print()


def part4() -> None:
    """§4.3: tanh chain n = 64: held ≈ n/k + k (16 = 2√n at k = 8), gradients bitwise equal."""
    print("== Part 4: activation recomputation, tanh chain n = 64 (measured with saved-tensor hooks) ==")
    x = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    print(strategy_table([torch.tanh] * 64, x, [None, 2, 4, 8, 16, 32, "full", "recompute-all"]))
    print("every-k keeps n/k segment inputs + one segment's k activations: fewest at k = √64 = 8 (2√n = 16);")
    print("it re-runs each layer once (64 forwards, one more forward pass). The reference's n − n/k = 56")
    print("counts the recomputed intermediates: a segment's last output is the next checkpoint, but")
    print("autograd must still re-run that layer to rebuild its graph.")
    print()


def part5() -> None:
    """§4.3: GPipe N = 256, L = 48, K = 4: recomputation saves 8.7× at M = 32, costs a little at M = 1."""
    print("== Part 5: GPipe with recomputation, N = 256, L = 48, K = 4 (per device, samples × layers) ==")
    batch, layers, stages, width = 256, 48, 4, 4
    x = torch.randn(batch, width, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    print(f"{'M':>3} {'plain model':>12} {'measured':>9} {'recompute model':>16} {'measured':>9} {'saving':>7}  grads equal")
    for m in (1, 4, 32):
        plain, ours = (measure_gpipe(scaled_tanh_stages(layers, stages, width, r), x, m) for r in (None, "full"))
        p_model, r_model = (gpipe_activation_memory(batch, layers, stages, m, r) for r in (False, True))
        equal = all(torch.equal(a, b) for a, b in zip(plain.grads, ours.grads))
        print(f"{m:3} {p_model:12} {max(plain.sample_layers(width)):9.0f} {r_model:16} "
              f"{max(ours.sample_layers(width)):9.0f} {p_model / r_model:6.1f}x  {equal}")
    print("O(N × L/K) -> O(N + L/K × N/M): each device keeps every micro-batch's stage input and re-runs")
    print("one micro-batch's L/K layers at a time; at M = 1 that is N more than it saves.")
    print()


def main() -> None:
    part1()
    part2()
    part3()
    part4()
    part5()


if __name__ == "__main__":
    main()
