"""One ``--validate-local`` measurement, two predictions: with the profile's whole-work tables (``calibrate/layers.py``:
a real layer, the stage ends, cp's blockwise attention, the runtime and the optimizer step, measured) and without
them (compute composed from the kernel fits, the model before profile version 2).

    modelpar calibrate --out hw.json
    modelpar plan --validate-local --hardware hw.json --local-ranks 1,2,4 --json > validate_local.json
    python benchmarks/validate_local_ab.py hw.json validate_local.json 1,2,4

Prints each configuration's measured step and both predictions, the step-time MAPE of each over the
configurations with at most one rank per core and over those sharing cores, and each one's pick per model
and process count against the fastest measured. Only the predictions are recomputed: no run is repeated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from modelpar.calibrate.validate_local import cases
from modelpar.costmodel.profiles import load_profile
from modelpar.training.prediction import predict_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("measured", help="modelpar plan --validate-local --json output")
    parser.add_argument("ranks", help="the --local-ranks it ran, e.g. 1,2,4")
    args = parser.parse_args()
    hw = load_profile(args.profile)
    models = {"whole": hw, "kernels": dataclasses.replace(hw, layer={}, ends={}, blockwise={}, runtime_s={},
                                                          optimizer={})}
    with open(args.measured, encoding="utf-8") as f:
        rows = {c["name"]: c for c in json.load(f)["configurations"]}
    errors: dict[tuple[str, bool], list[float]] = {}
    groups: dict[tuple[str, int], list[tuple[str, float, dict[str, float]]]] = {}
    for case in cases([int(x) for x in args.ranks.split(",")], os.cpu_count() or 1):
        row = rows.get(case.name)
        if row is None:
            continue
        measured = row["measured"]["step_time_s"]
        pred = {k: predict_run(case.cfg, p).step_time_s for k, p in models.items()}
        for k, v in pred.items():
            errors.setdefault((k, row["shared_cores"]), []).append(abs(v / measured - 1))
        groups.setdefault((case.model, case.cfg.dims.world_size), []).append((case.name, measured, pred))
        cells = "  ".join(f"{k} {1e3 * v:8.1f} ms ({100 * (v / measured - 1):+6.1f}%)" for k, v in pred.items())
        print(f"{case.name + (' *' if row['shared_cores'] else ''):<44} measured {1e3 * measured:8.1f} ms  {cells}")
    for (k, shared), errs in sorted(errors.items()):
        print(f"step-time MAPE, {k}: {100 * sum(errs) / len(errs):.1f}% over {len(errs)} configurations "
              f"{'sharing cores' if shared else 'with at most one rank per core'}")
    for key, group in sorted(groups.items()):
        fastest = min(m for _, m, _ in group)
        for k in models:
            name, m, _ = min(group, key=lambda g: g[2][k])
            print(f"{key[0]} on {key[1]} rank(s), {k} pick: {name}, {100 * (m / fastest - 1):.1f}% slower than the fastest")


if __name__ == "__main__":
    main()
