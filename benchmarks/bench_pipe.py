"""Pipe vs sequential on this CPU: HW5 Problem 2.3 scaled down (reference §3.4).

Two stages of four MLP blocks each, the batch split into 8 micro-batches, one worker thread per
stage with one PyTorch intra-op thread each (the two stages get a core each instead of fighting
over both). Two baselines on one thread: the stages one after the other on the whole batch (what
HW5 compares with), and on the same 8 micro-batches in a loop — the gap between those two is the
price of smaller matrices (§2.4), the gap between the second and Pipe is what pipelining buys.
Ratios come from one run, seq/pipe alternating so both see the same machine load; each figure is
the median of ``--repeats`` runs. The cores are shared, so the run also measures the machine's
parallel capacity right then: two threads doing a stage's matmuls vs one (2.0x = two free cores;
1.0x = someone else holds a core, and no pipeline can speed up).

    python benchmarks/bench_pipe.py [--hidden 512] [--batch 2048] [--microbatches 8] [--repeats 5]

Reference: forward 1.37-1.52x (two runs on the reference machine); bound 2·M/(M + K − 1) = 1.78x.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import threading
import time

import torch

from modelpar.bench import mlp_stage
from modelpar.pipeline import Pipe


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def parallel_capacity(stage, x, calls: int = 4) -> float:
    """Throughput of two threads running ``stage`` (one intra-op thread each) over one thread."""

    def work():
        torch.set_num_threads(1)
        with torch.no_grad():
            for _ in range(calls):
                stage(x)

    def run(n: int) -> float:
        threads = [threading.Thread(target=work) for _ in range(n)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    return 2 * run(1) / run(2)


def forward_backward(model, x):
    def step():
        model(x).sum().backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4, help="MLP blocks per stage")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    stages = [mlp_stage(args.hidden, args.blocks) for _ in range(2)]
    sequential = torch.nn.Sequential(*copy.deepcopy(stages))
    pipe = Pipe(stages, split_size=args.batch // args.microbatches, num_threads=1)
    x = torch.randn(args.batch, args.hidden)
    m, k = args.microbatches, 2

    torch.set_num_threads(1)  # the baseline: one core, like one device
    def micro(v):
        return torch.cat([sequential(c) for c in torch.split(v, args.batch // m)])

    cases = {
        "forward": (lambda: sequential(x), lambda: micro(x), lambda: pipe(x)),
        "forward (no_grad)": tuple(torch.no_grad()(f) for f in (lambda: sequential(x), lambda: micro(x), lambda: pipe(x))),
        "forward + backward": (forward_backward(sequential, x), forward_backward(micro, x), forward_backward(pipe, x)),
    }
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), sequential(x))
    capacity = [parallel_capacity(stages[0], x[: args.batch // m])]
    print(f"HW5 2.3 scaled down: K = {k} stages x {args.blocks} MLP blocks ({args.hidden} -> {4 * args.hidden} "
          f"-> {args.hidden}), batch {args.batch} rows in M = {m} micro-batches")
    print(f"{os.cpu_count()} CPU cores; 1 intra-op thread per stage; median of {args.repeats} runs (ms)\n")
    print(f"{'pass':<19} {'whole batch':>11} {'micro-batched':>13} {'Pipe':>7} {'speed-up':>9} "
          f"{'vs micro':>9} {'bound':>6}")
    for name, fns in cases.items():
        for fn in fns:
            fn()  # warm-up
        samples: list[list[float]] = [[], [], []]
        for _ in range(args.repeats):
            for fn, out in zip(fns, samples):
                out.append(timed(fn))
        whole, mic, p = (statistics.median(v) for v in samples)
        print(f"{name:<19} {whole * 1e3:>11.1f} {mic * 1e3:>13.1f} {p * 1e3:>7.1f} {whole / p:>8.2f}x "
              f"{mic / p:>8.2f}x {2 * m / (m + k - 1):>5.2f}x")
        capacity.append(parallel_capacity(stages[0], x[: args.batch // m]))
    print("reference (HW5 2.3 scaled down on the lecture's CPU): forward 1.37-1.52x, forward + backward ~1x")
    print(f"\nparallel capacity during the run (2 threads vs 1 on a stage's forward): "
          f"{', '.join(f'{c:.2f}x' for c in capacity)}")
    torch.set_num_threads(2)
    with torch.no_grad():
        two = statistics.median(timed(lambda: sequential(x)) for _ in range(args.repeats))
    print(f"\ncontext: sequential forward with 2 intra-op threads (both cores on each matmul): {two * 1e3:.1f} ms")
    pipe.close()


if __name__ == "__main__":
    main()
