"""Every run predicted with its own device: the profile ``modelpar train`` prices a run on when none is given.

In order: ``--hardware`` (a calibrated file or a GPU preset), as given; on a GPU the preset of the detected GPU
by name (``costmodel.presets.PROFILES``); else this machine's profile from the user's cache
(``costmodel.profiles.profile_cache_dir``), measured once by a short calibration — the process counts and
the run's own layer shape only (``calibrate(..., grid=...)``: seconds, not the full grid of ``modelpar
calibrate``) — and reused after, as autotuners keep their results. The cache file is keyed by what identifies
the machine and the measurement: the GPU's name (a GPU no preset names), CPU model and cores, torch version,
the run's process count, dtype and layer shape, and whether its layers are compiled (``--compile`` with
inductor: the compiled layer measured too, one compilation of the run's shape). ``--no-calibrate`` (or
``MODELPAR_NO_CALIBRATE=1``, which the test suite sets once in conftest) measures nothing: no step time is
predicted, memory still is. A nominal profile is never printed as a prediction.
"""

from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpar.calibrate.compute import cpu_model
from modelpar.calibrate.layers import QUICK_S
from modelpar.costmodel.profiles import busy_warning, profile_cache_dir

__all__ = ["NO_CALIBRATE_ENV", "SHORT_BUDGET_S", "MachineProfile", "cache_path", "machine_profile"]

NO_CALIBRATE_ENV = "MODELPAR_NO_CALIBRATE"  # "1": never calibrate (the test suite: no run pays a calibration)
SHORT_BUDGET_S = QUICK_S  # seconds per timed cell of the short calibration: at least REPS runs, both passes (one run
#                           of each cell, one pass, measured a layer 1.6x the full calibration's; as quick: its
#                           one cell is not what takes the time, starting its processes is)


@dataclass(frozen=True)
class MachineProfile:
    """Where a run's prediction comes from: ``hardware`` (a ``--hardware`` value: a file or a preset name; None:
    no step-time prediction) and how it was obtained, as the summary says it."""

    hardware: str | None
    how: str


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")[:60]


def cache_path(cfg: Any) -> Path:
    """The cache file of this machine's profile for ``cfg`` (checked): keyed by the machine (its GPU's name where it
    has one, the CPU model and cores), the torch version, the run's local process count, dtype and layer shape
    (``_run_grid``), and ``-compiled`` where its layers are (``_compiled``)."""
    import torch

    (hidden,), (tokens,), seq = _run_grid(cfg)
    gpu = f"{_slug(torch.cuda.get_device_name())}-" if torch.cuda.is_available() else ""  # one host, other GPUs
    machine = f"{gpu}{_slug(cpu_model())}-{os.cpu_count() or 1}c"
    name = (f"{machine}-torch{_slug(torch.__version__)}-r{cfg.dims.world_size}-{_dtype(cfg)}-h{hidden}-n{tokens}"
            f"-s{seq}{'-compiled' if _compiled(cfg) else ''}.json")
    return Path(profile_cache_dir()) / name


def _compiled(cfg: Any) -> bool:
    """Does ``cfg`` compile its layers as the profile's ``layer_compiled`` measures them (inductor)?"""
    return bool(cfg.compile) and cfg.compile_backend == "inductor"


def _dtype(cfg: Any) -> str:
    """The matmul dtype the run's layers compute in (bf16 and fp8 runs: bf16)."""
    return cfg.precision if cfg.precision in ("fp32", "fp64") else "bf16"


def _run_grid(cfg: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The run's own layer shape, as ``calibrate.layers`` measures one: (hidden,), (tokens per micro-batch,), seq."""
    from modelpar.training.prediction import local_run

    run = local_run(cfg)
    seq = max(1, run.model.seq // run.cp)
    return (run.model.hidden,), (max(seq, run.tokens),), seq


def _ranks(world: int) -> list[int]:
    """The process counts the run's prediction reads: the most up to the cores (compute tables) and ``world``
    (collectives, the cores shared)."""
    return sorted({min(world, os.cpu_count() or 1), world})


def machine_profile(cfg: Any, log: Any = None) -> MachineProfile:
    """The profile ``cfg``'s prediction is priced on (module docstring); ``log(line)`` hears of a calibration."""
    if cfg.hardware:
        return MachineProfile(cfg.hardware, "given")
    if os.environ.get(NO_CALIBRATE_ENV, "") not in ("", "0") or not cfg.calibrate:
        return MachineProfile(None, "not calibrated")
    import torch

    if torch.cuda.is_available():
        from modelpar.costmodel.presets import PROFILES

        gpu = torch.cuda.get_device_name()
        found = next((name for name in PROFILES if _slug(name.split("-")[0]) in _slug(gpu)), None)
        if found is not None:
            return MachineProfile(found, f"preset of the detected GPU, {gpu}")
    from modelpar.distributed import is_torchrun

    if is_torchrun():  # every launched process would measure at once: modelpar calibrate under torchrun does it
        return MachineProfile(None, "not calibrated under torchrun (modelpar calibrate there, then --hardware)")
    from modelpar.costmodel.profiles import load_profile, save_profile

    path = cache_path(cfg)
    if path.exists():
        try:
            busy = busy_warning(load_profile(path).cpu_busy)
        except ValueError:
            pass  # another torch or a torn file: measured again below
        else:
            again = f"; {busy}: delete {path} to measure again" if busy else ""
            return MachineProfile(str(path), f"calibrated once for this machine, cached{again}")
    from modelpar.calibrate.run import calibrate

    start = time.perf_counter()
    if log is not None:
        log(f"calibrating this machine for the prediction, once (cached in {path.parent})")
    profile = calibrate(_ranks(cfg.dims.world_size), (_dtype(cfg),), SHORT_BUDGET_S,
                        f"this-machine-{platform.node() or 'host'}", _run_grid(cfg), _compiled(cfg))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, path)
    busy = busy_warning(profile.cpu_busy)
    if busy and log is not None:
        log(f"warning: this machine's profile was {busy} (cached all the same; delete {path} to measure again "
            f"when the machine is quiet)")
    return MachineProfile(str(path), f"calibrated for this machine just now, {time.perf_counter() - start:.0f} s, cached")
