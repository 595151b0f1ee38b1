"""Expert parallelism on 2 gloo ranks: ep = 2 against ep = 1 (d = 2 both), step time, all-to-all time and bytes.

The same Llama MoE (every layer, dropless) trained on 2 local ranks with the experts replicated
(ep = 1) and split (ep = 2). Per run: the median step time (slowest rank). For ep = 2, per rank and
step (the difference of a run of ``--steps`` and one of 1 step, over the steps between): the
seconds spent in the expert all-to-alls (``moe_comm._exchange``, forward and backward, timed here;
the count exchange excluded) and the bytes the rank sent to the other rank in them, beside
``costmodel.moe.all_to_all_bytes`` (uniform routing) × ``ALL_TO_ALLS_PER_LAYER`` × layers ×
micro-batches: they differ by how far this rank's routing is from uniform (the share of its
assignments bound for the other rank, and the rows the other rank's tokens send back through it).

    python benchmarks/bench_moe.py [--hidden 128] [--seq-len 128] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from modelpar.costmodel.moe import ALL_TO_ALLS_PER_LAYER, all_to_all_bytes
from modelpar.distributed import LocalCluster
from modelpar.model import ModelConfig, moe_comm
from modelpar.training import TrainConfig, train


def _rank(cfg: TrainConfig) -> dict[str, Any]:
    """Train on this rank with the expert all-to-alls timed and their remote rows counted."""
    torch.set_num_threads(1)
    me = dist.get_rank()
    seconds, sent, calls = [0.0], [0.0], [0]
    exchange = moe_comm._exchange

    def timed(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        remote = sum(n for j, n in enumerate(in_splits) if j != dist.get_rank(group))
        sent[0] += remote * (x[0].numel() * x.element_size() if len(x) else 0)
        calls[0] += 1
        t0 = time.perf_counter()
        out = exchange(x, out_splits, in_splits, group)
        seconds[0] += time.perf_counter() - t0
        return out

    moe_comm._exchange = timed
    try:
        r = train(cfg)
    finally:
        moe_comm._exchange = exchange
    return {"rank": me, "step_s": statistics.median(r.step_times[1:] or r.step_times), "a2a_s": seconds[0],
            "sent": sent[0], "calls": calls[0], "loss": r.losses[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    model = ModelConfig(arch="llama", hidden=args.hidden, heads=4, layers=args.layers, seq_len=args.seq_len,
                        experts=args.experts, top_k=2)
    base = TrainConfig(model=model, tp=1, pp=1, dp=2, ep=1, steps=args.steps, batch_size=8, microbatches=2,
                       warmup=1, eval_every=0, eval_batches=1)
    rows = {}
    with LocalCluster(2, timeout=600) as cluster:
        for ep in (1, 2):
            rows[ep] = cluster.run(_rank, replace(base, ep=ep))
            print(f"  ran ep={ep}", flush=True)
        one = cluster.run(_rank, replace(base, ep=2, steps=1))  # the all-to-alls outside the steps (the
    n = args.steps - 1  # activation measurement before training, the final evaluation) cancel in the difference
    for r, r1 in zip(rows[2], one):
        r.update({k: (r[k] - r1[k]) / n for k in ("a2a_s", "sent", "calls")})
    tokens = base.batch_size // (base.dp * base.microbatches) * args.seq_len  # per rank and micro-batch
    per_step = ALL_TO_ALLS_PER_LAYER * args.layers * base.microbatches
    uniform = per_step * all_to_all_bytes(tokens, args.hidden, 2, 2, 4)
    print(f"Llama MoE h={args.hidden} L={args.layers} s={args.seq_len} E={args.experts} k=2, dropless, fp32, d=2, "
          f"{base.microbatches} micro-batches of {tokens} tokens per rank, {args.steps} steps, 2 gloo ranks "
          f"(timings under load: a shared 2-core CPU, noisy)")
    for ep, per_rank in rows.items():
        step = max(r["step_s"] for r in per_rank)
        print(f"ep={ep}: step {1e3 * step:.0f} ms (slowest rank), loss {per_rank[0]['loss']:.4f}")
    for r in rows[2]:
        print(f"  ep=2 rank {r['rank']}: all-to-all {1e3 * r['a2a_s']:.1f} ms/step in {r['calls']:.0f} calls; sent "
              f"{r['sent']:,.0f} B/step; costmodel.moe (uniform routing) {uniform:,.0f} B/step "
              f"({r['sent'] / uniform - 1:+.1%})")


if __name__ == "__main__":
    main()
