"""How far this machine reproduces itself: several ``calibrate`` + ``--validate-local`` pairs, compared pairwise.

    for i in 1 2 3; do
        modelpar calibrate --out hw$i.json
        modelpar plan --validate-local --hardware hw$i.json --local-ranks 1,2,4 --json > v$i.json
    done
    python benchmarks/validate_local_drift.py hw1.json v1.json hw2.json v2.json hw3.json v3.json

Prints, over the configurations with at most one rank per core: how far two measurement runs of the same grid
lie apart (mean |a/b − 1|), how far two calibrations' predictions of it lie apart, and each profile's MAPE
against each measurement run. A prediction cannot be shown closer than the first figure (docs/calibrate.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

from modelpar.calibrate.validate_local import cases
from modelpar.costmodel.profiles import load_profile
from modelpar.training.prediction import predict_run


def _mean_off(a: list[float], b: list[float]) -> float:
    return sum(abs(x / y - 1) for x, y in zip(a, b)) / len(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+", help="PROFILE MEASURED [PROFILE MEASURED ...]")
    parser.add_argument("--ranks", default="1,2,4", help="the --local-ranks they ran (default 1,2,4)")
    args = parser.parse_args()
    if len(args.pairs) % 2 or len(args.pairs) < 4:
        parser.error("give at least two PROFILE MEASURED pairs")
    grid = [c for c in cases([int(x) for x in args.ranks.split(",")], os.cpu_count() or 1) if not c.shared]
    predicted, measured = {}, {}
    for i, (profile, path) in enumerate(zip(args.pairs[::2], args.pairs[1::2]), 1):
        with open(path, encoding="utf-8") as f:
            rows = {c["name"]: c["measured"]["step_time_s"] for c in json.load(f)["configurations"]}
        grid = [c for c in grid if c.name in rows]
        hw = load_profile(profile)
        predicted[i] = {c.name: predict_run(c.cfg, hw).step_time_s for c in grid}
        measured[i] = rows
    names = [c.name for c in grid]
    print(f"{len(names)} configurations with at most one rank per core")
    for a, b in itertools.combinations(predicted, 2):
        m = _mean_off([measured[a][n] for n in names], [measured[b][n] for n in names])
        p = _mean_off([predicted[a][n] for n in names], [predicted[b][n] for n in names])
        print(f"runs {a} and {b}: measurements {100 * m:.1f}% apart, predictions {100 * p:.1f}% apart")
    for a in predicted:
        cells = ", ".join(f"{b}: {100 * _mean_off([predicted[a][n] for n in names], [measured[b][n] for n in names]):.1f}%"
                          for b in measured)
        print(f"profile {a}'s MAPE against the measurements of run {cells}")


if __name__ == "__main__":
    main()
