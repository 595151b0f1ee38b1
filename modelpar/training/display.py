"""What `modelpar train` shows: a live progress bar, then a summary table and a loss-curve PNG.

The training ranks emit small event dicts (start, step, eval, done); ``Display`` turns them into
a rich progress bar with the loss and tokens/s. Local runs pass events from rank 0 to the parent
through the queue that carries the ranks' results (``modelpar.distributed.to_launcher``), so the
parent owns the terminal; under torchrun rank 0 displays them itself.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from modelpar._outputs import write_file

__all__ = ["Display", "peak_tflops_of", "plot_losses", "summary_table"]


class Display:
    """A progress bar (step m/n, loss, last validation loss, tokens/s, elapsed and remaining time) and
    the run's notes; ``progress=False`` keeps only the notes (logs and CI)."""

    def __init__(self, console: Console | None = None, title: str = "train", progress: bool = True) -> None:
        self.console = console or Console(stderr=True)
        self.title = title
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  {task.fields[tps]} tok/s"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False, disable=not progress,
        )
        self.task: Any = None

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "note":  # one line about the run (its checkpoint directory), shown even without a bar
            self.console.print(f"modelpar train: {event['text']}", highlight=False, markup=False, soft_wrap=True)
        elif kind == "start":
            self.progress.start()
            self.task = self.progress.add_task(self.title, total=event["steps"], completed=event["start_step"],
                                               loss="-", val="-", tps="-")
        elif self.task is None:
            return
        elif kind == "step":
            self.progress.update(self.task, completed=event["step"], loss=f"{event['loss']:.3f}",
                                 tps=f"{event['tokens_per_s']:,.0f}")
        elif kind == "eval":
            self.progress.update(self.task, val=f"{event['val_loss']:.3f}")
        elif kind == "done":
            self.close()

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()
            self.task = None


def peak_tflops_of(device_name: str) -> float | None:
    """Dense 16-bit peak TFLOP/s of a known GPU, by its CUDA name (the cost model's presets); else None."""
    from modelpar.costmodel.presets import GPUS

    name = device_name.upper()
    if "PCIE" in name:  # PCIe parts run at lower clocks than the SXM presets
        return None
    for key, preset in (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb")):
        if key in name:
            return GPUS[preset].gpu.peak_tflops
    return None


def summary_table(rows: list[tuple[str, str]], title: str = "modelpar train") -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table


def plot_losses(path: str | os.PathLike, losses: list[float], val: list[tuple[int, float]],
                baseline: float, title: str) -> Path:
    """Training loss per step, validation points and the unigram baseline, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(range(1, len(losses) + 1), losses, lw=1, color="tab:blue", label="training loss")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", color="tab:orange", ms=4, label="validation loss")
    ax.axhline(baseline, ls="--", color="gray", label=f"unigram baseline {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_file(path, png.getvalue(), "the loss curve")  # a full disk: one line, no torn PNG
    return path
