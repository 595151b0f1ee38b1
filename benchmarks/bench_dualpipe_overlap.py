"""DualPipe-V with its F&B pairs overlapped against the same order back to back: 2 gloo ranks, ``--ep 2``.

The same Llama MoE (every layer, dropless) trained on 2 local CPU ranks with d = ep = 2 and p = 1:
each rank runs the one-rank V (two chunks) of "dualpipe-v" (pairs overlapped) and of
"dualpipe-v-serial" (the same actions, each pair back to back), the experts' all-to-alls inside
the pairs. The two runs alternate ``--rounds`` times in one cluster (which goes first alternates
too); per run the median step time of the slowest rank; printed: each round's ratio overlapped /
serial and their median. On a CPU a
pair's halves run one after the other (``pipeline.pair_streams``): the ratio shows that the pair's
bookkeeping costs nothing (it should be 1 within the noise); what overlap gains needs a GPU
(benchmarks/gpu_dualpipe_overlap.py). Losses are checked equal (the same arithmetic).

    python benchmarks/bench_dualpipe_overlap.py [--hidden 64] [--seq-len 64] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import Any

import torch

from modelpar.distributed import LocalCluster
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, train


def _rank(cfg: TrainConfig) -> dict[str, Any]:
    torch.set_num_threads(1)
    r = train(cfg)
    return {"step_s": statistics.median(r.step_times[1:] or r.step_times), "losses": r.losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = ModelConfig(arch="llama", hidden=args.hidden, heads=4, layers=args.layers, seq_len=args.seq_len,
                        experts=args.experts, top_k=2)
    base = TrainConfig(model=model, tp=1, pp=1, dp=2, ep=2, schedule="dualpipe-v", chunks=2,
                       microbatches=args.microbatches, steps=args.steps, batch_size=2 * args.microbatches * 2,
                       warmup=1, eval_every=0, eval_batches=1)
    ratios = []
    with LocalCluster(2, timeout=600) as cluster:
        for i in range(args.rounds):
            serial = replace(base, schedule="dualpipe-v-serial")
            if i % 2:  # alternate which runs first: the machine's load drifts
                off, on = cluster.run(_rank, serial), cluster.run(_rank, base)
            else:
                on, off = cluster.run(_rank, base), cluster.run(_rank, serial)
            assert on[0]["losses"] == off[0]["losses"], "overlapped and serial pairs must compute the same"
            t_on, t_off = (max(r["step_s"] for r in rs) for rs in (on, off))
            ratios.append(t_on / t_off)
            print(f"  round {i}: overlapped {1e3 * t_on:.1f} ms, serial {1e3 * t_off:.1f} ms, ratio {ratios[-1]:.3f}",
                  flush=True)
    print(f"Llama MoE h={args.hidden} L={args.layers} s={args.seq_len} E={args.experts} k=2, dropless, fp32, "
          f"p=1 d=ep=2, dualpipe-v M={args.microbatches} on 2 gloo CPU ranks, {args.steps} steps x {args.rounds} "
          f"rounds: step overlapped / serial = {statistics.median(ratios):.3f} (median; per round "
          f"{', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
