"""``modelpar simulate``: draw and compare pipeline schedules (pure Python: never imports torch).

No arguments: GPipe vs 1F1B vs interleaved (v = 2) vs ZB-H1 for K = 4, M = 8, charts and a
metrics table. ``--from FILE`` times a hand-written schedule (our text form, or torch's schedule
CSV when FILE ends in .csv); ``--export-csv FILE`` writes the schedule as torch's
``_PipelineScheduleRuntime`` CSV (with ``--comm``: its lowered program, "compute_comms");
``--sweep`` prints the bubble vs M tables of §2.3 and §4.1–4.2 without and with transfer cost;
``--comm`` prints each device's lowered program (compute plus SEND/RECV, matched by order);
``--schedule auto`` builds the fastest schedule within ``--memory-limit`` for ``--costs``;
``--pareto`` prints (``--png`` draws) step time against peak held activations for the whole
family and the synthesised schedules; ``--json`` is for scripts. ``--train-config FILE`` draws the
schedule a ``modelpar train --config FILE`` run executes, timed with the cost model's priced actions on
its hardware (``costmodel.local.predicted_timeline``): for a mixture of experts each MoE layer's
all-to-alls inside its F and B boxes. That path reads a TrainConfig, so it imports torch; the
others never do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from modelpar._validate import check_int, check_number
from modelpar.commands.outputs import add_outputs, check_outputs
from modelpar.schedules.registry import COMPARED, any_chunks, schedule_names

MAX_CHART_CELLS = 160  # wider charts are skipped in the terminal (use --png/--svg)
MAX_ACTIONS = 10_000_000  # K·M·v bound: beyond it a run would take minutes and gigabytes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", help="simulate, draw and compare pipeline schedules",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--schedule", action="append", metavar="NAME",
                   help=f"one of {{{', '.join(schedule_names())}}}, or auto (the fastest within --memory-limit); "
                        f"repeat to compare (default: {', '.join(COMPARED)})")
    p.add_argument("--ranks", metavar="K", help="pipeline ranks: processes along the pipeline (default 4; with --from, "
                                                "the file's, and a --ranks given must agree)")
    p.add_argument("--microbatches", metavar="M", help="microbatches per step (default 8; 1 for naive)")
    p.add_argument("--chunks", default="2", metavar="V",
                   help=f"chunks per device for {' and '.join(any_chunks())} (default 2; the others have a fixed v)")
    p.add_argument("--transfer", default="0", metavar="T",
                   help="time of one cross-device transfer, in forward units (default 0)")
    p.add_argument("--backward-ratio", default="2", metavar="R", help="backward time / forward time (default 2)")
    p.add_argument("--costs", metavar="F:I:W[,F:I:W...]", help="forward, input-backward and weight-backward time of a "
                   "whole stage: one triple for every stage or one per stage (default 1:R/2:R/2 with R = --backward-ratio)")
    p.add_argument("--memory-limit", metavar="L", help="most activations a rank may hold, in microbatches' worth of "
                   "one stage (--schedule auto; default: no limit)")
    p.add_argument("--pareto", action="store_true", help="step time vs peak held activations for the family and the "
                   "synthesised schedules (--png draws it)")
    p.add_argument("--from", dest="from_file", metavar="FILE", help="a hand-written schedule, one line of actions "
                   "(0F3 0B3 ...) per rank, or torch's schedule CSV (FILE.csv: one row per rank)")
    p.add_argument("--train-config", metavar="FILE", help="a modelpar train --config file (TOML/JSON): its schedule "
                   "with the cost model's predicted times on its hardware, MoE all-to-alls drawn inside F and B "
                   "(imports torch)")
    p.add_argument("--sweep", nargs="?", const="1,2,4,8,16,32,64", metavar="M,M,...",
                   help="print the bubble vs M table, without and with transfer cost")
    p.add_argument("--table", action="store_true", help="also print the step x device table")
    p.add_argument("--comm", action="store_true",
                   help="also print each device's lowered program: its actions with the sends and receives "
                        "they imply, in the order the runtime posts them (JSON: \"programs\")")
    p.add_argument("--unit", metavar="U", help="time per chart cell (default: the coarsest exact one)")
    add_outputs(p, "print metrics as JSON instead of charts", {
        "--png": ((".png",), "save the timelines as PNG"),
        "--svg": ((".svg",), "save the timelines as SVG"),
        "--trace": ((".json",), "save a Chrome trace (Perfetto) JSON"),
        "--export-csv": ((".csv",), "write the (one) schedule as torch's _PipelineScheduleRuntime CSV, one row per "
                                    "rank: compute_only, or compute_comms with --comm"),
    })
    p.set_defaults(func=run)


def _int(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None
    return check_int(name, value, minimum=minimum)


def _float(name: str, text: str, strict: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    return check_number(name, value, strict=strict)


def run(args: argparse.Namespace) -> int:
    from modelpar.schedules.registry import check_chunks, get_schedule, schedule_entry, schedule_names
    from modelpar.simulate import Costs, simulate

    check_outputs(args)
    if args.unit:
        _float("--unit", args.unit, strict=True)
    if args.train_config:
        return _train_config(args)
    from_file = _read_schedule(args.from_file) if args.from_file else None
    k = _int("--ranks", args.ranks or (str(from_file.num_ranks) if from_file else "4"), 1)
    m = _int("--microbatches", args.microbatches or "8", 1)
    if from_file is not None and args.ranks is not None and k != from_file.num_ranks:
        raise ValueError(f"--ranks {k} but --from {args.from_file!r} has {from_file.num_ranks} ranks (one line each): "
                         "drop --ranks or make them agree")
    v = _int("--chunks", args.chunks, 1)
    costs = Costs(transfer=_float("--transfer", args.transfer),
                  backward_ratio=_float("--backward-ratio", args.backward_ratio, strict=True))
    if k * m * v > MAX_ACTIONS:
        raise ValueError(
            f"--ranks x --microbatches x --chunks must be <= {MAX_ACTIONS:,}, got {k}x{m}x{v} = {k * m * v:,}"
        )
    names = args.schedule or ([] if args.from_file else list(COMPARED))
    for name in names:
        if name not in schedule_names() and name != "auto":
            raise ValueError(f"--schedule must be one of {{{', '.join(schedule_names())}}} or auto, got {name!r}")
    stage_costs = _stage_costs(args.costs, k, costs)
    limit = _float("--memory-limit", args.memory_limit, strict=True) if args.memory_limit else None
    if args.sweep is not None:
        if "auto" in names:
            raise ValueError("--sweep compares named schedules: drop --schedule auto")
        return _sweep(args, names or list(COMPARED), k, v, costs)
    if args.pareto or "auto" in names:  # the synthesis: bounded by its cost, refused before minutes of silence
        from modelpar.simulate.synthesis import check_synthesis_size

        check_synthesis_size(k, m)
    if args.pareto:
        return _pareto(args, k, m, stage_costs)

    schedules = [from_file] if from_file is not None else []
    synthesised = {}
    for name in names:
        if name == "auto":
            from modelpar.simulate.synthesis import synthesize

            best, tl = synthesize(k, m, stage_costs, limit)
            schedules.append(best)
            synthesised[id(best)] = tl
            continue
        entry = schedule_entry(name)
        m_here = entry.default_microbatches if entry.default_microbatches and args.microbatches is None else m
        v_here = check_chunks(name, v if entry.chunks is None else None)
        entry.microbatches.check(name, m_here, k, v_here, "--microbatches", "--ranks")
        schedules.append(get_schedule(name, ranks=k, microbatches=m_here, chunks=v_here, costs=stage_costs.per_kind()))
    if args.export_csv and len(schedules) != 1:
        raise ValueError(f"--export-csv writes one schedule: give one --schedule or --from, got {len(schedules)}")
    timelines = [synthesised.get(id(s)) or (stage_costs.timeline(s) if args.costs else simulate(s, costs))
                 for s in schedules]
    if args.json:
        records = [_record(t, costs) for t in timelines]
        if args.comm:
            for record, s in zip(records, schedules):
                record["programs"] = {str(d): [str(op) for op in ops] for d, ops in enumerate(_lower(s))}
        print(json.dumps(records, indent=1))
    else:
        _print(args, timelines)
    _save(args, timelines)
    if args.export_csv:
        from modelpar.schedules.torch_csv import to_csv

        Path(args.export_csv).write_text(to_csv(schedules[0], comm=args.comm))
        if not args.json:
            print(f"wrote {args.export_csv} ({'compute_comms' if args.comm else 'compute_only'})")
    return 0


def _train_config(args: argparse.Namespace) -> int:
    """``--train-config``: the run's own schedule, timed by the cost model (ms), printed and saved as asked."""
    if not Path(args.train_config).is_file():
        raise ValueError(f"--train-config must be a readable file, got {args.train_config!r}")
    from modelpar.commands.train import build_config
    from modelpar.costmodel.local import predicted_timeline
    from modelpar.training.prediction import local_run, profile_of

    cfg = build_config(argparse.Namespace(config=args.train_config))
    cfg = cfg.check(cfg.dims.world_size)
    timeline = predicted_timeline(local_run(cfg, profile_of(cfg)), profile_of(cfg))
    if args.json:
        record = {"schedule": timeline.name, "ranks": timeline.num_ranks, "stages": timeline.num_ranks, "unit": timeline.unit,
                  "microbatches": timeline.num_microbatches, "chunks": timeline.chunks, **timeline.metrics()}
        record["all_to_all_ms"] = [sum(e - s for _, s, e in row) for row in timeline.inner]
        print(json.dumps([record], indent=1))
    else:
        _print(args, [timeline])
    _save(args, [timeline])
    return 0


