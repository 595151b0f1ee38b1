"""``--compile`` priced beside measured on this machine: a few ``--validate-local`` configurations run eager and
compiled (each transformer block by inductor), each beside its prediction on one profile.

    modelpar calibrate --compile --out hw.json      # the compiled layer too (``layer_compiled``)
    python benchmarks/validate_compiled.py hw.json   # one and two ranks: t, p, d splits of the larger model

Prints the ``--validate-local`` table (eager and compiled rows side by side) and the step-time MAPE of each. On a
profile without the compiled layer the compiled rows are priced as eager: the second MAPE says how far that is.
The compile time is left out: a run's median step after its first two.
"""

from __future__ import annotations

import argparse
import dataclasses

from modelpar.calibrate.validate_local import cases, format_report, validate_local
from modelpar.costmodel.profiles import load_profile


def _mape(rows: list) -> str:
    return f"{100 * sum(abs(c.error()) for c in rows) / len(rows):.1f}%" if rows else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a modelpar calibrate profile (with --compile for the compiled layer)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every configuration (default 2)")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    eager = [c for c in cases([1, 2], 2) if c.model == "h128" and c.cfg.schedule == "1f1b" and c.cfg.zero == 0
             and c.cfg.cp == 1 and c.cfg.microbatches == 2 and c.cfg.recompute == "none"]
    compiled = [dataclasses.replace(c, model=c.model + "+compile", cfg=dataclasses.replace(c.cfg, compile=True))
                for c in eager]
    done = validate_local(eager + compiled, profile, lambda c: print(f"  {c.name}", flush=True), rounds=args.rounds)
    print(format_report(done, profile))
    print(f"eager MAPE {_mape(done[:len(eager)])}, compiled MAPE {_mape(done[len(eager):])} over {len(eager)} "
          f"configurations each ({'the compiled layer measured' if profile.layer_compiled else 'priced as eager'})")


if __name__ == "__main__":
    main()
