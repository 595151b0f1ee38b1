"""What a checkpoint holds for a run, and what a resumed run must share with the one that wrote it.

Entries (``modelpar.checkpoint.ShardedState``), each the *full* tensor of the single-process model:

    model.<name>                 every parameter under its single-process name (global layer index;
                                 a last stage's copy of a tied output weight is the embedding: saved once;
                                 ZeRO-3: each rank adds the boxes of its ranges, as for the AdamW state)
    optim.<name>.<field>         AdamW's exp_avg and exp_avg_sq, laid out like the parameter; step whole
                                 (ZeRO-1: only the dp rank owning a range of the flattened parameter
                                 adds that range's boxes, ``ZeroAdamW.checkpoint_shards``)
    rng                          the torch RNG state (one rank's: every rank holds the same one, as
                                 training draws no random numbers after initialisation)

A rank adds the part it holds, as ``param_layout`` describes it, so the same names and full shapes
come out of every (t, p, d, v) split and DCP moves the boxes between splits. The data position
needs no tensor: batches depend only on (seed, step), and the step is in the metadata.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, fields, replace
from typing import Any

import torch
from torch import nn

from modelpar.checkpoint import Shard, ShardedState
from modelpar.model import ModelConfig, global_name
from modelpar.tensor_parallel.sharding import ParamLayout, param_layout
from modelpar.text.config import DataConfig
from modelpar.training.config import TrainConfig
from modelpar.training.optimizer import Optimizer
from modelpar.training.zero import ZeroAdamW

__all__ = ["MUST_MATCH", "check_meta", "checkpoint_state", "init_optimizer_state", "layout_shard", "resumed_config",
           "run_meta"]

# Settings a checkpoint must share with the run that resumes it, besides the model and the data (its
# tokens and tokenizer, ``data.fingerprint``): the batches and everything the optimisation depends on
# (the lr schedule depends on ``steps``). The split (t, p, d, v), the schedule, the micro-batches,
# recomputation and sequence parallelism may change: they compute the same gradients up to rounding.
MUST_MATCH = ("seed", "batch_size", "precision", "steps", "lr", "warmup", "weight_decay", "clip")


def init_optimizer_state(optimizer: Optimizer) -> None:
    """Create AdamW's per-parameter state now (zeros, step 0) rather than lazily at the first step,
    so that a checkpoint can be loaded into it; AdamW then continues exactly as if it had made it."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")  # as torch's AdamW keeps them: on the GPU, fp32
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                                 else torch.tensor(0.0, dtype=scalar))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def layout_shard(tensor: torch.Tensor, layout: ParamLayout) -> Shard:
    """``tensor`` (this rank's data of a parameter with ``layout``, or of its optimizer state) as a Shard."""
    if layout.dim is None or layout.shards == 1:
        return Shard.whole(tensor)
    return Shard.split(tensor, layout.dim, layout.shard, layout.shards, layout.blocks)


def checkpoint_state(model: ModelConfig, modules: Mapping[int, nn.Module], optimizer: Optimizer,
                     rng: torch.Tensor) -> ShardedState:
    """This rank's entries; loading fills these very tensors in place. Under ZeRO-1/2 (``ZeroAdamW``)
    a rank adds the boxes of the optimizer state it owns, its ranges of the flattened parameters;
    under ZeRO-3 the parameters' entries too (the ranges are all it holds)."""
    state = ShardedState()
    names: dict[int, tuple[str, ParamLayout]] = {}
    for module in modules.values():
        for local_name, p in module.named_parameters():
            name, layout = global_name(model, local_name), param_layout(p)
            names[id(p)] = name, layout
            if not (isinstance(optimizer, ZeroAdamW) and not optimizer.gather):  # ZeRO-3: from the ranges, below
                state.add(f"model.{name}", layout_shard(p.data, layout))
            if isinstance(optimizer, ZeroAdamW):
                continue
            for field, value in optimizer.state.get(p, {}).items():
                whole = value.shape != p.shape  # AdamW's step
                state.add(f"optim.{name}.{field}", Shard.whole(value) if whole else layout_shard(value, layout))
    if isinstance(optimizer, ZeroAdamW):
        for entry, shard in optimizer.checkpoint_shards(names):
            state.add(entry, shard)
    state.add("rng", Shard.whole(rng))
    return state


def run_meta(cfg: TrainConfig, step: int, losses: list[float]) -> dict[str, Any]:
    """JSON metadata stored with a checkpoint (rank 0 writes it): the run's config, which tokens it
    trained on, its step and losses."""
    return {"config": cfg.to_dict(), "data": cfg.data.fingerprint, "step": step, "losses": losses}


def check_meta(meta: Mapping[str, Any], cfg: TrainConfig, path: str) -> None:
    """ValueError (the same on every rank) if checkpoint ``path`` belongs to another model or optimisation."""
    saved = meta.get("config", {})
    their_model, my_model = saved.get("model", {}), asdict(cfg.model)
    diff = sorted(k for k in my_model.keys() | their_model.keys() if their_model.get(k) != my_model.get(k))
    if diff:
        raise ValueError(f"checkpoint {path!r} is of a different model: {', '.join(diff)} differ (checkpoint "
                         f"{[their_model.get(k) for k in diff]}, this run {[my_model.get(k) for k in diff]})")
    theirs = {"data": meta.get("data"), **{key: saved.get(key) for key in MUST_MATCH}}
    if theirs["precision"] is None:  # written before ``precision``: its ``dtype`` says
        theirs["precision"] = TrainConfig.from_dict({"dtype": saved.get("dtype")}).precision
    mine = {"data": cfg.data.fingerprint, **{key: getattr(cfg, key) for key in MUST_MATCH}}
    for key, value in mine.items():
        if theirs[key] != value:
            raise ValueError(f"checkpoint {path!r} was written with {key}={theirs[key]!r}, this run has "
                             f"{key}={value!r}; resume with the same data and tokenizer, seed, batch size, precision "
                             "and optimisation settings (steps, lr, warmup, weight decay, clip) to continue exactly")


def resumed_config(cfg: TrainConfig, meta: Mapping[str, Any], given: Collection[str]) -> TrainConfig:
    """``cfg`` with the model, the data and the ``MUST_MATCH`` settings of checkpoint ``meta`` wherever
    the field is not in ``given`` (the settings the user chose: model fields by their own names,
    "data" for any data setting). The data comes unprepared: preparing it again gives its fingerprint."""
    saved = TrainConfig.from_dict(meta.get("config", {}))
    model = {f.name: getattr(saved.model, f.name) for f in fields(ModelConfig) if f.name not in given}
    run: dict[str, Any] = {key: getattr(saved, key) for key in MUST_MATCH if key not in given}
    if "data" not in given:
        run["data"] = replace(saved.data, prepared=None, fingerprint=DataConfig().fingerprint)
    return replace(cfg, model=replace(cfg.model, **model), **run)