def _stage_costs(text, k, costs):
    """``--costs`` as StageCosts: one F:I:W triple for every stage, or one per stage; default from ``costs``."""
    from modelpar.schedules.action import Kind
    from modelpar.schedules.kinds import kind_times
    from modelpar.simulate.synthesis import StageCosts

    if not text:
        times = kind_times(costs.forward, costs.full_backward, costs.weight_grad)
        return StageCosts.uniform(k, times[Kind.F], times[Kind.I], times[Kind.W], costs.transfer)
    triples = []
    for part in text.split(","):
        fields = part.split(":")
        if len(fields) != 3:
            raise ValueError(f"--costs must be F:I:W triples separated by commas (e.g. 1:1:1), got {text!r}")
        triples.append(tuple(_float("--costs", x.strip()) for x in fields))
    if len(triples) == 1:
        triples *= k
    if len(triples) != k:
        raise ValueError(f"--costs must give one F:I:W triple or one per stage ({k}), got {len(triples)}")
    f, i, w = zip(*triples)
    return StageCosts(f, i, w, costs.transfer)


def _pareto(args, k, m, stage_costs) -> int:
    """Every candidate of ``synthesize``: the named ones listed, the synthesised ones on the frontier."""
    from modelpar.simulate.synthesis import candidates, pareto
    from modelpar.simulate.tables import pareto_table

    named: list = []
    synth: list = []
    for s in candidates(k, m, stage_costs):
        (synth if s.name == "auto" else named).append(stage_costs.timeline(s))
    front = pareto(named + synth)
    auto = [t for t in front if t.name == "auto"]
    if args.json:
        print(json.dumps([{"schedule": t.name, "chunks": t.chunks, "peak": max(t.peak_held),
                           "step_time": t.step_time, "bubble": t.bubble, "frontier": t in front}
                          for t in named + auto], indent=1))
    else:
        triples = zip(stage_costs.forward, stage_costs.input_grad, stage_costs.weight_grad)
        print(f"Step time vs peak held activations, K = {k}, M = {m} (costs F:I:W per stage "
              f"{', '.join(f'{a:g}:{b:g}:{c:g}' for a, b, c in triples)}, transfer {stage_costs.transfer:g}); "
              f"* = on the frontier")
        print(pareto_table(named + auto, front))
    for path in filter(None, (args.png, args.svg)):
        from modelpar.simulate.plot import plot_pareto

        plot_pareto(named, auto, front, path, title=f"K = {k}, M = {m}: step time vs peak held activations")
        if not args.json:
            print(f"wrote {path}")
    return 0


