"""``modelpar export``: a checkpoint's whole model as one single-process file, for use without torch.distributed.

Each ``--format`` is one exporter in ``EXPORTERS``: a function (checkpoint, out) -> files written,
which checks its own ``--out`` before any work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Note = Callable[[str], None]


def _modelpar(checkpoint: str, out: str, note: Note) -> list[Path]:
    """safetensors + model.json (+ tokenizer.json), loadable with ``modelpar.export.load_model``."""
    from modelpar._validate import check_output_path
    from modelpar.export import export_checkpoint

    return export_checkpoint(checkpoint, check_output_path("--out", out, [".safetensors"]), note)


def _hf(checkpoint: str, out: str, note: Note) -> list[Path]:
    """A Hugging Face ``LlamaForCausalLM`` directory (config.json, model.safetensors, tokenizer.json) of an --arch llama run."""
    from modelpar import hf
    from modelpar.checkpoint import read_full_tensors, read_meta, read_newest
    from modelpar.export import TOKENIZER
    from modelpar.hf import save_hf
    from modelpar.model import ModelConfig

    folder = Path(out)
    if (folder.exists() and not folder.is_dir()) or not folder.parent.is_dir():
        raise ValueError(f"--out must name a directory (new, or existing) in an existing folder, got {out!r}")

    def read(path: Path) -> tuple[Path, Any, dict[str, Any]]:
        cfg = ModelConfig.from_dict(read_meta(path)["config"]["model"]).check()
        if cfg.arch != "llama":
            raise ValueError(f"--format hf needs a run of --arch llama; {str(path)!r} holds arch {cfg.arch!r}")
        return path, cfg, read_full_tensors(path, "model.")

    path, cfg, tensors = read_newest(checkpoint, read, note)
    tokenizer = path.parent / TOKENIZER
    stale = folder / TOKENIZER
    if not tokenizer.is_file() and stale.is_file():  # an earlier export's: this model has byte tokens
        if not (folder / hf.CONFIG).is_file():
            raise ValueError(f"--out: {str(stale)!r} is not from an earlier export to {str(folder)!r} and would be read "
                             "as this byte-level model's tokenizer: export to a new folder, or move it away")
        stale.unlink()
    save_hf(tensors, cfg, folder, tokenizer if tokenizer.is_file() else None)
    return sorted(folder.iterdir())


EXPORTERS: dict[str, Callable[[str, str, Note], list[Path]]] = {"modelpar": _modelpar, "hf": _hf}
DEFAULT_OUT = {"modelpar": "model.safetensors", "hf": "hf-model"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write a checkpoint's whole model for one process (safetensors)",
                              description="Write the whole model of a checkpoint, written at any (t, p, d, v) "
                                          "split, as the single-process model's state dict.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                   help="a --checkpoint-dir (its newest complete checkpoint) or one step_N directory in it")
    p.add_argument("--out", default=None,
                   help="modelpar: the model file, model.json (and tokenizer.json) beside it (default model.safetensors); "
                        "hf: the directory (default hf-model)")
    p.add_argument("--format", choices=sorted(EXPORTERS), default="modelpar",
                   help="modelpar: safetensors for modelpar.export.load_model (default); hf: a Hugging Face "
                        "LlamaForCausalLM directory (--arch llama runs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    def note(text: str) -> None:
        print(f"modelpar export: {text}", file=sys.stderr, flush=True)

    for path in EXPORTERS[args.format](args.checkpoint, args.out or DEFAULT_OUT[args.format], note):
        print(f"wrote {path}")
    return 0
