"""§1 Why model parallelism: the naive layer-wise split keeps one device busy at a time.

Part 2 (this file's schedule-simulator part) draws the naive K = 4 timeline of §1.2 and its
utilisation: exactly 1/K = 25%, and 20% once each stage-to-stage transfer costs half a forward.
"""

from __future__ import annotations

from modelpar.schedules import naive
from modelpar.simulate import Costs, simulate
from modelpar.simulate.ascii import ascii_chart


def part2() -> None:
    """§1.2: naive model parallelism, K = 4 (one cell = half a forward, as the reference draws it)."""
    print("== Part 2: naive model parallelism, K = 4 (whole batch at once) ==")
    timeline = simulate(naive(4))
    print(ascii_chart(timeline, unit=0.5))
    print(f"utilisation per device: {1 - timeline.bubble:.0%} (= 1/K)")
    with_transfer = simulate(naive(4), Costs(transfer=0.5))
    print("with a transfer of half a forward between stages:")
    print(ascii_chart(with_transfer, unit=0.5))
    print(
        f"utilisation per device: {1 - with_transfer.bubble:.0%}, step {with_transfer.step_time:g} "
        f"units instead of {timeline.step_time:g}"
    )
    print()


def main() -> None:
    part2()


if __name__ == "__main__":
    main()
