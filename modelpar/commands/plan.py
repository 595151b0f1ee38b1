"""``modelpar plan``: rank every (t, p, d, micro-batch, v, recomputation, SP, ZeRO) layout of a model on a cluster.

``--validate`` instead runs every published run the package ships (each a ``modelpar plan``
command line, ``modelpar.costmodel.published``) through the same code and prints the accuracy table.
Pure Python (the cost model imports no torch); matplotlib is imported only for ``--plot``.
"""

from __future__ import annotations

import argparse
import json

from modelpar._validate import check_int
from modelpar.commands.outputs import add_outputs, check_outputs


def register(subparsers: argparse._SubParsersAction) -> None:
    from modelpar.costmodel.request import add_plan_arguments

    p = subparsers.add_parser("plan", help="pick (t, p, d) for a model on a cluster with a cost model",
                              description=__doc__.splitlines()[0])
    add_plan_arguments(p)
    out = add_outputs(p, "print the ranked list (or the accuracy table) as JSON",
                      {"--plot": ((".png", ".svg"), "draw step time and memory over (t, p) to a PNG or SVG")})
    out.add_argument("--top", type=int, default=5, help="rows to print (default 5)")
    out.add_argument("--validate", action="store_true",
                     help="predict every published run the package ships and print predicted vs measured")
    out.add_argument("--validate-local", action="store_true",
                     help="run short trainings of every split of this machine's ranks (schedules, micro-batches, "
                          "recomputation, two model sizes) and print predicted (--hardware) vs measured")
    out.add_argument("--local-ranks", metavar="N,N,...",
                     help="process counts for --validate-local (default: 1, 2, ... up to twice the cores; above the "
                          "cores a smaller grid, marked as sharing cores)")
    out.add_argument("--rounds", type=int, default=1,
                     help="with --validate-local: measure every configuration this many times, one round after "
                          "the other, and report how far the rounds differ (default 1)")
    p.set_defaults(func=run)


def validate(as_json: bool) -> int:
    """Print the accuracy table of ``modelpar.costmodel.published`` (or its rows as JSON)."""
    from modelpar.costmodel.published import validate as validate_runs
    from modelpar.costmodel.report import accuracy_summary, format_accuracy

    rows = validate_runs()
    if as_json:
        print(json.dumps({"runs": [{"name": r.run.name, "source": r.run.source, "command": f"modelpar plan {r.run.command}",
                                    "convention": r.run.convention, "measured": r.run.measured,
                                    "predicted": r.predicted, "error": r.error, "fitted": r.run.fitted,
                                    "set": r.run.split}
                                   for r in rows],
                          "mean_abs_error": accuracy_summary(rows)}, indent=1))
        return 0
    print(format_accuracy(rows))
    return 0


def validate_local(args: argparse.Namespace) -> int:
    """Short local runs, each beside its prediction on ``--hardware`` (torch is imported here, not by ``plan``)."""
    import os
    import sys

    from modelpar._validate import check_int
    from modelpar.calibrate import default_ranks
    from modelpar.calibrate.validate_local import LocalCase, cases, format_report, summarise
    from modelpar.calibrate.validate_local import validate_local as run_cases
    from modelpar.commands.calibrate import _ints
    from modelpar.costmodel.presets import CPU_DEFAULT
    from modelpar.costmodel.profiles import load_profile

    if args.gpu is not None:
        raise ValueError(f"--validate-local measures this machine: use --hardware PROFILE, not --gpu {args.gpu}")
    ranks = sorted(set(_ints("--local-ranks", args.local_ranks))) if args.local_ranks else default_ranks()
    check_int("--rounds", args.rounds, minimum=1)
    profile = load_profile(args.hardware) if args.hardware else CPU_DEFAULT
    if not args.hardware:
        print("modelpar plan: no --hardware profile: predicting with the nominal cpu-default "
              "(run modelpar calibrate first)", file=sys.stderr)
    todo = cases(ranks, os.cpu_count() or 1)
    print(f"modelpar plan: {len(todo)} configurations on {', '.join(map(str, ranks))} local processes",
          file=sys.stderr, flush=True)

    def progress(case: LocalCase) -> None:
        print(f"  {case.name}: {1e3 * case.measured['step_time_s']:.1f} ms", file=sys.stderr, flush=True)

    done = run_cases(todo, profile, progress, rounds=args.rounds)
    if args.json:
        print(json.dumps({"summary": summarise(done), "configurations": [
            {"name": c.name, "shared_cores": c.shared, "predicted": c.predicted, "measured": c.measured,
             "round_steps": c.round_steps} for c in done]},
            indent=1))
    else:
        print(format_report(done, profile))
    return 0


def run(args: argparse.Namespace) -> int:
    from modelpar.costmodel.report import explain, format_table, no_fit_error
    from modelpar.costmodel.request import request_from_args
    from modelpar.costmodel.schedule_choice import plan_schedule

    if args.validate:
        return validate(args.json)
    if args.validate_local:
        return validate_local(args)
    req = request_from_args(args)
    top = check_int("--top", args.top, minimum=1)
    check_outputs(args)  # fail before the search, in one line, not deep inside matplotlib
    result = req.search()
    model, cluster = req.model, req.cluster
    if not result.ranked:
        raise no_fit_error(model, cluster, req.batch, req.assumptions, result, pinned=bool(req.pins))
    if args.plot:
        from modelpar.costmodel.plot import plot_tp_grid

        plot_tp_grid(result, args.plot, f"{model.name} on {cluster.gpus} x {cluster.gpu.name}, batch {req.batch}",
                     cluster.gpu.memory_gb)
    if args.json:
        print(json.dumps([e.as_dict() for e in result.ranked[:top]], indent=1))
        return 0
    print(f"{model.name}: {model.params / 1e9:.1f}B parameters, {cluster.gpus} x {cluster.gpu.name} "
          f"({cluster.gpus_per_node} per node, {cluster.intra_node_gbps:g} / {cluster.inter_node_gbps:g} GB/s per GPU "
          f"inside / across nodes), batch {req.batch} x {model.seq} tokens; {len(result.ranked)} layouts fit.")
    print(format_table(result.ranked[:top]))
    print()
    print(explain(result, cluster, req.assumptions))
    choice = plan_schedule(model, cluster, result.ranked[0], req.assumptions)
    print(f"Schedule: {choice if isinstance(choice, str) else choice.why()}.")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
