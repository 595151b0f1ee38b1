"""Mixture of experts: a router and E SwiGLU experts (+ S shared ones) in place of a layer's MLP.

    logits = x·W_rᵀ [b, s, E] ─► scores (softmax, or sigmoid as DeepSeek-V3) ─► top-k experts per token,
    gates = the top-k scores renormalised to sum 1 (Mixtral) ─► capacity: per sequence and expert at most
    C = ⌈cf·s·k/E⌉ assignments, earlier tokens first (``capacity_factor=None``: dropless) ─► tokens sorted
    by expert ─► all-to-all to the experts' ranks (``modelpar.model.moe_comm``) ─► SwiGLU per expert ─►
    all-to-all back ─► y = Σ_kept gate·expert(x) [+ shared(x)]

Expert parallelism: with an ``ep_group`` of n ranks, rank r holds experts [r·E/n, (r+1)·E/n) as one
stacked tensor (its ``ParamLayout`` splits dim 0 over the ep ranks, so checkpoints stay layout-free).

Load balance (Switch, Fedus et al. 2021, eq. 4; per sequence as DeepSeek-V3's sequence-wise loss, §2.1.2):
aux_b = E/k · Σ_e f_{b,e}·P_{b,e}, f = share of the sequence's k·s assignments (before dropping) to e
times k, P = mean score of e over the sequence (sigmoid scores normalised per token); 1 when balanced.
Per sequence, because a mean over sequences does not depend on how a batch is split into
micro-batches and replicas. Its gradient, ``aux_loss_coef`` · Σ_b aux_b / ``aux_rows``, enters at the
layer's output in the backward (Megatron's ``MoEAuxLossAutoScaler``), so the pipeline's loss is
untouched; with ``aux_rows`` = the replica's batch the run minimises LM + coef · mean_b aux_b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from modelpar._compat import in_backward
from modelpar.model.config import ROUTERS, ModelConfig
from modelpar.model.moe_comm import all_to_all, exchange_counts
from modelpar.tensor_parallel import ParallelMLP, TensorParallelModule
from modelpar.tensor_parallel.sharding import ParamLayout

__all__ = ["Experts", "MoE", "Routing", "capacity", "is_expert_param", "moe_block", "moe_modules", "route"]

_EXPERT = "moe_expert"  # attribute marking expert weights (reduced over d/ep, not d)


def is_expert_param(param: torch.Tensor) -> bool:
    """True for the stacked expert weights, which an expert-parallel rank holds only part of."""
    return bool(getattr(param, _EXPERT, False))


def capacity(seq: int, top_k: int, experts: int, factor: float) -> int:
    """Assignments one expert takes from one sequence: ⌈factor · s · k / E⌉ (at least 1)."""
    return max(1, math.ceil(factor * seq * top_k / experts))


@dataclass
class Routing:
    """Where each token's k choices go: ``experts``, ``gates`` [b, s, k], ``kept`` (not dropped), and
    ``aux`` [b], the load-balancing loss of each sequence."""

    experts: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    aux: torch.Tensor


def route(logits: torch.Tensor, top_k: int, router: str = "softmax", capacity_factor: float | None = None) -> Routing:
    """Top-k routing of router logits [b, s, E] (see the module docstring)."""
    b, s, num = logits.shape
    if router == "softmax":
        scores = torch.softmax(logits, dim=-1)
        probs = scores
    else:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
    top, experts = torch.topk(scores, top_k, dim=-1)
    gates = top / top.sum(-1, keepdim=True)
    onehot = F.one_hot(experts.reshape(b, s * top_k), num)  # assignments in (token, choice) order
    if capacity_factor is None:
        kept = torch.ones_like(experts, dtype=torch.bool)
    else:
        position = ((onehot.cumsum(1) - 1) * onehot).sum(-1)  # this assignment's place in its expert's queue
        kept = (position < capacity(s, top_k, num, capacity_factor)).view(b, s, top_k)
    share = onehot.sum(1).to(probs.dtype) / (s * top_k)  # f / k
    aux = num * (share * probs.mean(1)).sum(-1)
    return Routing(experts, gates, kept, aux)


class Experts(TensorParallelModule):
    """This rank's experts, stacked as Mixtral's: ``gate_up`` [E/n, 2F, h] ([W_gate; W_up]), ``down`` [E/n, h, F]."""

    def __init__(self, hidden: int, ffn: int, experts: int, ep_group: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._init_tensor_parallel(None)
        self.ep_group = ep_group
        self.ep_world = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if experts % self.ep_world:
            raise ValueError(f"experts ({experts}) must be divisible by ep ({self.ep_world})")
        self.local = experts // self.ep_world
        self.gate_up = nn.Parameter(torch.empty(self.local, 2 * ffn, hidden, dtype=dtype))
        self.down = nn.Parameter(torch.empty(self.local, hidden, ffn, dtype=dtype))
        for name in ("gate_up", "down"):
            self.tp_layouts[name] = ParamLayout(dim=0, rank=self.ep_rank, world=self.ep_world)
        self._attach_layouts()

    def _attach_layouts(self) -> None:
        super()._attach_layouts()
        for name in ("gate_up", "down"):
            setattr(getattr(self, name), _EXPERT, True)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert (``counts`` [E] of them each) → their outputs, in the same order."""
        n, local = self.ep_world, self.local
        send = counts.view(n, local)
        recv = exchange_counts(send, self.ep_group)  # [n, E/n]: rows rank j sends for each of my experts
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        pieces = all_to_all(rows, out_splits, in_splits, self.ep_group).split(recv.flatten().tolist())
        outs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for e in range(local):
            x = torch.cat([pieces[j * local + e] for j in range(n)])
            gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e])
            for j, part in enumerate(y.split(recv[:, e].tolist())):
                outs[j].append(part)
        back = torch.cat([p for per_rank in outs for p in per_rank])
        return all_to_all(back, in_splits, out_splits, self.ep_group)


