"""Start a training run: on local processes (the default) or in torchrun's processes.

Locally, ``run_local`` spawns t·p·d ranks with ``modelpar.distributed.launch`` in a background
thread and feeds rank 0's events to the display; a rank's error ends every rank and is re-raised
here with its rank. Under torchrun each process calls ``run_in_process`` (NCCL on GPUs).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelpar.distributed import init_from_env, launch
from modelpar.text import prepare_data
from modelpar.training.config import TrainConfig
from modelpar.training.loop import TrainResult, train
from modelpar.training.report import EventFile

__all__ = ["run_in_process", "run_local"]


def _rank_main(cfg: TrainConfig, events: str) -> TrainResult:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.dims.world_size))  # no oversubscription
    return train(cfg, report=EventFile(events))


def run_local(cfg: TrainConfig, display: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Train on t·p·d new local processes (gloo); return rank 0's result.

    The data is prepared here, before any rank starts (``modelpar.text.prepare_data``)."""
    cfg = prepare_data(cfg.check()).check()
    outcome: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="modelpar-train-") as tmp:
        events = EventFile(Path(tmp) / "events.jsonl")

        def target() -> None:
            try:
                outcome["result"] = launch(_rank_main, cfg.dims.world_size, cfg, str(events.path),
                                           timeout=cfg.timeout, run_timeout=None)[0]
            except BaseException as err:
                outcome["error"] = err

        worker = threading.Thread(target=target, name="modelpar-train", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            for event in events.poll():
                if display is not None:
                    display(event)
    if display is not None and hasattr(display, "close"):
        display.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def run_in_process(cfg: TrainConfig, display: Callable[[dict[str, Any]], None] | None = None,
                   backend: str | None = None) -> TrainResult | None:
    """Train as one rank of torchrun's processes; the result (and ``display``) on global rank 0 only.

    ``backend``: "gloo" or "nccl"; None picks NCCL when CUDA is available (``init_from_env``).
    """
    import torch.distributed as dist

    init_from_env(backend, timeout=cfg.timeout)
    try:
        rank = dist.get_rank()
        result = train(cfg, report=display if rank == 0 else None)
        return result if rank == 0 else None
    finally:
        dist.destroy_process_group()
