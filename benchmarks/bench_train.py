"""Throughput of `modelpar train` for the 8 splits (t, p, d) ∈ {1, 2}³ on this machine (§6).

One run: for each split, t·p·d fresh local processes (gloo) train the same small GPT for a few
steps; tokens/s is the median step after the first. Beside it: the pipeline bubble measured
from the last steps' timelines, the simulator's bubble with the measured action costs, the
ideal one (equal stages, F = 1, B = 2), and — when ``modelpar.costmodel`` is present — the cost
model's predicted throughput ratio for the same layouts, calibrated so that (1, 1, 1) matches
the measured step time. The cost model assumes one device per rank; on a machine with fewer
cores than ranks the ranks share the cores, which the ``cores`` column makes visible.

Then the data-parallel reduction overlapped with the backward, on (1, 2, 2) and (2, 2, 2): the
step time with the overlap (the default), without it (``--no-overlap-grad-reduce``) and with ZeRO-1,
and the exposed reduction — how long the slowest device's gradient reduction runs past its last
backward, read from the measured timeline. Each split's timelines are drawn one above the other,
the dp collectives on a row of their own (OUT/overlap_<t><p><d>.png and a Chrome trace .json).

Then the ZeRO stages on (1, 1, 2) and (1, 2, 2): step time relative to ZeRO-0, the time the
compute waited for ZeRO-3's parameter gathers (exposed gather), gathers per step, and each rank's
peak bytes of parameters, gradients and AdamW state (kept + the full-size buckets held at once).

    python benchmarks/bench_train.py [--steps 15] [--hidden 128] [--layers 4] [--schedule 1f1b]
    python benchmarks/bench_train.py --overlap-only [--bucket-mb 0.5] [--out bench-train]
    python benchmarks/bench_train.py --zero-only [--steps 4] [--bucket-mb 0.5]
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace
from pathlib import Path

from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, TrainResult
from modelpar.training.start import run_local

SPLITS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]


def cost_model_ratios(cfg: TrainConfig, measured_step_111: float) -> dict[tuple[int, int, int], float] | None:
    """Predicted tokens/s of each split relative to (1, 1, 1), one "GPU" per rank, or None without the cost model."""
    try:
        from modelpar.costmodel import ClusterSpec, GPUSpec, ModelSpec, ParallelConfig, estimate
    except ImportError:
        return None
    m = cfg.model
    spec = ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, seq=m.seq_len, vocab=m.vocab_size,
                     tied_embeddings=m.tie_embeddings, name="bench")

    def step(split: tuple[int, int, int], peak: float) -> float:
        t, p, d = split
        gpu = GPUSpec("cpu-rank", peak_tflops=peak, memory_gb=1e3, hbm_tb_s=0.02, matmul_efficiency=1.0)
        cluster = ClusterSpec(gpu, t * p * d, gpus_per_node=8, intra_node_gbps=2.0, inter_node_gbps=2.0)
        pc = ParallelConfig(t, p, d, micro_batch=cfg.batch_size // (d * cfg.microbatches), recompute="none")
        return estimate(spec, cluster, pc, cfg.batch_size).step_time_s

    peak = 1.0  # TFLOP/s, then scaled so that (1, 1, 1) takes the measured time
    peak *= step((1, 1, 1), peak) / measured_step_111
    base = step((1, 1, 1), peak)
    return {s: base / step(s, peak) for s in SPLITS}


OVERLAP_SPLITS = [(1, 2, 2), (2, 2, 2)]
OVERLAP_RUNS = [("overlap", {}), ("no overlap", {"overlap_grad_reduce": False}), ("overlap, ZeRO-1", {"zero": 1})]


def overlap_table(base: TrainConfig, bucket_mb: float, out: Path) -> None:
    """Step time and exposed reduction with and without the overlap; the measured timelines drawn."""
    from modelpar.simulate.plot import plot_timelines
    from modelpar.simulate.trace import write_trace

    out.mkdir(parents=True, exist_ok=True)
    print(f"\nData-parallel reduction overlapped with the backward (buckets of {bucket_mb:g} MiB, float32, gloo)\n")
    print(f"{'(t, p, d)':>10} {'run':>16} {'step ms':>8} {'vs no overlap':>14} {'exposed reduction ms':>21} "
          f"{'dp MiB/step':>12}")
    for t, p, d in OVERLAP_SPLITS:
        results = [(name, run_local(replace(base, tp=t, pp=p, dp=d, bucket_mb=bucket_mb, **changes)))
                   for name, changes in OVERLAP_RUNS]
        after = statistics.median(results[1][1].step_times[1:])
        for name, res in results:
            step = statistics.median(res.step_times[1:])
            exposed = "-" if res.exposed_reduction is None else f"{1e3 * res.exposed_reduction:.2f}"
            print(f"{(t, p, d)!s:>10} {name:>16} {1e3 * step:>8.1f} {step / after:>14.2f} {exposed:>21} "
                  f"{res.dp_bytes_sent / 2**20:>12.2f}")
        timelines = [res.timeline for _, res in results]
        for (name, _), tl in zip(results, timelines):
            tl.schedule = replace(tl.schedule, name=f"{name}: {tl.schedule.name}")
        png = plot_timelines(timelines, out / f"overlap_{t}{p}{d}.png", f"(t, p, d) = ({t}, {p}, {d}), last step")
        write_trace(timelines, out / f"overlap_{t}{p}{d}.json")
        print(f"{'':>10} {'timelines':>16} {png} (+ .json)")


ZERO_SPLITS = [(1, 1, 2), (1, 2, 2)]
ZERO_RUNS = [("ZeRO-0", {"zero": 0}), ("ZeRO-1", {"zero": 1}), ("ZeRO-2", {"zero": 2}), ("ZeRO-3", {"zero": 3}),
             ("ZeRO-3 keep", {"zero": 3, "reshard_after_forward": False})]


def _step(res: TrainResult) -> float:
    return statistics.median(res.step_times[1:] or res.step_times)


def zero_table(base: TrainConfig, bucket_mb: float) -> None:
    """Step time, exposed gather time and peak bytes per rank of each ZeRO stage at d = 2."""
    print(f"\nZeRO stages at d = 2 (buckets of {bucket_mb:g} MiB, float32, gloo; 'keep': --no-reshard-after-forward)\n")
    print(f"{'(t, p, d)':>10} {'run':>12} {'step ms':>8} {'vs ZeRO-0':>10} {'exposed gather ms':>18} {'gathers':>8} "
          f"{'peak MiB/rank':>14} {'params/grads/AdamW MiB':>23} {'dp MiB/step':>12}")
    for t, p, d in ZERO_SPLITS:
        results = [(name, run_local(replace(base, tp=t, pp=p, dp=d, bucket_mb=bucket_mb, **changes)))
                   for name, changes in ZERO_RUNS]
        zero0 = _step(results[0][1])
        for name, res in results:
            exposed = "-" if res.exposed_gather is None else f"{1e3 * res.exposed_gather:.2f}"
            kept = "/".join(f"{b / 2**20:.2f}" for b in (res.parameter_bytes, res.gradient_bytes,
                                                         res.optimizer_state_bytes))
            print(f"{(t, p, d)!s:>10} {name:>12} {1e3 * _step(res):>8.1f} {_step(res) / zero0:>10.2f} {exposed:>18} "
                  f"{res.gathers_per_step if res.gathers_per_step else '-':>8} {res.peak_state_bytes / 2**20:>14.2f} "
                  f"{kept:>23} {res.dp_bytes_sent / 2**20:>12.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--overlap-only", action="store_true", help="only the data-parallel overlap table")
    ap.add_argument("--zero-only", action="store_true", help="only the ZeRO stages table")
    ap.add_argument("--bucket-mb", type=float, default=0.5, help="gradient bucket size of the overlap runs")
    ap.add_argument("--out", default="bench-train", help="folder for the overlap timelines")
    args = ap.parse_args()
    base = TrainConfig(model=ModelConfig(hidden=args.hidden, layers=args.layers), steps=args.steps, schedule=args.schedule,
                       chunks=2 if args.schedule == "interleaved" else 1, eval_every=0, eval_batches=1, warmup=5)
    if args.overlap_only:
        overlap_table(base, args.bucket_mb, Path(args.out))
        return
    if args.zero_only:
        zero_table(base, args.bucket_mb)
        return
    cores = os.cpu_count() or 1
    rows = []
    for t, p, d in SPLITS:
        res = run_local(replace(base, tp=t, pp=p, dp=d))
        rows.append(((t, p, d), res))
        print(f"  ran (t, p, d) = ({t}, {p}, {d}): {res.tokens_per_s:,.0f} tokens/s", flush=True)
    ref = rows[0][1]
    predicted = cost_model_ratios(base, base.tokens_per_step / ref.tokens_per_s)
    m = base.model
    print(f"\nGPT h={m.hidden} L={m.layers} s={m.seq_len} V={m.vocab_size}, batch {base.batch_size}, "
          f"m={base.microbatches}, {base.schedule}, {args.steps} steps, {cores} cores, float32, gloo\n")
    print(f"{'(t, p, d)':>10} {'procs':>5} {'tokens/s':>9} {'ratio':>6} {'cost model':>10} "
          f"{'bubble meas.':>12} {'sim. (meas. costs)':>18} {'ideal':>6}")
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    for split, res in rows:
        t, p, d = split
        pred = f"{predicted[split]:.2f}" if predicted else "-"
        ratio = res.tokens_per_s / ref.tokens_per_s
        print(f"{split!s:>10} {t * p * d:>5} {res.tokens_per_s:>9,.0f} {ratio:>6.2f} {pred:>10} "
              f"{pct(res.bubble_measured) if p > 1 else '-':>12} {pct(res.bubble_simulated) if p > 1 else '-':>18} "
              f"{pct(res.bubble_ideal):>6}")
    overlap_table(base, args.bucket_mb, Path(args.out))
    zero_table(base, args.bucket_mb)


if __name__ == "__main__":
    main()
