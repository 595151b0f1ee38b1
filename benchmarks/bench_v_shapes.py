"""Steps and peaks (held until W) of 1F1B, ZB-H2, ZB-V, V-Half and V-Min planned with the given F, I, W
(issue 39): the table in docs/schedules.md. Pure simulation, no transfers.

    python benchmarks/bench_v_shapes.py          # the table
    python benchmarks/bench_v_shapes.py --grid   # V-Min against 1F1B at 1:1.2:0.8, K = 4..12, M = 2K..4K
"""

from __future__ import annotations

import math
import sys

from modelpar.schedules import Kind, get_schedule
from modelpar.simulate import Costs, simulate

NAMES = ("1f1b", "zb-h2", "zb-v", "v-half", "v-min")


def main() -> None:
    print("| F:I:W | K, M | " + " | ".join(NAMES) + " | bounds |")
    for f, i, w in ((1.0, 1.0, 1.0), (1.0, 1.2, 0.8)):
        costs, kinds = Costs(forward=f, backward=i + w, weight=w), {Kind.F: f, Kind.I: i, Kind.W: w}
        for k, m in ((4, 8), (4, 32), (6, 12), (8, 16), (12, 24)):
            row = []
            for name in NAMES:
                tl = simulate(get_schedule(name, ranks=k, microbatches=m, costs=kinds), costs)
                row.append(f"{tl.step_time:.4g}, {max(tl.peak_held):g}")
            bounds = f"{math.ceil((k + 2) / 2)}, {math.ceil((k + 2) / 3)}"
            print(f"| {f:g}:{i:g}:{w:g} | {k}, {m} | " + " | ".join(row) + f" | {bounds} |")


def grid() -> None:
    costs, kinds = Costs(forward=1, backward=2, weight=0.8), {Kind.F: 1.0, Kind.I: 1.2, Kind.W: 0.8}
    print("| K | M = 2K | M = 3K | M = 4K |")
    for k in (4, 6, 8, 12):
        row = []
        for m in (2 * k, 3 * k, 4 * k):
            one = simulate(get_schedule("1f1b", ranks=k, microbatches=m), costs).step_time
            vmin = simulate(get_schedule("v-min", ranks=k, microbatches=m, costs=kinds), costs).step_time
            row.append(f"{vmin:.4g} vs {one:.4g}")
        print(f"| {k} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    grid() if "--grid" in sys.argv[1:] else main()
