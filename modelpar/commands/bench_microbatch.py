"""``modelpar bench microbatch``: the table of reference §2.4 measured on this machine.

Times one pipeline stage's forward for micro-batches of N/M rows, fits t(b) ≈ α + β·b and prints
the GPipe step time 3(M + K − 1)·t(N/M) against M, the fit's prediction and M* = √((K − 1)βN/α).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "microbatch",
        help="time a stage vs micro-batch size, fit alpha + beta*b, print step time vs M and M* (section 2.4)",
        description="Time one pipeline stage on micro-batches of N/M rows, fit t(b) = alpha + beta*b and print "
                    "the GPipe step time against M with M* = sqrt((K - 1) beta N / alpha) (reference section 2.4).",
    )
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages K (default 4)")
    parser.add_argument("--batch", type=int, default=1024, help="rows N in one batch (default 1024)")
    parser.add_argument("--hidden", type=int, default=128, help="feature size of the stage's input (default 128)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per size; the fastest counts (default 7)")
    parser.add_argument("--max-microbatches", type=int, default=256,
                        help="largest M of the sweep M = 1, 2, 4, ... (default 256, capped at N)")
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch intra-op threads while timing: one core per stage (default 1)")
    parser.add_argument("--stage", metavar="MODULE:ATTR", default=None,
                        help="your stage: an nn.Module, or a factory called with --hidden that returns one; "
                             "it must take a (rows, hidden) float tensor (default: one MLP block h->4h->h)")
    parser.set_defaults(func=run)


def load_stage(spec: str, hidden: int) -> Any:
    """Import ``module:attr``; call it with ``hidden`` unless it already is an ``nn.Module``."""
    from torch import nn

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--stage must look like 'package.module:attr', got {spec!r}")
    if os.getcwd() not in sys.path:  # let `modelpar` find modules beside the user, as `python -m` does
        sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--stage {spec!r} cannot be loaded: {err}") from err
    stage = obj
    if callable(obj) and not isinstance(obj, nn.Module):
        try:
            stage = obj(hidden)
        except Exception as err:  # a user's factory may raise anything: report it in one line
            raise ValueError(f"--stage {spec!r} failed when called with hidden={hidden}: {err}") from err
    if not isinstance(stage, nn.Module):
        raise ValueError(f"--stage {spec!r} must be an nn.Module or return one, got {type(stage).__name__}")
    return stage


def run(args: argparse.Namespace) -> int:
    import torch

    from modelpar._validate import check_int
    from modelpar.bench import microbatch_table, mlp_stage

    stages = check_int("--stages", args.stages, minimum=1)
    batch = check_int("--batch", args.batch, minimum=2)
    hidden = check_int("--hidden", args.hidden, minimum=1)
    repeats = check_int("--repeats", args.repeats, minimum=1)
    threads = check_int("--threads", args.threads, minimum=1)
    top = min(check_int("--max-microbatches", args.max_microbatches, minimum=2), batch)
    counts = [2**i for i in range(top.bit_length()) if 2**i <= top]

    torch.manual_seed(0)
    stage = load_stage(args.stage, hidden) if args.stage else mlp_stage(hidden)
    label = args.stage or f"MLP block {hidden} -> {4 * hidden} -> {hidden}"
    try:
        stage(torch.randn(1, hidden))
    except Exception as err:  # the user's stage: report its failure in one line
        raise ValueError(f"--stage {label!r} fails on a (1, {hidden}) input: {str(err).splitlines()[0]}") from err

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scan = microbatch_table(stage, lambda b: torch.randn(b, hidden), batch, stages, counts, repeats)
    finally:
        torch.set_num_threads(saved)
    print(f"stage: {label}, {threads} intra-op thread(s); fastest of {repeats} timed repeats per size")
    print(scan.format())
    best = scan.best_measured
    print(f"fastest measured: M = {best.microbatches} ({best.rows} rows per micro-batch); "
          f"formula M* = {scan.m_star:.1f}")
    return 0
