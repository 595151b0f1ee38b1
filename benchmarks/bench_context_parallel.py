"""Context parallelism at a long sequence on 2 ranks: activation bytes per rank, step time, exposed communication.

Three runs of the same GPT on 2 local gloo ranks, each rank holding the same sequences per
micro-batch: cp = 1 (d = 2, twice the global batch), cp = 2 with ``--cp-comm ring`` and with
``allgather``. Per rank it reports the activation bytes autograd keeps at the rank's peak
(``TrainResult.activation_bytes``: saved bytes per micro-batch, measured from the tensors, × the
most micro-batches held), the median step time, and the exposed context-parallel communication:
the seconds per step a rank waited for a key/value block (or its gradient) that had not arrived
when its compute was done (the ring's waits, timed here around ``context_parallel._wait``;
all-gather: the collective's whole time, as nothing overlaps it).

    python benchmarks/bench_context_parallel.py [--seq-len 2048] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from modelpar.distributed import LocalCluster
from modelpar.model import ModelConfig
from modelpar.tensor_parallel import context_parallel
from modelpar.training import TrainConfig, train


def _rank(cfg: TrainConfig) -> dict[str, Any]:
    """Train on this rank with the cp waits (ring) or gathers (allgather) timed; this rank's figures."""
    torch.set_num_threads(1)
    waited = [0.0]
    wait, gather = context_parallel._wait, context_parallel.all_gather

    def timed_wait(works: list[Any]) -> None:
        t0 = time.perf_counter()
        wait(works)
        waited[0] += time.perf_counter() - t0

    def timed_gather(*args: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = gather(*args)
        waited[0] += time.perf_counter() - t0
        return out

    context_parallel._wait, context_parallel.all_gather = timed_wait, timed_gather  # type: ignore[assignment]
    try:
        r = train(cfg)
    finally:
        context_parallel._wait, context_parallel.all_gather = wait, gather  # type: ignore[assignment]
    return {"activation_bytes": r.activation_bytes, "step_s": statistics.median(r.step_times[1:]),
            "exposed_s": waited[0] / cfg.steps, "loss": r.losses[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    model = ModelConfig(hidden=args.hidden, heads=4, layers=args.layers, seq_len=args.seq_len)
    base = TrainConfig(model=model, tp=1, pp=1, dp=1, cp=2, steps=args.steps, batch_size=2, microbatches=1,
                       warmup=1, eval_every=0, eval_batches=1)
    runs = {"cp=1 (d=2)": replace(base, cp=1, dp=2, batch_size=4),
            "cp=2 ring": base, "cp=2 allgather": replace(base, cp_comm="allgather")}
    rows = {}
    with LocalCluster(2, timeout=600) as cluster:
        for name, cfg in runs.items():
            rows[name] = cluster.run(_rank, cfg)
            print(f"  ran {name}", flush=True)
    ref = max(r["activation_bytes"] for r in rows["cp=1 (d=2)"])
    print(f"GPT h={args.hidden} L={args.layers} s={args.seq_len}, 1 sequence per rank per micro-batch, fp32, "
          f"2 gloo ranks, {args.steps} steps (timings: a shared CPU, noisy)")
    print(f"{'run':<16}{'activations/rank':>18}{'vs cp=1':>9}{'step':>10}{'exposed cp comm':>17}")
    for name, per_rank in rows.items():
        act = max(r["activation_bytes"] for r in per_rank)
        step = max(r["step_s"] for r in per_rank)
        exposed = max(r["exposed_s"] for r in per_rank)
        print(f"{name:<16}{act / 2**20:>14.2f} MiB{act / ref:>9.3f}{1e3 * step:>8.0f} ms"
              f"{'-' if name.startswith('cp=1') else f'{1e3 * exposed:.0f} ms':>17}")


if __name__ == "__main__":
    main()
