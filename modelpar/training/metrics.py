"""Metrics a person can follow: ``OUT/metrics.jsonl`` and, on request, TensorBoard event files.

The training loop emits event dicts (``start``, ``step``, ``eval``, ``done``; see
``modelpar.training.loop``). ``MetricsLog`` writes every ``step`` and ``eval`` event as one JSON
line, all its fields as they are, so a new field is one more key in the loop's event. With
``tensorboard=True`` each numeric field is also a scalar ``<event>/<field>`` at its step.

Every record carries ``run``, the id of the run that wrote it, and each start of a run writes a
``start`` record (its step, the run's steps, the time). A fresh run starts the file anew. A
resumed run (``start`` at step k > 0) keeps the lines up to step k when they are its own, that is
when their losses are the ones its checkpoint recorded, and drops the later ones, which the
checkpoint does not know: the file then holds each step of one run once. Lines of another run
(another run wrote to the same ``--out`` in between) are not continued: the file starts anew,
with a warning. ``read_metrics`` reads the file for that, before any rank starts: a torn last
line (a crash mid-write) is dropped with a warning, any other bad line is one ValueError naming
the file and the line.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from modelpar._outputs import append_text, write_file
from modelpar._validate import json_error

__all__ = ["METRICS_FILE", "MetricsLog", "Reporters", "append_record", "peak_memory_mb", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
_WHAT = "metrics"  # how a failed write names the file


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA's allocator peak on a GPU, the peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def append_record(out: str | os.PathLike, record: dict[str, Any]) -> None:
    """One more JSON line in ``out/metrics.jsonl`` after the run (the prediction beside what was measured),
    under the run id of the file's last record (the run that just ended)."""
    path = Path(out) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    records, _ = read_metrics(out)
    run = {"run": records[-1]["run"]} if records and "run" in records[-1] else {}
    append_text(path, json.dumps({**record, **run}) + "\n", _WHAT)


def read_metrics(out: str | os.PathLike) -> tuple[list[dict[str, Any]], str | None]:
    """The records of ``out/metrics.jsonl`` (none without the file) and a warning if its last line was torn.

    A record is a JSON object with a string ``event`` and a whole-number ``step``. The last line, if
    it has no line break and is not a record, is a write a crash cut short: dropped, with the warning.
    Any other line that is not a record is a ValueError naming the file and the line.
    """
    path = Path(out) / METRICS_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return [], None
    except OSError as err:
        raise ValueError(f"metrics {str(path)!r} cannot be read: {err.strerror or err}") from None
    lines = raw.split(b"\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(_record(line))
        except ValueError as err:
            if number == len(lines):  # no line break after it: the last write was cut short
                return records, (f"dropped the last line of {str(path)!r} (line {number}, {len(line):,} bytes), "
                                 f"cut short by a crash while it was written")
            raise ValueError(f"metrics {str(path)!r} line {number} {err}: each line must be one JSON object with "
                             f"an 'event' and a whole-number 'step'; fix or delete the line, or give another --out"
                             ) from None
    return records, None


def _record(line: bytes) -> dict[str, Any]:
    """One metrics line as a record; ValueError saying what it is instead."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"is not JSON ({json_error(err)})") from None
    if not isinstance(record, dict):
        raise ValueError(f"is a JSON {type(record).__name__}, not an object")
    step = record.get("step")
    if not isinstance(record.get("event"), str) or isinstance(step, bool) or not isinstance(step, int):
        raise ValueError("has no string 'event' or no whole-number 'step'")
    return record


class MetricsLog:
    """Writes step and eval events to ``out/metrics.jsonl`` (and ``out/tensorboard/``); nothing before ``start``.

    ``note(text)`` says what the log did that a user should know (default: a line on stderr).
    """

    def __init__(self, out: str | os.PathLike, tensorboard: bool = False,
                 note: Callable[[str], None] | None = None) -> None:
        self.path = Path(out) / METRICS_FILE
        self.tensorboard_dir = Path(out) / "tensorboard" if tensorboard else None
        self.run = ""  # this run's id: set at start
        self._writer: Any = None
        self._note = note or (lambda text: print(f"modelpar train: {text}", file=sys.stderr, flush=True))
        if tensorboard:
            _summary_writer_class()  # a missing package is an error now, before the run starts

    def __call__(self, event: dict[str, Any]) -> None:
        match event.get("event"):
            case "start":
                self._start(int(event.get("start_step", 0)), event.get("losses", []), int(event.get("steps", 0)))
            case "step" | "eval" as kind:
                self._write(kind, event)
            case "done":
                self.close()

    def _write(self, kind: str, event: dict[str, Any]) -> None:
        """One JSON line, and the event's numbers as TensorBoard scalars under ``kind/``."""
        append_text(self.path, json.dumps({**event, "run": self.run}) + "\n", _WHAT)
        if self._writer is not None:
            for name, value in event.items():
                if name not in ("event", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(f"{kind}/{name}", value, event["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _start(self, start_step: int, losses: Sequence[float], steps: int) -> None:
        """A fresh run: a new file. A resumed one: its own lines up to ``start_step`` (see the module docstring)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict[str, Any]] = []
        self.run = uuid.uuid4().hex[:12]
        if start_step > 0:
            records, _ = read_metrics(self.path.parent)  # a torn last line was reported before the run started
            kept = [r for r in records if r["step"] <= start_step]
            if _is_run(kept, losses[:start_step]):
                self.run = kept[-1]["run"]
                lost = [r["step"] for r in records if r["event"] == "step" and r["step"] > start_step]
                if lost:  # trained after the checkpoint, then stopped without one: done again from start_step
                    self._note(f"steps lost: {len(lost)} (steps {start_step + 1}-{max(lost)} of the stopped run, after "
                               f"its last valid checkpoint at step {start_step}, are trained again)")
            else:
                if records:
                    runs = sorted({str(r.get("run", "no run id")) for r in records})
                    self._note(f"warning: {str(self.path)!r} held the metrics of another run ({', '.join(runs)}), "
                               f"not the steps 1-{start_step} this run resumes after: it starts anew at step "
                               f"{start_step + 1}")
                kept = []
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        kept.append({"event": "start", "step": start_step, "steps": steps, "started": started, "run": self.run})
        write_file(self.path, "".join(json.dumps(r) + "\n" for r in kept), _WHAT)
        if self.tensorboard_dir is not None:
            self._writer = _summary_writer_class()(log_dir=str(self.tensorboard_dir), purge_step=start_step + 1)


def _is_run(records: list[dict[str, Any]], losses: Sequence[float]) -> bool:
    """Whether ``records`` are one run's, whose losses from step 1 on are ``losses``: one run id, a
    ``start`` first (step s: where the file began), then steps s + 1, s + 2, ... once each, with those losses."""
    runs = {r.get("run") for r in records}
    if len(runs) != 1 or None in runs or records[0]["event"] != "start":
        return False
    first = records[0]["step"]
    steps = [r for r in records if r["event"] == "step"]
    return ([r["step"] for r in steps] == list(range(first + 1, len(losses) + 1))
            and all(_same(r.get("loss"), x) for r, x in zip(steps, losses[first:])))


def _same(a: Any, b: float) -> bool:
    """Equal losses, NaN equal to NaN (a skipped non-finite step)."""
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


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
