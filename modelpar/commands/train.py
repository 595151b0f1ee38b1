"""``modelpar train``: train a small GPT or Llama with tensor × pipeline × data parallelism (§6).

With no flags: t = 2, p = 2, d = 1 on 4 local processes (gloo), a few minutes on a 2-core CPU.
Under ``torchrun`` the same command runs in the launcher's processes (NCCL on GPUs). The flags
and the ``--config`` file are generated from the config dataclasses' fields
(``modelpar.commands.train_options``), imported only when this command runs, so other commands
start without torch; settings left out keep the dataclasses' defaults.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the types only: importing them loads torch, which other commands start without
    from modelpar.commands.train_options import RunOptions
    from modelpar.training import TrainConfig
    from modelpar.training.loop import TrainResult
    from modelpar.training.stopping import LateSignals


class _TrainParser(argparse.ArgumentParser):
    """The train parser: its flags are generated from the config dataclasses (which import torch)
    the first time it parses or prints help, so that other commands start without torch."""

    _built = False

    def _build(self) -> None:
        if not self._built:
            self._built = True
            from modelpar.commands.train_options import add_flags

            add_flags(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._build()
        return super().parse_known_args(_negative_values(sys.argv[1:] if args is None else list(args)), namespace)

    def format_help(self) -> str:
        self._build()
        return super().format_help()


def _negative_values(args: list[str]) -> list[str]:
    """``--flag -1,5`` as ``--flag=-1,5``: argparse takes a value that starts with ``-`` and is not a plain
    number for a flag and stops with a usage dump; joined, the value reaches its own check (train has no
    positional arguments, so a token after a flag is always its value)."""
    out: list[str] = []
    for arg in args:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a GPT or Llama with 3D parallelism (local processes or torchrun)",
                              description="Train a small GPT- or Llama-style model with tensor x pipeline x data "
                                          "parallelism (reference §6). Every setting is a flag and a key of a "
                                          "--config file's table of its section (docs/training.md).")
    p.__class__ = _TrainParser  # flags added on first use (see _TrainParser)
    p.add_argument("--config", metavar="FILE", help="settings from a TOML or JSON file, one table per section "
                                                    "([model], [parallelism], ...); flags override it")
    p.add_argument("--dtype", help=argparse.SUPPRESS)  # retired: a one-line error pointing to --precision
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the ``--config`` file and the flags describe (flags win; the rest keep the defaults)."""
    return build(args)[0]


def build(args: argparse.Namespace) -> tuple[TrainConfig, RunOptions]:
    """(TrainConfig, RunOptions) from the dataclass defaults, the ``--config`` file and the flags, in that order."""
    from dataclasses import replace

    from modelpar._options import field_infos
    from modelpar.commands.train_options import RunOptions, given_settings, read_config_file
    from modelpar.schedules.registry import schedule_entry, schedule_names
    from modelpar.text import DataConfig
    from modelpar.training import TrainConfig

    if getattr(args, "dtype", None) is not None:
        raise ValueError(f"--dtype {args.dtype} is retired: use --precision fp32 (was float32), fp64 (was float64) "
                         "or bf16")
    path = getattr(args, "config", None)
    from_file = read_config_file(path) if path else {}
    settings = {section: dict(table) for section, table in from_file.items()}
    for section, table in given_settings(args).items():
        settings.setdefault(section, {}).update(table)
    model = settings.pop("model", {})
    data = settings.pop("data", {})
    flat = {k: v for table in settings.values() for k, v in table.items()}
    own = {info.name for info in field_infos(RunOptions)}
    run_options = RunOptions(**{k: flat.pop(k) for k in own & flat.keys()}).check()
    if flat.get("schedule") in schedule_names() and "chunks" not in flat:  # its own v: 2 for a V or a loop
        v = schedule_entry(flat["schedule"]).default_chunks
        if v != 1:
            flat["chunks"] = v
    given = set(flat) | set(model) | ({"data"} if data else set())
    flat.setdefault("microbatches", 0)  # 0: chosen for this run's p, schedule and batch (default_microbatches)
    base = TrainConfig().model
    if flat.get("init_from"):  # the shape is the directory's; flags may only repeat it (or shorten seq_len)
        from modelpar.hf import read_hf_config

        base = read_hf_config(flat["init_from"], seq_len=model.pop("seq_len", None))
    cfg = replace(TrainConfig(), model=replace(base, **model), data=DataConfig(**data), **flat)
    if cfg.resume and cfg.checkpoint_dir:
        cfg = _continued(cfg, given)
        if "microbatches" not in given:  # the checkpoint's batch size may differ
            cfg = replace(cfg, microbatches=0)
    if path:
        _blame(cfg, path, from_file, settings | {"model": model, "data": data})
    return cfg, run_options


