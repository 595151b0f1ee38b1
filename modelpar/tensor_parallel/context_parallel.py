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
  backward reduce-scatters their gradient. Simpler, and cheap with few key/value heads (GQA); it
  keeps the gathered keys and values (s long, g heads) for the backward.

Both attend chunk pair by chunk pair (``attend_chunks``): a query chunk sees earlier chunks whole,
its own causally and later ones not at all, which are skipped. Key/value heads travel unrepeated
(g of them); they are repeated for the query heads here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from modelpar._validate import check_choice, check_int
from modelpar.costmodel.specs import CP_COMMS, check_context_split
from modelpar.tensor_parallel._comm import all_gather, group_rank, group_size, reduce_scatter

__all__ = ["CP_COMMS", "ContextParallel", "attend_chunks", "block_attention", "check_context_split", "chunks_of",
           "context_attention", "merge", "zigzag_index"]

_SEQ = 2  # the sequence dimension of q, k, v: [b, heads, s, d]


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
    """The cp group (None: one rank) and how attention communicates over it; the group's size and this
    rank's place in it are read once, here, not at every attention call."""

    group: Any = None
    comm: str = "ring"
    size: int = field(init=False, compare=False)
    rank: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        check_choice("cp_comm", self.comm, CP_COMMS)
        object.__setattr__(self, "size", group_size(self.group))
        object.__setattr__(self, "rank", group_rank(self.group))

    def positions(self, local_len: int, device: Any = None) -> torch.Tensor:
        """Positions of this rank's ``local_len`` tokens in the whole sequence."""
        return zigzag_index(local_len * self.size, self.size, self.rank, device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``context_attention`` over this group. Under ``--compile`` it runs eagerly (``training.compile`` marks it):
        compiled, the ring's sends break the block's graph and its per-step chunk ids recompile the attention."""
        return context_attention(q, k, v, self)


def chunks_of(rank: int, cp: int) -> tuple[int, ...]:
    """The chunks (of 2·cp; of 1 at cp = 1) cp rank ``rank`` holds, in its order: (r, 2·cp − 1 − r)."""
    return (0,) if cp == 1 else (rank, 2 * cp - 1 - rank)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q to one key/value block (same heads), keys masked where ``allowed`` [nq, nk] is False:
    (output normalised within the block, log-sum-exp of its scores; −inf for a row that sees no key)."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
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


def _pairs(q_chunks: tuple[int, ...], k_chunks: tuple[int, ...], c: int) -> list[tuple[slice, slice, bool]]:
    """(query rows, key rows, diagonal) of every chunk pair with something to attend: a query chunk sees
    the earlier chunks whole, its own causally, the later ones not at all (skipped: no work)."""
    return [(slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), i == j)
            for a, i in enumerate(q_chunks) for b, j in enumerate(k_chunks) if i >= j]


def attend_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_chunks: tuple[int, ...],
                  k_chunks: tuple[int, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q (chunks ``q_chunks``) to k, v (chunks ``k_chunks``; heads repeated already):
    (output, log-sum-exp), merged over the visible chunk pairs; rows that see nothing: 0 and −inf."""
    c = q.shape[_SEQ] // len(q_chunks)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    tril = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    for rows, cols, diagonal in _pairs(q_chunks, k_chunks, c):
        o, m = block_attention(q[:, :, rows], k[:, :, cols], v[:, :, cols], scale, tril if diagonal else None)
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, m)
    return out, lse


