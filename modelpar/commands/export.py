"""``modelpar export``: a checkpoint's whole model as one single-process file, for use without torch.distributed.

Each ``--format`` is one exporter in ``EXPORTERS``: a function (checkpoint, out) -> files written,
which checks its own ``--out`` before any work.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def _modelpar(checkpoint: str, out: str) -> list[Path]:
    """safetensors + model.json (+ tokenizer.json), loadable with ``modelpar.export.load_model``."""
    from modelpar._validate import check_output_path
    from modelpar.export import export_checkpoint

    return export_checkpoint(checkpoint, check_output_path("--out", out, [".safetensors"]))


EXPORTERS: dict[str, Callable[[str, str], list[Path]]] = {"modelpar": _modelpar}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint's whole model for one process (safetensors)",
                              description="Write the whole model of a checkpoint, written at any (t, p, d, v) "
                                          "split, as the single-process model's state dict.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                   help="a --checkpoint-dir (its newest complete checkpoint) or one step_N directory in it")
    p.add_argument("--out", default="model.safetensors",
                   help="the model file; model.json (and tokenizer.json) go beside it (default %(default)s)")
    p.add_argument("--format", choices=sorted(EXPORTERS), default="modelpar",
                   help="modelpar: safetensors for modelpar.export.load_model (default)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for path in EXPORTERS[args.format](args.checkpoint, args.out):
        print(f"wrote {path}")
    return 0