def _blame(cfg: TrainConfig, path: str, from_file: dict[str, dict[str, Any]], final: dict[str, dict[str, Any]]) -> None:
    """If ``cfg.check()`` names a setting that came from the file (and no flag replaced), name the file too."""
    try:
        cfg.check()
    except ValueError as err:
        first = str(err).split(" ", 1)[0]
        for section, table in from_file.items():
            if first in table and final.get(section, {}).get(first) == table[first]:
                raise ValueError(f"{path}: [{section}] {err}") from None
        raise


def _continued(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """With --resume: the model, data and optimisation settings not on the command line come from the checkpoint."""
    from modelpar.checkpoint import latest_checkpoint, read_meta
    from modelpar.training.state import resumed_config

    assert cfg.checkpoint_dir is not None  # the caller's condition
    path = latest_checkpoint(cfg.checkpoint_dir, checksums=False)  # the ranks verify the checksums
    return cfg if path is None else resumed_config(cfg, read_meta(path), given)


def run(args: argparse.Namespace) -> int:
    """Train; exit code 0, or the stop's (docs/stopping.md): 130 Ctrl-C, 75 preempted, 65 non-finite."""
    import os

    from modelpar.commands.preflight import check_memory, check_paths, out_lock
    from modelpar.distributed import is_torchrun
    from modelpar.training.resume import check_directory, check_flags

    cfg, options = build(args)
    check_flags(cfg)  # --exit-after or --overwrite without --checkpoint-dir
    cfg = _planned(cfg, args).check(int(os.environ["WORLD_SIZE"]) if is_torchrun() else None)  # t·cp·p·d = world: before init
    if not is_torchrun():
        check_directory(cfg)  # a file, locked by a live run, or an earlier run's: exit before writing anything
    check_paths(cfg, options.out)  # one line for a path that cannot be written, before anything starts
    check_memory(cfg, *_ranks_here(cfg))  # one line for a model this machine cannot hold, before building it
    if cfg.resume:  # the metrics to continue: a bad line is one line now, before any lock or rank
        from modelpar.training.metrics import read_metrics

        torn = read_metrics(options.out)[1]
        if torn and os.environ.get("RANK", "0") == "0":
            print(f"modelpar train: warning: {torn}", file=sys.stderr, flush=True)
    if is_torchrun():
        with out_lock(options.out, first=os.environ.get("RANK") == "0"):
            return _run(cfg, options, None)
    from modelpar.training.stopping import LateSignals

    # once the ranks are gone a signal cuts nothing short (docs/stopping.md): recorded from the moment the launcher's
    # relay lets go of the signals (run_local starts it) through the summary and the lock's release; the command
    # line's own process keeps recording them until it exits (``owns_process``: a Ctrl-C while it exits, its
    # outcome said and its helpers stopping, printed a second line or a traceback), a caller's gets its handlers back
    late = LateSignals(cfg)
    try:
        with out_lock(options.out, first=True):
            code = _run(cfg, options, late)
        return late.exit_code(code, lambda line: print(f"modelpar train: {line}", file=sys.stderr, flush=True))
    finally:
        if not getattr(args, "owns_process", False):
            late.close()


def _planned(cfg: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    """The run's hardware profile checked and, with ``--plan auto``, the planner's layout (keeping the layout
    settings ``args`` gave), with ``--schedule auto`` the synthesised schedule, before any process starts."""
    import os

    from modelpar.distributed import is_torchrun

    if cfg.hardware:  # a missing, malformed or other-torch profile: one line now, not after the run
        from modelpar.training.prediction import profile_of

        profile_of(cfg)
    if cfg.check_planning().plan == "auto":  # a layout that does not fit is refused here
        from modelpar.commands.train_options import explicit_settings
        from modelpar.training.autoplan import auto_plan, plan_world

        world = plan_world(cfg, int(os.environ["WORLD_SIZE"]) if is_torchrun() else None)
        cfg, _, line = auto_plan(cfg, world, explicit_settings(args))  # the same plan on every rank; rank 0 prints it
        if os.environ.get("RANK", "0") == "0":
            print(f"modelpar train: {line}", file=sys.stderr, flush=True)
    if not cfg.hardware and cfg.calibrate:  # every run predicted with its own device (calibrate.cache)
        import dataclasses

        from modelpar.calibrate.cache import machine_profile

        def log(line: str) -> None:
            if os.environ.get("RANK", "0") == "0":
                print(f"modelpar train: {line}", file=sys.stderr, flush=True)

        found = machine_profile(cfg.check(int(os.environ["WORLD_SIZE"]) if is_torchrun() else None), log)
        cfg = dataclasses.replace(cfg, hardware=found.hardware)
        if found.hardware is not None and found.how != "given":
            log(f"prediction from {found.hardware} ({found.how})")
    if cfg.schedule == "auto":  # the schedule built here, and a memory limit none meets refused, before any process
        from modelpar.training.prediction import resolve_schedule

        cfg, built = resolve_schedule(cfg.check())
        if os.environ.get("RANK", "0") == "0":
            print(f"modelpar train: {built}", file=sys.stderr, flush=True)
    return cfg


def _ranks_here(cfg: TrainConfig) -> tuple[int, int | None]:
    """(ranks on this machine, one GPU's bytes if they run on GPUs): local runs start all t·p·d ranks here
    on the CPU; under torchrun, ``LOCAL_WORLD_SIZE`` ranks, each on its GPU when there is one."""
    import os

    from modelpar.distributed import is_torchrun

    if not is_torchrun():
        return cfg.dims.world_size, None
    import torch

    if torch.cuda.is_available():
        return 1, torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")), None


def _run(cfg: TrainConfig, options: RunOptions, late: LateSignals | None) -> int:
    """The run, under torchrun (``late`` None) or on local processes, and its report; its exit code."""
    import os

    from rich.console import Console

    from modelpar.distributed import is_torchrun
    from modelpar.training.display import Display
    from modelpar.training.metrics import MetricsLog, Reporters
    from modelpar.training.start import run_in_process, run_local

    console = Console(stderr=True)
    display = Display(console, title=f"{cfg.layout()} {cfg.schedule}", progress=options.progress)
    metrics = MetricsLog(options.out, tensorboard=options.tensorboard,
                         note=lambda text: display({"event": "note", "text": text}))
    report = Reporters(display, metrics)
    if is_torchrun():
        result = run_in_process(cfg, report, backend=None if options.backend == "auto" else options.backend)
        first = os.environ["RANK"] == "0"  # global rank 0 speaks for the run
    else:
        result, first = run_local(cfg, report, console, progress=options.progress, late=late), True
    return _report(cfg, options, result, report, first)


def _report(cfg: TrainConfig, options: RunOptions, result: TrainResult, report: Any, first: bool) -> int:
    """The stop's line and exit code, or the summary and 0 (priced with the config the ranks trained: a BPE
    vocabulary is known only once the data is prepared)."""
    cfg = result.config or cfg
    if result.stop is not None:
        report.close()
        if first:
            print(f"modelpar train: {result.stop.message}", file=sys.stderr, flush=True)
        return result.stop.exit_code
    if first:
        _summary(cfg, result, Path(options.out), options.peak_tflops)
    return 0


def _saves(cfg: TrainConfig, result: TrainResult) -> str:
    """The checkpoint saves in words: how many, how long each held training, how long each took to write."""
    from statistics import median

    how = "written in the background (--async-checkpoint)" if cfg.async_checkpoint else "blocking"
    written = f"; written in {1e3 * median(result.save_writes):,.1f} ms" if result.save_writes else ""
    return (f"{len(result.save_stalls)}, {how}: training held {1e3 * median(result.save_stalls):,.1f} ms per save "
            f"(median){written}")


def _summary(cfg: TrainConfig, result: TrainResult, out: Path, peak_tflops: float | None) -> None:
    from rich.console import Console

    from modelpar._outputs import write_file
    from modelpar.training.display import peak_tflops_of, plot_losses, summary_table
    from modelpar.training.loop import SUMMARY_FIELDS

    peak = peak_tflops or peak_tflops_of(result.device_name)
    mfu = result.flops_per_token * result.tokens_per_s / (cfg.dims.world_size * peak * 1e12) if peak else None

    final_val = result.val[-1][1] if result.val else float("nan")
    bpb = result.bits_per_byte
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rows = [
        ("split", f"{cfg.layout()}, {_schedule_name(cfg)}, m={cfg.microbatches}"),
        ("micro-batches", _why_microbatches(cfg)),
        ("layers per stage", ", ".join(map(str, cfg.layer_split))
         + (" (--stage-layers)" if cfg.stage_layers is not None else " (default split)")),
        ("parameters", f"{result.num_parameters:,}"),
        ("steps", f"{len(result.losses)} (this run from step {result.start_step})"
                  + (f", {result.skipped_steps} updates skipped (non-finite)" if result.skipped_steps else "")),
        ("final training loss", f"{result.losses[-1]:.4f}" if result.losses else "-"),
        ("data", _describe_data(cfg)),
        ("final validation loss", f"{final_val:.4f} nats/token, {bpb(final_val):.4f} bits/byte"),
        ("unigram baseline", f"{result.unigram_baseline:.4f} nats/token, {bpb(result.unigram_baseline):.4f} bits/byte"),
        ("throughput", f"{result.tokens_per_s:,.0f} tokens/s (median step)"),
        ("model FLOPs per token", f"{result.flops_per_token:,.0f} (forward + backward)"),
        ("MFU", f"{100 * mfu:.2f}% of {peak:g} TFLOP/s x {cfg.dims.world_size}" if mfu is not None
         else "- (pass --peak-tflops)"),
        ("precision", _PRECISION[cfg.precision]),
        ("compiled", "no (--compile: each block compiled)" if result.compile_seconds is None else
         f"each {cfg.compile_scope}, {cfg.compile_backend}: {result.compile_seconds:.1f} s compiling on rank 0"),
        *([("checkpoint saves", _saves(cfg, result))] if result.save_stalls else []),
        ("data parallel", f"ZeRO-{cfg.zero}, {result.buckets} bucket{'s' if result.buckets != 1 else ''}, "
                          + ("overlapped" if cfg.overlap_grad_reduce and cfg.dp > 1 else "after the step")),
        ("rank 0: params, grads, AdamW", f"{_mib(result.parameter_bytes)}, {_mib(result.gradient_bytes)}, "
                                         f"{_mib(result.optimizer_state_bytes)}" + (
            f" + up to {_mib(result.peak_buffer_bytes)} of full buckets" if result.peak_buffer_bytes else "")),
        ("rank 0: dp sent, exposed", f"{_mib(result.dp_bytes_sent)}/step, " + (
            "-" if result.exposed_reduction is None else f"{1e3 * result.exposed_reduction:.1f} ms")),
        ("rank 0: all-gather, reduce-scatter", f"{_mib(result.all_gather_bytes)}, {_mib(result.reduce_scatter_bytes)}"
                                               "/step" + (f"; {result.gathers_per_step} gathers/step, "
                                               f"{1e3 * (result.exposed_gather or 0.0):.1f} ms waited"
                                               if cfg.zero == 3 else "")),
        *([("experts: max/mean tokens per expert", f"{result.expert_imbalance:.2f} (worst layer and step; "
              f"E={cfg.model.experts}, k={cfg.model.top_k}, ep={cfg.ep})")] if result.expert_imbalance is not None
          else []),
        ("pipeline message", ", ".join(f"{b / 1024:,.1f} KiB" for b in (result.message_bytes or []) if b) or "-"),
        ("pipeline bubble, measured", pct(result.bubble_measured)),
        ("  simulated with measured costs", pct(result.bubble_simulated)),
        ("  simulated, equal stages F=1 B=2", pct(result.bubble_ideal)),
        *([("  simulated, this layer split (F ∝ layers)", pct(_split_bubble(cfg)))] if len(set(cfg.layer_split)) > 1
          else []),
    ]
    png = plot_losses(out / "loss.png", result.losses, result.val, result.unigram_baseline,
                      f"{cfg.model.arch} {result.num_parameters:,} params, t={cfg.tp} p={cfg.pp} d={cfg.dp} {cfg.schedule}")
    summary = {"config": cfg.to_sections(), **result.fields(SUMMARY_FIELDS), "val_bits_per_byte": bpb(final_val),
               "unigram_bits_per_byte": bpb(result.unigram_baseline), "device": result.device_name,
               "peak_tflops": peak, "mfu": mfu}
    from modelpar.training.prediction import summary_rows

    predicted_rows, summary["prediction"] = summary_rows(cfg, result, out)
    rows += predicted_rows
    write_file(out / "summary.json", json.dumps(summary, indent=1), "the run summary")
    rows.append(("loss curve", str(png)))
    rows.append(("metrics", str(out / "metrics.jsonl")))
    Console().print(summary_table(rows))  # the summary on stdout, the progress on stderr


def _split_bubble(cfg: TrainConfig) -> float:
    """The simulator's bubble for this run's schedule with each stage's times proportional to its layers."""
    from modelpar.simulate import Costs, simulate
    from modelpar.training.prediction import run_schedule

    split = cfg.layer_split
    mean = sum(split) / len(split)
    schedule = run_schedule(cfg)
    return simulate(schedule, Costs(stage_multipliers=tuple(n / mean for n in split))).bubble


def _schedule_name(cfg: TrainConfig) -> str:
    """The schedule's name; with schedule auto, also the one it built."""
    if cfg.schedule != "auto":
        return str(cfg.schedule)
    from modelpar.training.prediction import run_schedule

    return f"auto ({run_schedule(cfg).name}, v={cfg.chunks}, memory limit {cfg.memory_limit or 'none'})"


def _why_microbatches(cfg: TrainConfig) -> str:
    from modelpar.training.config import default_microbatches

    chosen, why = default_microbatches(cfg)
    return f"m={cfg.microbatches}: " + (f"the default, {why}" if cfg.microbatches == chosen else "set (--microbatches)")


_PRECISION = {"fp32": "fp32", "bf16": "bf16 (fp32 master weights)", "fp8": "fp8 linear layers (torchao), bf16 elsewhere, "
              "fp32 master weights", "fp64": "fp64"}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


def _describe_data(cfg: TrainConfig) -> str:
    data = cfg.data
    more = f" and {len(data.paths) - 1} more" if len(data.paths) > 1 else ""
    source = data.paths[0] + more if data.paths else "shipped corpus"
    tokenizer = data.tokenizer + (f" {data.vocab_size}" if data.vocab_size else "")
    return f"{source}; {tokenizer} (vocabulary {cfg.model.vocab_size:,})"
