"""``Pipe``: GPipe's forward in one process, one worker thread per stage (reference §3.1, torchgpipe).

The batch is split into micro-batches and run wave by wave along ``clock_cycles`` (§2.2)::

    batches = list(torch.split(inputs, split_size))
    for wave in clock_cycles(len(batches), len(stages)):
        for i, j in wave:            # first submit the whole wave: its stages run at once
            submit(j, partial(run_stage, stages[j], batches[i], devices[j]))  # values bound now
        for i, j in wave:            # then receive in the same order
            batches[i] = receive(j)
    return torch.cat(batches)

Nothing is detached, so ``backward`` flows through every stage; autograd runs it (on CPU, one
thread: only the forward is pipelined, see docs/pipe.md). The ``.to(device)`` copy happens in the
submitted function, on the stage's own thread, so stages do not wait on each other's copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from modelpar._validate import check_int
from modelpar.pipeline.partition import split_sequential
from modelpar.pipeline.workers import StageWorkers, as_device
from modelpar.schedules.clock_cycles import clock_cycles

__all__ = ["Pipe"]


def _stage_list(stages: Sequence[nn.Module] | nn.Sequential, balance: Sequence[int] | None) -> list[nn.Module]:
    """The stages as a list: a list of modules, an ``nn.Sequential``'s children, or its ``balance`` cut."""
    if balance is not None:
        if not isinstance(stages, nn.Sequential):
            raise ValueError(f"balance needs stages to be an nn.Sequential, got {type(stages).__name__}")
        return list(split_sequential(stages, balance))
    if not isinstance(stages, (Sequence, nn.Sequential, nn.ModuleList)) or isinstance(stages, (str, bytes)):
        raise ValueError(f"stages must be a list of modules or an nn.Sequential, got {type(stages).__name__}")
    stage_list = list(stages)
    if not stage_list:
        raise ValueError("stages must hold at least one module, got none")
    for j, stage in enumerate(stage_list):
        if not isinstance(stage, nn.Module):
            raise ValueError(f"stages[{j}] must be an nn.Module, got {type(stage).__name__}")
    return stage_list


def _run_stage(stage: nn.Module, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One stage on one micro-batch, on the stage's thread: the copy to its device included."""
    return stage(x.to(device))


class Pipe(nn.Module):
    """Pipeline-parallel wrapper: ``Pipe(stages, devices, split_size)(x)`` equals running the stages in order.

    ``stages``: a list of modules, or an ``nn.Sequential`` (each child a stage, or cut by ``balance``
    into ``len(balance)`` stages). ``devices``: one per stage (default: all CPU); each stage is moved
    to its device. ``split_size``: rows per micro-batch (``torch.split``; the last may be smaller).
    ``num_threads``: PyTorch intra-op threads in each worker (``None`` keeps the default).
    Inputs are one tensor whose first dimension is the batch; the output is on the last device.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module] | nn.Sequential,
        devices: Sequence[Any] | None = None,
        split_size: int = 1,
        *,
        balance: Sequence[int] | None = None,
        num_threads: int | None = None,
    ) -> None:
        super().__init__()
        stage_list = _stage_list(stages, balance)
        if devices is None:
            devices = ["cpu"] * len(stage_list)
        if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
            raise ValueError(f"devices must be a list with one device per stage, got {devices!r}")
        if len(devices) != len(stage_list):
            raise ValueError(f"devices must have one entry per stage ({len(stage_list)}), got {len(devices)}: {list(devices)}")
        self.split_size = check_int("split_size", split_size, minimum=1)
        device_list = [as_device(f"devices[{j}]", d) for j, d in enumerate(devices)]
        self.stages = nn.ModuleList(stage.to(device) for stage, device in zip(stage_list, device_list))
        self.workers = StageWorkers(device_list, num_threads=num_threads)

    @property
    def devices(self) -> list[torch.device]:
        """Each stage's device, stage order."""
        return list(self.workers.devices)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not isinstance(inputs, torch.Tensor):
            raise ValueError(f"inputs must be a tensor, got {type(inputs).__name__}")
        if inputs.dim() == 0 or inputs.size(0) == 0:
            raise ValueError(f"inputs must have at least one row in dimension 0, got shape {tuple(inputs.shape)}")
        batches = list(torch.split(inputs, self.split_size))
        devices = self.workers.devices
        for wave in clock_cycles(len(batches), len(self.stages)):
            for i, j in wave:
                self.workers.submit(j, partial(_run_stage, self.stages[j], batches[i], devices[j]))
            error: BaseException | None = None
            for i, j in wave:  # receive the whole wave even if one fails: no result is left queued
                try:
                    batches[i] = self.workers.receive(j)
                except BaseException as exc:
                    error = error or exc
            if error is not None:
                raise error
        return torch.cat(batches)

    def close(self) -> None:
        """Stop the worker threads (the module stays usable for inspection, not for forward)."""
        self.workers.close()

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def extra_repr(self) -> str:
        return f"devices={[str(d) for d in self.devices]}, split_size={self.split_size}"
