"""Which device a rank computes and communicates on, set once at start-up, and the guard that they agree.

Under NCCL each process drives one GPU: local rank r uses ``cuda:r``. It is made the current
device before the process group exists (``torch.cuda.set_device``) and passed to
``init_process_group`` as ``device_id``, so NCCL binds its communicators to that GPU from the
start; otherwise every rank of a machine would compute and communicate on ``cuda:0``. gloo ranks
compute on the CPU (a gloo pipeline group may also carry GPU tensors, staged through host memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modelpar._validate import check_choice, check_int

if TYPE_CHECKING:
    import torch

__all__ = ["check_stage_device", "gpu_count", "rank_device", "require_gpus"]


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_gpus(need: int, what: str) -> None:
    """ValueError, one line, unless this machine has at least ``need`` GPUs for ``what``."""
    have = gpu_count()
    if have < need:
        raise ValueError(f"{what} needs {need} GPU{'s' if need != 1 else ''} (one per rank), "
                         f"this machine has {have}")


def rank_device(backend: str, local_rank: int) -> torch.device | None:
    """Make ``cuda:local_rank`` this process's current device under NCCL and return it (the
    ``device_id`` for ``init_process_group``); None for gloo, whose ranks compute on the CPU."""
    import torch

    check_choice("backend", backend, ["gloo", "nccl"])
    local_rank = check_int("local_rank", local_rank, minimum=0)
    if backend != "nccl":
        return None
    require_gpus(local_rank + 1, f"NCCL rank with local rank {local_rank}")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def check_stage_device(compute: torch.device, comm: torch.device, what: str = "the stage's parameters") -> None:
    """ValueError naming both devices unless tensors on ``compute`` can be sent from ``comm``.

    NCCL sends from its own GPU (``comm`` is ``cuda:i``): the stage must be on exactly that GPU.
    gloo sends from host memory (``comm`` is the CPU): a stage on the CPU or on a GPU (staged
    through the host) will do. A ``meta`` tensor holds no data and never will.
    """
    ok = compute == comm if comm.type == "cuda" else compute.type in ("cpu", "cuda")
    if not ok:
        raise ValueError(f"{what} are on {compute} but this rank's process group communicates on {comm}: "
                         f"move the stage to {comm} (torch.cuda.set_device(local_rank) at start-up, "
                         f"build the model on that device)")
