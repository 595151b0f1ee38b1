"""What autograd keeps for one microbatch of each stage of this rank: measured before training starts.

``saved_bytes`` runs one forward (and the last stage's loss) of each stage under
``torch.autograd.graph.saved_tensors_hooks``, counting each storage once and leaving the parameters out;
with ``--offload-activations`` it also counts what the chosen layers moved to host memory;
the run reports it beside the cost model's figure (``modelpar.training.prediction.compare``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from modelpar.recompute.offload import HostOffload
from modelpar.training.config import TrainConfig

__all__ = ["saved_bytes"]


@torch.no_grad()
def _inputs(cfg: TrainConfig, stage: int, tp: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(stage)  # not the run's random stream
    b = cfg.batch_size // (cfg.dp * cfg.microbatches)
    if stage == 0:
        return torch.randint(0, cfg.model.vocab_size, (b, cfg.model.seq_len // cfg.cp), generator=gen).to(device)
    s = cfg.model.seq_len // cfg.cp // (tp if cfg.sequence_parallel else 1)
    return torch.randn(b, s, cfg.model.hidden, generator=gen).to(device, cfg.param_dtype)


def saved_bytes(cfg: TrainConfig, stages: dict[int, nn.Module], loss_fn: Any, tp: int,
                device: torch.device, offload: HostOffload | None = None,
                offloaded: dict[int, int] | None = None) -> dict[int, int]:
    """Bytes autograd keeps on the device for one microbatch of each stage here (a collective over the
    tensor-parallel group). With ``offload`` (``--offload-activations``) the chosen layers' hooks are inner to
    this count, so what they moved is not in it; ``offloaded`` gets the bytes each stage put in host memory."""
    params = [p for m in stages.values() for p in m.parameters()]
    last = cfg.pp * cfg.chunks - 1
    out = {}
    for stage, module in sorted(stages.items()):
        seen: dict[int, int] = {}

        def pack(x: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            storage = x.untyped_storage()
            owned = {p.untyped_storage().data_ptr() for p in params}  # now: ZeRO-3 gathers into new storage
            if storage.data_ptr() not in owned:
                seen[storage.data_ptr()] = storage.nbytes()
            return x.detach()  # never unpacked (no backward); x itself, a node's own output, would make a cycle

        if cfg.compile:  # the hook runs eagerly: traced, dynamo guarded on each storage's address and recompiled it
            pack = torch.compiler.disable(pack)

        before = offload.reading.bytes if offload is not None else 0
        x = _inputs(cfg, stage, tp, device)
        if stage:
            x.requires_grad_(True)
        passing = offload.passing(pack, lambda x: x) if offload is not None else contextlib.nullcontext()
        with passing, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            y = module(x)
            if stage == last:
                gen = torch.Generator().manual_seed(last + 1)
                b = cfg.batch_size // (cfg.dp * cfg.microbatches)
                loss_fn(y, torch.randint(0, cfg.model.vocab_size, (b, cfg.model.seq_len // cfg.cp), generator=gen).to(device))
            if offloaded is not None and offload is not None:
                offloaded[stage] = offload.reading.bytes - before
        del y  # this stage's graph and its host copies go before the next stage is counted
        out[stage] = sum(seen.values())
    return out
