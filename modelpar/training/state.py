"""What a checkpoint holds for one rank: its parameter shards, their AdamW state and its RNG.

Keys name the shard, ``model.<global parameter name>|tp<i>``: layer indices are global, so every
pipeline stage's entries are distinct, tensor-parallel shards differ by ``|tp<i>`` and
data-parallel replicas share keys (DCP writes them once). The data position needs no tensor:
batches depend only on (seed, step), and the step is in the metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from modelpar.training.config import TrainConfig

__all__ = ["check_meta", "init_optimizer_state", "run_meta", "state_tensors"]

# Settings a checkpoint must share with the run that resumes it: the model's split, the data
# stream, and everything the optimisation depends on (the lr schedule depends on ``steps``). The
# schedule and micro-batch count may change: they compute the same gradients (up to rounding).
_MUST_MATCH = ("tp", "pp", "dp", "chunks_used", "seed", "batch_size", "dtype", "steps", "lr", "warmup",
               "weight_decay", "clip", "data")


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's per-parameter state now (zeros, step 0) rather than lazily at the first step,
    so that a checkpoint can be loaded into it; AdamW then continues exactly as if it had made it."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=scalar)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_tensors(modules: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer, tp_rank: int,
                  rank: int, rng: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's checkpoint entries; loading fills these very tensors in place."""
    out: dict[str, torch.Tensor] = {}
    for module in modules.values():
        for name, p in module.named_parameters():
            out[f"model.{name}|tp{tp_rank}"] = p.data
            for field, value in optimizer.state[p].items():
                out[f"optim.{name}.{field}|tp{tp_rank}"] = value
    out[f"rng|rank{rank}"] = rng
    return out


def run_meta(cfg: TrainConfig, step: int, losses: list[float]) -> dict[str, Any]:
    """JSON metadata stored with a checkpoint (rank 0 writes it)."""
    return {"model": cfg.model.__dict__, "tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp,
            "chunks_used": cfg.virtual_chunks, "seed": cfg.seed, "batch_size": cfg.batch_size,
            "dtype": cfg.dtype, "schedule": cfg.schedule, "microbatches": cfg.microbatches, "steps": cfg.steps,
            "lr": cfg.lr, "warmup": cfg.warmup, "weight_decay": cfg.weight_decay, "clip": cfg.clip,
            "step": step, "losses": losses, "data": cfg.data.fingerprint}


def check_meta(meta: Mapping[str, Any], cfg: TrainConfig, path: str) -> None:
    """ValueError (the same on every rank) if checkpoint ``path`` belongs to another model or split."""
    if dict(meta.get("model", {})) != cfg.model.__dict__:
        diff = sorted(k for k, v in cfg.model.__dict__.items() if meta.get("model", {}).get(k) != v)
        raise ValueError(f"checkpoint {path!r} is of a different model: {', '.join(diff)} differ "
                         f"(checkpoint {[meta.get('model', {}).get(k) for k in diff]}, "
                         f"this run {[cfg.model.__dict__[k] for k in diff]})")
    mine = run_meta(cfg, 0, [])
    for key in _MUST_MATCH:
        if meta.get(key) != mine[key]:
            raise ValueError(f"checkpoint {path!r} was written with {key}={meta.get(key)!r}, this run has "
                             f"{key}={mine[key]!r}; resume with the same model, split (tp, pp, dp, chunks), "
                             "data and tokenizer, seed, batch size, dtype and optimisation settings "
                             "(steps, lr, warmup, weight decay, clip) to continue exactly")
