"""``modelpar train``'s flags and ``--config`` file, generated from the config dataclasses' fields.

Every field of ``TrainConfig`` (and of its ``ModelConfig`` and ``DataConfig`` sections) and of
``RunOptions`` below is one flag, in the argument group of its section, with its help and its
real default; and one key of a ``--config`` file's table of that section. Precedence: the
dataclass default < the file < the command line. Imported only when ``train`` runs (torch).
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpar._options import SECTIONS, FieldInfo, coerce, field_infos, option
from modelpar._validate import check_choice
from modelpar.model import ModelConfig
from modelpar.text import DataConfig
from modelpar.training import TrainConfig

__all__ = [
    "SECTION_HELP", "RunOptions", "add_flags", "explicit_settings", "given_settings", "read_config_file", "section_fields",
    "settings_markdown",
]

SECTION_HELP = {
    "model": "the model's shape (ModelConfig; docs/models.md)",
    "data": "what the run trains on (DataConfig; docs/data.md)",
    "parallelism": "the (t, p, d) split, sequence parallelism and the data-parallel reduction (docs/numerics.md)",
    "schedule": "the pipeline schedule, its micro-batches, the layer split and recomputation",
    "optimisation": "AdamW, the batch, the learning-rate schedule, precision and the seed",
    "checkpoint": "checkpoints, resuming and starting from other weights (docs/checkpoints.md)",
    "planning": "the planner's choice of layout and the hardware the run's prediction is priced on (docs/calibrate.md)",
    "run": "evaluation, timeouts, stopping (docs/stopping.md) and this command's output",
}
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class RunOptions:
    """What this command does around the run (not part of the run's config, not in checkpoints)."""

    out: str = option("modelpar-train", section="run", help="folder for metrics.jsonl, loss.png and summary.json")
    tensorboard: bool = option(False, section="run", help="also write the metrics as TensorBoard event files in "
                                                          "OUT/tensorboard (the tensorboard extra)")
    backend: str = option("auto", section="run", help="under torchrun: process-group backend, auto (nccl with "
                                                      "GPUs, else gloo), gloo or nccl")
    progress: bool = option(True, section="run", help="a progress bar (--no-progress: none, for logs and CI)")
    peak_tflops: float | None = option(None, section="run", help="peak TFLOP/s per device for the MFU (none: known "
                                                                 "GPUs by name; on CPUs no MFU)")

    def check(self) -> RunOptions:
        check_choice("backend", self.backend, BACKENDS)
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak-tflops must be > 0, got {self.peak_tflops}")
        return self


def section_fields(section: str) -> Iterator[FieldInfo]:
    """The settings of ``section``: a nested config's fields (model, data), or the flat fields so marked."""
    if section == "model":
        yield from field_infos(ModelConfig)
    elif section == "data":
        yield from field_infos(DataConfig)
    else:
        for cls in (TrainConfig, RunOptions):
            yield from (info for info in field_infos(cls) if not info.nested and info.section == section)


def _shown(value: Any) -> str:
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One argument group per section, one flag per field; every dest is ``section.name``, default None."""
    for section in SECTIONS:
        group = parser.add_argument_group(section, SECTION_HELP[section])
        for info in section_fields(section):
            if not info.cli:
                continue
            text = f"{info.help} (default: {_shown(info.default)})".replace("%", "%%")
            dest, metavar = f"{section}.{info.name}", info.metavar or info.name.upper()
            if info.kind is bool:
                group.add_argument(info.flag, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                   help=text)
            elif info.kind == tuple[str, ...]:
                group.add_argument(info.flag, dest=dest, action="append", metavar=metavar, help=text)
            else:
                scalar = next((k for k in (int, float) if info.kind in (k, k | None)), str)
                group.add_argument(info.flag, dest=dest, type=str if info.parse else scalar,
                                   metavar=metavar, help=text)


def given_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The settings given on the command line, by section (values parsed, lists as tuples)."""
    given: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        for info in section_fields(section):
            value = getattr(args, f"{section}.{info.name}", None)
            if value is not None:
                flag = info.flag
                given.setdefault(section, {})[info.name] = coerce(flag, info.kind, value, info.parse)
    return given


def explicit_settings(args: argparse.Namespace) -> set[str]:
    """The names of the settings the user gave, by a flag or in the ``--config`` file (not left to a default)."""
    names = {name for table in given_settings(args).values() for name in table}
    path = getattr(args, "config", None)
    return names | ({name for table in read_config_file(path).values() for name in table} if path else set())


def read_config_file(path: str) -> dict[str, dict[str, Any]]:
    """A ``--config`` file (TOML or JSON) as settings by section; a bad key or value is one ValueError
    naming the file, the section and the key."""
    file = Path(path)
    if file.suffix not in (".toml", ".json"):
        raise ValueError(f"--config must be a .toml or .json file, got {path!r}")
    try:
        raw = tomllib.loads(file.read_text()) if file.suffix == ".toml" else json.loads(file.read_text())
    except OSError as err:
        raise ValueError(f"--config {path!r}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--config {path!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                         f"{err.start}): TOML and JSON files are UTF-8") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid {file.suffix[1:].upper()}: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold tables of settings ({', '.join(SECTIONS)}), got {type(raw).__name__}")
    owner = {info.name: section for section in SECTIONS[2:] for info in section_fields(section)}
    settings: dict[str, dict[str, Any]] = {}
    for section, table in raw.items():
        if section not in SECTIONS:
            hint = f" ({section} belongs in [{owner[section]}])" if section in owner else ""
            raise ValueError(f"{path}: unknown section or top-level key {section!r}{hint}; sections: "
                             f"{', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [{section}] must be a table of settings, got {table!r}")
        infos = {info.name: info for info in section_fields(section)}
        for key, value in table.items():
            if key not in infos:
                hint = f" ({key} belongs in [{owner[key]}])" if key in owner else ""
                raise ValueError(f"{path}: [{section}] unknown key {key!r}{hint}; allowed: {', '.join(infos)}")
            info = infos[key]
            settings.setdefault(section, {})[key] = coerce(f"{path}: [{section}] {key}", info.kind, value, info.parse)
    return settings


def settings_markdown() -> str:
    """The settings reference of docs/training.md: one table per section, generated from the fields."""
    lines = []
    for section in SECTIONS:
        lines += [f"### [{section}]", "", SECTION_HELP[section][0].upper() + SECTION_HELP[section][1:] + ".", "",
                  "| key | flag | default | what |", "|---|---|---|---|"]
        for info in section_fields(section):
            flag = f"`{info.flag}`" if info.cli else "—"
            lines.append(f"| `{info.name}` | {flag} | `{_shown(info.default)}` | {info.help.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m modelpar.commands.train_options: print the docs' settings tables
    print(settings_markdown(), end="")
