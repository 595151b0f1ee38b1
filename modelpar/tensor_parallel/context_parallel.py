"""Context parallelism: causal attention over a sequence split across the cp ranks (docs/context_parallel.md).

Load balance (the "zig-zag" / head-tail split of Megatron-core and Llama 3): the sequence is cut
into 2·cp chunks and rank r holds chunks r and 2·cp−1−r, so under the causal mask every rank has
the same number of (query, key) pairs to attend. Rank 0 of cp = 2, s = 8: positions 0 1 6 7.

Attention over the whole sequence, two ways (``CP_COMMS``):

- ``ring`` (Liu et al. 2023, "Ring Attention"): the key/value blocks pass around the cp ring;
  each rank attends its queries to the block it holds while the next one is in flight
  (``isend``/``irecv``), and merges the partial results with the log-sum-exp rule (``merge``).
  The backward passes the blocks around again, each with the accumulating gradient of its keys
  and values, which ends back on the block's owner (``_RingAttention``). Nothing of size s² is
  kept: q, k, v, the output and the log-sum-exp, per rank 1/cp of the sequence.
- ``allgather`` (Llama 3, §3.3.2): key/value are all-gathered over cp before attention; the
  backward reduce-scatters their gradient. Simpler, and cheap with few key/value heads (GQA).

Key/value heads travel unrepeated (g of them); they are repeated for the query heads here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from modelpar._validate import check_choice, check_int
from modelpar.tensor_parallel._comm import all_gather, group_rank, group_size, reduce_scatter

__all__ = ["CP_COMMS", "ContextParallel", "block_attention", "check_context_split", "context_attention", "merge",
           "zigzag_index"]

CP_COMMS = ("ring", "allgather")
_SEQ = 2  # the sequence dimension of q, k, v: [b, heads, s, d]


def check_context_split(seq_len: int, cp: int) -> None:
    """ValueError unless ``seq_len`` splits into 2·cp equal chunks (the load-balanced split; no padding)."""
    check_int("cp", cp, minimum=1)
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"seq_len ({seq_len}) must be divisible by 2 * cp ({2 * cp}): context parallelism "
                         f"splits every sequence into 2·cp equal chunks (no padding)")


def zigzag_index(seq_len: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """Positions (int64) rank ``rank`` of ``cp`` holds of a ``seq_len`` sequence: chunks r and 2·cp−1−r."""
    check_context_split(seq_len, cp)
    check_int("rank", rank, minimum=0, maximum=cp - 1)
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([head, tail]) if cp > 1 else torch.arange(seq_len, device=device)


@dataclass(frozen=True)
class ContextParallel:
    """The cp group (None: one rank) and how attention communicates over it."""

    group: Any = None
    comm: str = "ring"

    def __post_init__(self) -> None:
        check_choice("cp_comm", self.comm, CP_COMMS)

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def positions(self, local_len: int, device: Any = None) -> torch.Tensor:
        """Positions of this rank's ``local_len`` tokens in the whole sequence."""
        return zigzag_index(local_len * self.size, self.size, self.rank, device)

    def all_positions(self, local_len: int, device: Any = None) -> torch.Tensor:
        """[cp, local_len]: the positions every rank holds, by cp rank."""
        return torch.stack([zigzag_index(local_len * self.size, self.size, r, device) for r in range(self.size)])


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_q: torch.Tensor, pos_k: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries at ``pos_q`` to one key/value block at ``pos_k`` (same heads):
    (output normalised within the block, log-sum-exp of the block's scores, −inf where a row sees none)."""
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(pos_q[:, None] < pos_k[None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return probs @ v, lse


def merge(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
          lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' partial attention as one: weights exp(lse_i − lse), lse = log(e^lse1 + e^lse2)."""
    lse = torch.logaddexp(lse1, lse2)
    safe = _finite(lse).unsqueeze(-1)
    return torch.exp(lse1.unsqueeze(-1) - safe) * out1 + torch.exp(lse2.unsqueeze(-1) - safe) * out2, lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with −inf (rows that see no key) replaced by 0, so exp(−inf − it) is 0, not nan."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _repeat(kv: torch.Tensor, rep: int) -> torch.Tensor:
    """[b, g, n, d] → [b, g·rep, n, d]: each key/value head for the rep query heads that share it."""
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _unrepeat(grad: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of ``_repeat``: sum over the query heads sharing a key/value head."""
    return grad if rep == 1 else grad.unflatten(1, (-1, rep)).sum(2)


class _Ring:
    """Point-to-point along the cp ring: send to rank r+1, receive from rank r−1 (asynchronous)."""

    def __init__(self, group: Any) -> None:
        self.group, self.size, self.rank = group, group_size(group), group_rank(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, x: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
        """Start sending ``x`` on and receiving the previous rank's; (works, the receive buffer)."""
        out = torch.empty_like(x)
        works = [dist.isend(x, self.next, group=self.group), dist.irecv(out, self.prev, group=self.group)]
        return works, out


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


class _RingAttention(Function):
    """Ring attention forward and backward over the cp group (autograd sees one op)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                group: Any, scale: float) -> torch.Tensor:
        ring, rep = _Ring(group), q.shape[1] // k.shape[1]
        kv = torch.stack((k, v)).contiguous()
        out = lse = None
        for i in range(ring.size):
            works, incoming = ring.shift(kv) if i < ring.size - 1 else ([], kv)
            src = (ring.rank - i) % ring.size
            o, m = block_attention(q, _repeat(kv[0], rep), _repeat(kv[1], rep), positions[ring.rank],
                                   positions[src], scale)
            out, lse = (o, m) if out is None or lse is None else merge(out, lse, o, m)
            _wait(works)
            kv = incoming
        assert out is not None and lse is not None
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, positions = ctx.saved_tensors
        ring, scale, rep = _Ring(ctx.group), ctx.scale, q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
        dq = torch.zeros_like(q)
        kv = torch.stack((k, v)).contiguous()
        dkv = torch.zeros_like(kv)  # the gradient of the block held, accumulated by the ranks it visited
        grad_works: list[Any] = []
        for i in range(ring.size):
            works, incoming = ring.shift(kv) if i < ring.size - 1 else ([], kv)
            src = (ring.rank - i) % ring.size
            kb, vb = _repeat(kv[0], rep), _repeat(kv[1], rep)
            scores = (q @ kb.transpose(-2, -1)) * scale
            scores = scores.masked_fill(positions[ring.rank][:, None] < positions[src][None, :], float("-inf"))
            probs = torch.exp(scores - lse.unsqueeze(-1))  # the final softmax's entries of this block
            dv = probs.transpose(-2, -1) @ dout
            ds = probs * (dout @ vb.transpose(-2, -1) - delta)
            dq += (ds @ kb) * scale
            dk = (ds.transpose(-2, -1) @ q) * scale
            mine = torch.stack((_unrepeat(dk, rep), _unrepeat(dv, rep)))
            _wait(grad_works)  # the accumulated gradient of this block, from the previous rank
            dkv = dkv + mine
            if ring.size > 1:  # on to the next rank; after cp hops each block's gradient is home
                grad_works, dkv = ring.shift(dkv.contiguous())
            _wait(works)
            kv = incoming
        _wait(grad_works)
        return dq, dkv[0], dkv[1], None, None, None


class _GatherSequence(Function):
    """All-gather along the sequence over cp; backward: reduce-scatter (each rank's keys serve every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return all_gather(x, _SEQ, group, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return reduce_scatter(grad.contiguous(), _SEQ, ctx.group, "backward"), None


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """softmax(q·kᵀ/√d, causal)·v over the whole sequence for this rank's queries.

    q [b, a, n, d], k and v [b, g, n, d] (g divides a): this rank's n = s/cp tokens in zig-zag order.
    """
    n, scale = q.shape[_SEQ], q.shape[-1] ** -0.5
    positions = cp.all_positions(n, q.device)
    if cp.comm == "ring":
        return _RingAttention.apply(q, k, v, positions, cp.group, scale)
    rep = q.shape[1] // k.shape[1]
    k_all, v_all = (_repeat(_GatherSequence.apply(u.contiguous(), cp.group), rep) for u in (k, v))
    allowed = positions[cp.rank][:, None] >= positions.flatten()[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=allowed)
