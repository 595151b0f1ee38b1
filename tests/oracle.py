"""The training tests' oracle: a plain single-process PyTorch loop over the same batches, float64.

torch's own cross entropy, ``clip_grad_norm_`` and AdamW on the whole model — nothing of
modelpar's parallel machinery — so every split, schedule and resume is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from modelpar.corpus import load_corpus
from modelpar.model import build_stage
from modelpar.model.moe import moe_modules
from modelpar.training import TrainConfig, lr_at, param_groups


@dataclass
class PlainRun:
    """What the plain loop computed."""

    losses: list[float]  # every step's training loss
    norms: list[float]  # every step's gradient norm before clipping
    val: float  # the validation loss of batch 0 after the last step
    params: dict[str, torch.Tensor]  # the final parameters, by single-process name
    experts: list[list[list[float]]] = field(default_factory=list)  # MoE: each step's MoE.take_stats() per layer


def plain_loop(cfg: TrainConfig, corpus=None) -> PlainRun:
    """``cfg.steps`` steps of ``cfg`` on one process (its split ignored), on ``corpus`` (default: the shipped one)."""
    corpus = load_corpus() if corpus is None else corpus
    model = build_stage(cfg.model, seed=cfg.seed, dtype=torch.float64)
    opt = torch.optim.AdamW(param_groups(model.parameters(), cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    def xent(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    losses, norms, experts = [], [], []
    for step in range(cfg.steps):
        x, y = corpus.batch("train", step, cfg.batch_size, cfg.model.seq_len, cfg.seed)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        opt.zero_grad()
        loss = xent(x, y)
        loss.backward()
        experts.append([m.take_stats().tolist() for _, m in moe_modules(model)])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip).item())
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        val = xent(*corpus.batch("val", 0, cfg.batch_size, cfg.model.seq_len, cfg.seed)).item()
    return PlainRun(losses, norms, val, {n: p.detach() for n, p in model.named_parameters()}, experts)