def _read_schedule(name: str):
    """The schedule in file ``name`` (today's text form, or torch's CSV for a ``.csv``); ValueError if it is
    not a readable file, or if an index is larger than a complete schedule of its size can use (indices size
    the simulator's tables: 99999999999999999999 must not reach them)."""
    import re

    from modelpar.schedules.schedule import Schedule

    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--from must be a readable file, got {name!r}")
    text = path.read_text()
    csv = path.suffix.lower() == ".csv"
    body = [line.split("#", 1)[0] for line in text.splitlines()]
    cells = [cell for line in body for cell in (line.split(",") if csv else line.split(":", 1)[-1].replace(",", " ").split())]
    actions = sum(1 for cell in cells if cell.strip())
    biggest = max((int(n) for n in re.findall(r"\d+", "\n".join(body))), default=0)
    if biggest > actions + len(body):
        raise ValueError(f"--from {str(path)!r}: index {biggest} is larger than a schedule of {actions} actions can "
                         "use (stages and microbatches are numbered 0, 1, ..., each one present)")
    if csv:
        from modelpar.schedules.torch_csv import from_csv

        return from_csv(text, name=path.stem).validate()
    return Schedule.from_text(text, name=path.stem)


def _lower(schedule):
    from modelpar.schedules.lower import lower

    return lower(schedule)


