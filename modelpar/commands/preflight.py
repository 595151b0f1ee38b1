"""Checks ``modelpar train`` makes before it starts any rank: memory, paths it must write, the output lock.

Each failure is one line (a ValueError): a model whose training state cannot fit in this
machine's memory (``check_memory``, the cost model's bytes per rank), an ``--out`` that is a file
or cannot be written, a ``--checkpoint-dir`` under a file or on a read-only file system, a token
cache that cannot be created. ``out_lock`` gives ``--out`` one run at a time, as ``LOCK`` does a
checkpoint directory, so two runs never interleave one ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only: importing it loads torch
    from modelpar.training import TrainConfig

__all__ = ["OUT_LOCK", "autocast_floor_bytes", "check_memory", "check_paths", "check_writable", "out_lock",
           "state_bytes_per_rank"]

OUT_LOCK = ".modelpar-out.lock"  # in --out, held by the launching process (under torchrun: global rank 0)


def check_writable(flag: str, path: str | os.PathLike, what: str = "a folder") -> None:
    """ValueError in one line if folder ``path`` cannot be created or written by this process."""
    path = Path(path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag} {str(path)!r} is a file: give {what} to write in")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {str(path)!r} is not writable ({_why(path)})")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r} cannot be created: {str(parent)!r} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(path)!r} cannot be created: {str(parent)!r} is not writable ({_why(parent)})")


def _why(path: Path) -> str:
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "a read-only file system"
    except OSError:
        pass
    return "permission denied"


def state_bytes_per_rank(cfg: TrainConfig) -> float:
    """Bytes of weights, gradients and AdamW state on the most loaded rank of ``cfg`` (a ``TrainConfig``):
    the cost model's ``memory_breakdown`` state at the trainer's element sizes. Activations come on top."""
    from modelpar.costmodel import DEFAULT
    from modelpar.costmodel.memory import memory_breakdown
    from modelpar.costmodel.specs import ParallelConfig

    width = cfg.param_dtype.itemsize  # bf16 keeps fp32 weights, gradients and moments
    layout = ParallelConfig(t=cfg.tp, p=cfg.pp, d=cfg.dp, micro_batch=max(1, cfg.batch_size // cfg.dp // cfg.microbatches),
                            v=cfg.chunks, recompute="none", zero=cfg.zero)
    assumptions = DEFAULT.with_(param_bytes=width, grad_bytes=width, uniform_stages=False, memory_reserve_gb=0.0)
    return memory_breakdown(cfg.model.spec(), layout, cfg.microbatches, assumptions)["state"]


def _host_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def autocast_floor_bytes(cfg: TrainConfig) -> float:
    """Bytes a GPU's allocator holds beyond the state in any step of ``cfg``: one microbatch's bf16 weight copies
    (``costmodel.local_memory.autocast_copy_bytes``) on the stage that has the most; 0 without autocast."""
    from modelpar.costmodel.local_memory import autocast_copy_bytes
    from modelpar.training.prediction import local_run

    run = local_run(cfg)
    return max(autocast_copy_bytes(run, s) for s in range(run.stages))


def check_memory(cfg: TrainConfig, ranks_here: int, device_bytes: int | None = None) -> None:
    """ValueError in one line if ``ranks_here`` ranks of ``cfg`` cannot hold their training state in this
    machine's memory (``device_bytes``: one GPU's, for a rank on a GPU; else the host's, shared by them)."""
    per_rank = state_bytes_per_rank(cfg)
    what = f"{cfg.model.num_parameters():,} parameters, {cfg.precision}, t={cfg.tp} p={cfg.pp} d={cfg.dp}"
    if device_bytes is not None:
        copies = autocast_floor_bytes(cfg)
        per_rank += copies
        held = "weights, gradients, AdamW state" + (" and autocast's bf16 weight copies" if copies else "")
        if per_rank > device_bytes:
            raise ValueError(f"the model does not fit: each rank needs at least {per_rank / 1e9:,.1f} GB for its "
                             f"{held} ({what}), a GPU here has {device_bytes / 1e9:,.1f} GB; "
                             "use a smaller model or more ranks (--tp, --pp, --zero 1)")
        return
    host = _host_memory()
    if host is not None and per_rank * ranks_here > host:
        raise ValueError(f"the model does not fit: {ranks_here} rank{'s' if ranks_here > 1 else ''} here need at least "
                         f"{per_rank * ranks_here / 1e9:,.1f} GB for their weights, gradients and AdamW state "
                         f"({per_rank / 1e9:,.1f} GB each; {what}), this machine has {host / 1e9:,.1f} GB; use a "
                         "smaller model or more machines")


def check_paths(cfg: TrainConfig, out: str) -> None:
    """Every folder the run will write: ``--out``, ``--checkpoint-dir`` and the token cache."""
    from modelpar.text.prepare import cache_root

    check_writable("--out", out)
    if cfg.checkpoint_dir:
        check_writable("--checkpoint-dir", cfg.checkpoint_dir)
    cache = cache_root(cfg)
    check_writable("--cache-dir" if cfg.data.cache_dir else "the token cache (--cache-dir)", cache)


@contextlib.contextmanager
def out_lock(out: str, first: bool = True) -> Iterator[None]:
    """Hold ``--out``'s lock for the block (``first``: the process that writes it; others pass through).

    A second run on the same ``--out`` is refused in one line naming the holder; a folder this
    run created and left empty (a refusal before training) is removed again.
    """
    if not first:
        yield
        return
    from modelpar.checkpoint import DirLock

    folder = Path(out)
    created = not folder.exists()
    lock = DirLock(folder, OUT_LOCK, what="output folder (--out)")
    try:
        lock.acquire()
    except ValueError:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    try:
        yield
    finally:
        lock.release()
        if created:
            with contextlib.suppress(OSError):  # not empty: the run wrote its results
                folder.rmdir()