def _chunk_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
                 lse: torch.Tensor, q_chunks: tuple[int, ...], k_chunks: tuple[int, ...],
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q, k, v; k and v in repeated heads) of attention to one block, given the final softmax's
    ``lse`` and delta = rowsum(dO ∘ O) (FlashAttention-2's backward, Dao 2023, Alg. 2)."""
    c = q.shape[_SEQ] // len(q_chunks)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    tril = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    for rows, cols, diagonal in _pairs(q_chunks, k_chunks, c):
        qa, kb, vb, do = q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows]
        scores = (qa @ kb.transpose(-2, -1)) * scale
        if diagonal:
            scores = scores.masked_fill(~tril, float("-inf"))
        probs = torch.exp(scores - lse[:, :, rows].unsqueeze(-1))  # this block's entries of the final softmax
        dv[:, :, cols] += probs.transpose(-2, -1) @ do
        ds = probs * (do @ vb.transpose(-2, -1) - delta[:, :, rows])
        dq[:, :, rows] += (ds @ kb) * scale
        dk[:, :, cols] += (ds.transpose(-2, -1) @ qa) * scale
    return dq, dk, dv


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
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float) -> torch.Tensor:
        ring, rep = _Ring(group), q.shape[1] // k.shape[1]
        mine = chunks_of(ring.rank, ring.size)
        kv = torch.stack((k, v)).contiguous()
        out = lse = None
        for i in range(ring.size):
            works, incoming = ring.shift(kv) if i < ring.size - 1 else ([], kv)
            src = chunks_of((ring.rank - i) % ring.size, ring.size)
            o, m = attend_chunks(q, _repeat(kv[0], rep), _repeat(kv[1], rep), mine, src, scale)
            out, lse = (o, m) if out is None or lse is None else merge(out, lse, o, m)
            _wait(works)
            kv = incoming
        assert out is not None and lse is not None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, rep = _Ring(ctx.group), ctx.scale, q.shape[1] // k.shape[1]
        mine = chunks_of(ring.rank, ring.size)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
        dq = torch.zeros_like(q)
        kv = torch.stack((k, v)).contiguous()
        dkv = torch.zeros_like(kv)  # the gradient of the block held, accumulated by the ranks it visited
        grad_works: list[Any] = []
        for i in range(ring.size):
            works, incoming = ring.shift(kv) if i < ring.size - 1 else ([], kv)
            src = chunks_of((ring.rank - i) % ring.size, ring.size)
            dqi, dk, dv = _chunk_grads(q, _repeat(kv[0], rep), _repeat(kv[1], rep), dout, delta, lse, mine, src,
                                       scale)
            dq += dqi
            block = torch.stack((_unrepeat(dk, rep), _unrepeat(dv, rep)))
            _wait(grad_works)  # the accumulated gradient of this block, from the previous rank
            dkv = dkv + block
            if ring.size > 1:  # on to the next rank; after cp hops each block's gradient is home
                grad_works, dkv = ring.shift(dkv.contiguous())
            _wait(works)
            kv = incoming
        _wait(grad_works)
        return dq, dkv[0], dkv[1], None, None


class _ChunkAttention(Function):
    """Causal attention of q's chunks to k, v's (every rank's, gathered) keeping no s² tensor for backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_chunks: tuple[int, ...],
                k_chunks: tuple[int, ...], scale: float) -> torch.Tensor:
        rep = q.shape[1] // k.shape[1]
        out, lse = attend_chunks(q, _repeat(k, rep), _repeat(v, rep), q_chunks, k_chunks, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.scale = (q_chunks, k_chunks), scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        rep = q.shape[1] // k.shape[1]
        dout = dout.contiguous()
        delta = (dout * out).sum(-1, keepdim=True)
        q_chunks, k_chunks = ctx.chunks
        dq, dk, dv = _chunk_grads(q, _repeat(k, rep), _repeat(v, rep), dout, delta, lse, q_chunks, k_chunks, ctx.scale)
        return dq, _unrepeat(dk, rep), _unrepeat(dv, rep), None, None, None


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
    scale = q.shape[-1] ** -0.5
    if cp.comm == "ring":
        return _RingAttention.apply(q, k, v, cp.group, scale)
    k_all, v_all = (_GatherSequence.apply(u.contiguous(), cp.group) for u in (k, v))
    every = tuple(c for r in range(cp.size) for c in chunks_of(r, cp.size))  # the gathered chunks, rank by rank
    return _ChunkAttention.apply(q, k_all, v_all, chunks_of(cp.rank, cp.size), every, scale)