def _record(tl, costs) -> dict:
    return {
        "schedule": tl.name, "ranks": tl.num_ranks, "stages": tl.num_ranks,  # "stages": K under its old name
        "microbatches": tl.num_microbatches,
        "chunks": tl.chunks, "transfer": costs.transfer, "backward_ratio": costs.backward_ratio,
        **tl.metrics(),
    }


def _print(args, timelines) -> None:
    from modelpar.schedules.table import schedule_table
    from modelpar.simulate.ascii import ascii_chart, auto_unit
    from modelpar.simulate.tables import headline, metrics_table

    for tl in timelines:
        print(headline(tl))
        unit = _float("--unit", args.unit) if args.unit else auto_unit(tl)
        if unit <= 0:
            raise ValueError(f"--unit must be > 0, got {args.unit}")
        cells = tl.step_time / unit
        if cells <= MAX_CHART_CELLS:
            print(ascii_chart(tl, unit))
        else:
            print(f"(chart omitted: {cells:.0f} cells wide; use --png/--svg, or a larger --unit)")
        if args.table:
            print(schedule_table(tl.schedule))
        if args.comm:
            print("Lowered programs (sends and receives matched by order, in posting order):")
            for d, ops in enumerate(_lower(tl.schedule)):
                print(f"rank {d}: {' '.join(map(str, ops))}")
        print()
    print(metrics_table(timelines))
    print("bubble = idle / total; peak held = microbatch x whole-stage activations (F until B or W); "
          "time unit = " + ("one microbatch's forward through one whole stage" if not timelines
                            or timelines[0].unit == "forward" else timelines[0].unit_name))


def _save(args, timelines) -> None:
    if args.png or args.svg:
        from modelpar.simulate.plot import plot_timelines

        for path in filter(None, (args.png, args.svg)):
            plot_timelines(timelines, path)
            if not args.json:
                print(f"wrote {path}")
    if args.trace:
        from modelpar.simulate.trace import write_trace

        write_trace(timelines, args.trace)
        if not args.json:
            print(f"wrote {args.trace}")


def _sweep(args, names, k, v, costs) -> int:
    from modelpar.simulate import Costs
    from modelpar.simulate.tables import sweep, sweep_table

    ms = [_int("--sweep", x.strip(), 1) for x in args.sweep.split(",") if x.strip()]
    if not ms:
        raise ValueError(f"--sweep must be a comma-separated list of M values, got {args.sweep!r}")
    transfer = costs.transfer or 0.2
    settings = [Costs(transfer=0.0, backward_ratio=costs.backward_ratio),
                Costs(transfer=transfer, backward_ratio=costs.backward_ratio)]
    if args.json:
        rows = []
        for c in settings:
            for (name, chunks, m), bubble in sweep(names, k, ms, c, chunks=v).items():
                rows.append({"schedule": name, "ranks": k, "stages": k, "microbatches": m, "chunks": chunks,
                             "transfer": c.transfer, "bubble": bubble})
        print(json.dumps(rows, indent=1))
    else:
        print(sweep_table(names, k, ms, costs=settings, chunks=v))
    return 0
