"""Layout-free checkpoints through ``torch.distributed.checkpoint``: every tensor saved whole, by name.

``ShardedState`` maps global names to the ``Shard`` of each full tensor a rank holds; DCP writes
the boxes once and reads any box back, so a checkpoint written at one (t, p, d, v) loads at any
other, and ``read_full_tensors`` reads whole tensors in one process. ``store`` is the format of one
checkpoint (atomic, checksummed writes), ``manager`` the rules of a directory of them (validity,
keep-N, fresh runs, resume), ``lock`` gives a directory one writer. The file names and
format constants (``store.FORMAT``, ``store.MARKER``, ``lock.LOCK``) stay in their modules.
"""

from modelpar.checkpoint.lock import DirLock, check_unlocked
from modelpar.checkpoint.manager import (
    CheckpointManager,
    check_fresh,
    latest_checkpoint,
    load_checkpoint,
    read_newest,
    save_checkpoint,
)
from modelpar.checkpoint.shards import Piece, Shard, ShardedState
from modelpar.checkpoint.store import checkpoint_problem, checkpoint_step, read_full_tensors, read_meta

__all__ = [
    "CheckpointManager",
    "DirLock",
    "Piece",
    "Shard",
    "ShardedState",
    "check_fresh",
    "check_unlocked",
    "checkpoint_problem",
    "checkpoint_step",
    "latest_checkpoint",
    "load_checkpoint",
    "read_full_tensors",
    "read_meta",
    "read_newest",
    "save_checkpoint",
]
