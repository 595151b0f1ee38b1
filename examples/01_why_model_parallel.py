"""§1 Why model parallelism: the naive layer-wise split keeps one device busy at a time.

Part 1 splits GPT-3 layer-wise over 80 GB cards (§1.1): 8 stages for inference, 48 for training.
Part 2 (this file's schedule-simulator part) draws the naive K = 4 timeline of §1.2 and its
utilisation: exactly 1/K = 25%, and 20% once each stage-to-stage transfer costs half a forward.
Part 3 compares the bytes per second each GPU must move under pipeline, tensor and data
parallelism (§1.3) with NVLink and InfiniBand.
"""

from __future__ import annotations

from modelpar.costmodel import bandwidth_demand, layerwise_stage_gb, model_preset, stages_needed
from modelpar.schedules import naive
from modelpar.simulate import Costs, simulate
from modelpar.simulate.ascii import ascii_chart


def part1() -> None:
    """§1.1: GPT-3 (96 layers, h = 12288) split layer-wise on 80 GB cards, activations not counted."""
    print("== Part 1: splitting GPT-3 layer-wise over 80 GB cards ==")
    gpt3 = model_preset("gpt3-175b")
    print(f"{gpt3.params / 1e9:.1f}B parameters; 16-bit weights {gpt3.params * 2 / 1e9:.0f} GB, "
          f"training state (16 B/param) {gpt3.params * 16 / 1e12:.2f} TB; embedding = "
          f"{gpt3.vocab * gpt3.hidden / gpt3.layer_params:.2f} layer")
    print(f"{'stages K':>8} {'layers/stage':>12} {'inference GB':>13} {'training GB':>12}   (x: over 80 GB)")
    for k in (4, 8, 16, 24, 32, 48, 96):
        cells = [f"{gb:.1f}{'' if gb <= 80 else ' x'}" for gb in (layerwise_stage_gb(gpt3, k, b) for b in (2, 16))]
        print(f"{k:>8} {gpt3.layers // k:>12} {cells[0]:>13} {cells[1]:>12}")
    print(f"fewest stages (whole 8-GPU nodes, equal layers, first stage with the embedding): "
          f"inference {stages_needed(gpt3, 80, 2)}, training {stages_needed(gpt3, 80, 16)}")
    print()


def part2() -> None:
    """§1.2: naive model parallelism, K = 4 (one cell = half a forward, as the reference draws it)."""
    print("== Part 2: naive model parallelism, K = 4 (whole batch at once) ==")
    timeline = simulate(naive(ranks=4))
    print(ascii_chart(timeline, unit=0.5))
    print(f"utilisation per device: {1 - timeline.bubble:.0%} (= 1/K)")
    with_transfer = simulate(naive(ranks=4), Costs(transfer=0.5))
    print("with a transfer of half a forward between stages:")
    print(ascii_chart(with_transfer, unit=0.5))
    print(
        f"utilisation per device: {1 - with_transfer.bubble:.0%}, step {with_transfer.step_time:g} "
        f"units instead of {timeline.step_time:g}"
    )
    print()


def part3() -> None:
    """§1.3: bytes/s each GPU must send to keep up with A100 peak, GPT-3, one 2048-token sequence, 8 GPUs."""
    print("== Part 3: communication intensity of the three splits (GPT-3, 8 GPUs, A100 peak) ==")
    gpt3 = model_preset("gpt3-175b")
    need = bandwidth_demand(gpt3.layers, gpt3.hidden, gpt3.seq, gpt3.params, 312e12, gpus=8)
    what = {"pipeline": "8 stages: one s x h activation + gradient per 12 layers",
            "tensor": "t = 8: 4 all-reduces of s x h per layer",
            "data": "d = 8: all-reduce of all 16-bit gradients"}
    print(f"{'split':<9} {'GB/s per GPU':>12} {'/ NVLink 300':>13} {'/ IB 25':>8}  what moves")
    for kind, rate in need.items():
        print(f"{kind:<9} {rate / 1e9:>12.2f} {rate / 300e9:>13.1%} {rate / 25e9:>8.1%}  {what[kind]}")
    print(f"tensor / pipeline = {need['tensor'] / need['pipeline']:.0f}x: NVLink copes with tensor parallelism, "
          f"InfiniBand does not; data parallelism improves with more sequences per GPU and overlaps backward.")
    print()


def main() -> None:
    part1()
    part2()
    part3()


if __name__ == "__main__":
    main()
