"""``modelpar bench``: small measurements on this machine, one sub-command each."""

from __future__ import annotations

import argparse
import importlib

# Bench name -> module defining ``register(subparsers)`` like a top-level command.
BENCHES: dict[str, str] = {
    "microbatch": "modelpar.commands.bench_microbatch",
    "pipeline": "modelpar.commands.bench_pipeline",
    "recompute": "modelpar.commands.bench_recompute",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="measure pipeline pieces on this machine")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    for module in BENCHES.values():
        importlib.import_module(module).register(sub)