class _AuxLoss(torch.autograd.Function):
    """Identity on the layer output; the backward adds d(aux)/d(aux) = 1 to the aux loss term."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


class MoE(nn.Module):
    """Router + ``experts`` SwiGLU experts of width ``ffn`` (+ ``shared`` always-on ones, fused into
    one SwiGLU of width shared·ffn, split across the tp group as the dense MLP).

    The routed part is replicated across tensor-parallel ranks (each computes it for all its
    tokens). ``stats``: [tokens per expert (E), dropped assignments, Σ_b aux_b, sequences] of the
    training-mode forwards since ``take_stats`` (a recomputation inside a backward is not counted).
    """

    def __init__(self, hidden: int, experts: int, top_k: int, ffn: int, shared: int = 0, router: str = "softmax",
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.0, group: Any = None,
                 ep_group: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and experts ({experts})")
        self.num_experts, self.top_k, self.router_kind = experts, top_k, router
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.aux_rows: int | None = None  # rows the aux loss is averaged over (None: this forward's batch)
        self.router = nn.Linear(hidden, experts, bias=False, dtype=dtype)
        self.experts = Experts(hidden, ffn, experts, ep_group, dtype=dtype)
        self.shared = (ParallelMLP(hidden, shared * ffn, bias=False, gated=True, group=group, dtype=dtype)
                       if shared else None)
        self.stats: torch.Tensor | None = None  # made by the first backward (a model built on meta has no data)

    def record(self, stats: torch.Tensor) -> None:
        self.stats = stats.clone() if self.stats is None else self.stats + stats

    def take_stats(self) -> torch.Tensor:
        """This step's statistics (see the class docstring; zeros if none), reset."""
        out = self.stats if self.stats is not None else torch.zeros(self.num_experts + 3, dtype=torch.float64)
        self.stats = None
        return out

    # --compile: routing has data-dependent sizes and host reads; it runs eagerly (``torch.compiler.disable``,
    # applied by ``modelpar.training.compile._eager_under_compile`` when it compiles: the decorator imports
    # dynamo, seconds of CPU in every process that imports the model, the launcher's included)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        logits = self.router(x)
        r = route(logits if logits.dtype in (torch.float32, torch.float64) else logits.float(), self.top_k,
                  self.router_kind, self.capacity_factor)
        flat = x.reshape(-1, h)
        token = torch.arange(b * s, device=x.device).repeat_interleave(self.top_k)
        keep = r.kept.reshape(-1)
        token, expert, gate = token[keep], r.experts.reshape(-1)[keep], r.gates.reshape(-1)[keep]
        order = torch.argsort(expert, stable=True)
        token, expert, gate = token[order], expert[order], gate[order]
        counts = torch.bincount(expert, minlength=self.num_experts)
        y = self.experts(flat[token], counts)
        out = torch.zeros_like(flat).index_add(0, token, (y * gate[:, None].to(y.dtype)).to(flat.dtype)).view(b, s, h)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training and not in_backward():  # counted once per micro-batch: not when recomputed
            routed = torch.bincount(r.experts.reshape(-1), minlength=self.num_experts)
            self.record(torch.cat([routed.double(), torch.tensor([(~r.kept).sum().item(), r.aux.sum().item(), b],
                                                                 dtype=torch.float64, device=x.device)]))
        if not (torch.is_grad_enabled() and out.requires_grad):
            return out
        return _AuxLoss.apply(out, r.aux.sum() * (self.aux_loss_coef / (self.aux_rows or b)))


def moe_block(cfg: ModelConfig, group: Any = None, ep_group: Any = None, dtype: torch.dtype | None = None) -> MoE:
    """The MoE block ``cfg`` puts in place of an MLP."""
    return MoE(cfg.hidden, cfg.experts, cfg.top_k, cfg.expert_ffn_hidden, cfg.shared_experts, cfg.router,
               cfg.capacity_factor, cfg.aux_loss_coef, group=group, ep_group=ep_group, dtype=dtype)


def moe_modules(module: nn.Module) -> list[tuple[str, MoE]]:
    """The MoE layers inside ``module`` with their names."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]
