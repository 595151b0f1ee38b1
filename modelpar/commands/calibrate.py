"""``modelpar calibrate``: measure this machine (GEMMs, attention, element-wise, collectives) into a hardware profile.

Locally it starts 1, 2, 4, … gloo processes as ``modelpar train`` would (each with its share of
the cores); on a GPU one process per device; under ``torchrun`` the launched processes (NCCL).
The profile (JSON) is what ``modelpar plan --hardware`` and ``modelpar train --hardware`` read.
"""

from __future__ import annotations

import argparse
import sys
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="measure this machine into a hardware profile for the cost model",
                              description=__doc__.splitlines()[0])
    p.add_argument("--out", default="hardware.json", help="profile file to write (default %(default)s)")
    p.add_argument("--ranks", help="process counts to measure compute with, e.g. 1,2,4 (default: 1, 2, 4, ... up to "
                                   "twice the cores, also the most allowed; local CPU runs only)")
    p.add_argument("--dtypes", help="matmul dtypes: fp32, bf16, fp16, fp64 (default fp32 on a CPU, bf16,fp32 on a GPU)")
    p.add_argument("--budget", type=float, default=0.05, help="seconds per timed measurement (default %(default)s)")
    p.add_argument("--name", help="the profile's name (default: host name and device)")
    p.add_argument("--compile", action="store_true",
                   help="also measure the layer as train --compile runs it (inductor; the grid's corners, one "
                        "compilation each: about a minute more on a CPU), for pricing compiled runs")
    p.set_defaults(func=run)


def _ints(flag: str, text: str) -> list[int]:
    from modelpar._validate import check_int

    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated whole numbers, got {text!r}") from None
    return [check_int(flag, v, minimum=1) for v in values]


def run(args: argparse.Namespace) -> int:
    from modelpar._validate import check_choice, check_number, check_output_path
    from modelpar.costmodel.profiles import DTYPES, busy_warning, save_profile

    check_output_path("--out", args.out, (".json",))
    ranks = sorted(set(_ints("--ranks", args.ranks))) if args.ranks else None
    if ranks:  # more processes than the cores take would run for minutes: one line before any is started
        from modelpar.calibrate.run import check_ranks

        check_ranks("--ranks", ranks)
    dtypes = tuple(check_choice("--dtypes", d.strip(), DTYPES) for d in args.dtypes.split(",")) if args.dtypes else None
    budget = check_number("--budget", args.budget, 0.0, strict=True)

    from modelpar.calibrate import calibrate

    start = time.perf_counter()
    profile = calibrate(ranks, dtypes, budget, args.name, compiled=args.compile)
    save_profile(profile, args.out)
    peak = ", ".join(f"{d} {tf * 1e3:.1f} GFLOP/s" for d, tf in profile.peak_tflops.items())
    print(f"modelpar calibrate: {profile.name} ({profile.device}, {profile.backend}, torch {profile.torch}), "
          f"best matmul {peak}, element-wise {profile.hbm_tb_s * 1e3:.1f} GB/s, "
          f"{sum(len(s) for op in profile.collectives.values() for s in op.values())} collective fits; "
          f"{time.perf_counter() - start:.0f} s -> {args.out}")
    busy = busy_warning(profile.cpu_busy)
    if busy:
        print(f"modelpar calibrate: warning: the profile was {busy}; measure again when the machine is quiet",
              file=sys.stderr)
    return 0
