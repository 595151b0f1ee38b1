"""Steps and peaks (held until W) of 1F1B, ZB-H2, ZB-V, V-Half and V-Min planned with the given F, I, W
(issue 39): the table in docs/schedules.md. Pure simulation, no transfers.

    python benchmarks/bench_v_shapes.py
"""

from __future__ import annotations

import math

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


if __name__ == "__main__":
    main()
