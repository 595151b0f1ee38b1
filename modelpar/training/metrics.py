"""Metrics a person can follow: ``OUT/metrics.jsonl`` and, on request, TensorBoard event files.

The training loop emits event dicts (``start``, ``step``, ``eval``, ``done``; see
``modelpar.training.loop``). ``MetricsLog`` writes every ``step`` and ``eval`` event as one JSON
line, all its fields as they are, so a new field is one more key in the loop's event. With
``tensorboard=True`` each numeric field is also a scalar ``<event>/<field>`` at its step.

A resumed run (``start`` at step k > 0) keeps the lines up to step k and drops the later ones,
which the checkpoint it resumes from does not know: the file then holds each step once.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["METRICS_FILE", "MetricsLog", "Reporters", "append_record", "peak_memory_mb"]

METRICS_FILE = "metrics.jsonl"


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA's allocator peak on a GPU, the peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def append_record(out: str | os.PathLike, record: dict[str, Any]) -> None:
    """One more JSON line in ``out/metrics.jsonl`` after the run (the prediction beside what was measured)."""
    path = Path(out) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class MetricsLog:
    """Writes step and eval events to ``out/metrics.jsonl`` (and ``out/tensorboard/``); nothing before ``start``."""

    def __init__(self, out: str | os.PathLike, tensorboard: bool = False) -> None:
        self.path = Path(out) / METRICS_FILE
        self.tensorboard_dir = Path(out) / "tensorboard" if tensorboard else None
        self._writer: Any = None
        if tensorboard:
            _summary_writer_class()  # a missing package is an error now, before the run starts

    def __call__(self, event: dict[str, Any]) -> None:
        match event.get("event"):
            case "start":
                self._start(int(event.get("start_step", 0)))
            case "step" | "eval" as kind:
                self._write(kind, event)
            case "done":
                self.close()

    def _write(self, kind: str, event: dict[str, Any]) -> None:
        """One JSON line, and the event's numbers as TensorBoard scalars under ``kind/``."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
        if self._writer is not None:
            for name, value in event.items():
                if name not in ("event", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(f"{kind}/{name}", value, event["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _start(self, start_step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if start_step > 0 and self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= start_step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        if self.tensorboard_dir is not None:
            self._writer = _summary_writer_class()(log_dir=str(self.tensorboard_dir), purge_step=start_step + 1)


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'") from None
    return SummaryWriter


class Reporters:
    """Several reporters as one: each event goes to each (None entries are skipped); ``close`` closes them."""

    def __init__(self, *reporters: Any) -> None:
        self.reporters = [r for r in reporters if r is not None]

    def __call__(self, event: dict[str, Any]) -> None:
        for r in self.reporters:
            r(event)

    def close(self) -> None:
        for r in self.reporters:
            if hasattr(r, "close"):
                r.close()
