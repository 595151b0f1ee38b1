"""One GPU: DualPipe-V's overlapped F&B pairs on two CUDA streams against the same pairs back to back.

One process, one rank (no process group): the one-rank V of "dualpipe-v" (two chunks, stage 0 and
stage 1 on the same GPU) and of "dualpipe-v-serial" (the same actions, each pair back to back),
run by ``PipelineRunner`` with ``group=None``. One GPU has no pipeline peer and no expert peer, so
each stage carries its own stand-in for communication: a round trip of its activation (and, in the
backward, of its gradient) through pinned host memory, on the copy engines as an all-to-all's or
a pipeline message's bytes would go over the links, while the SMs are free for the other half of
the pair. What it measures: how much of that traffic a pair hides behind the other half's compute
(``pipeline.pair_streams``: the pair's forward on the stream its partner backward's graph is not
on), i.e. the runtime side of ``schedules.overlap.pair_time``; and that both runs compute the
same gradients (float64, exactly), equal to one plain forward/backward of the whole model.

Printed: per width, the float64 gradients' largest difference overlapped vs serial and vs one plain
forward/backward, then float32 step ms overlapped and serial (median of ``--steps``) and their ratio.
Not run yet: no GPU was lent to the session that wrote it (``--smoke`` ran on a CPU).

    python benchmarks/gpu_dualpipe_overlap.py                 # H200: a few seconds per size
    python benchmarks/gpu_dualpipe_overlap.py --smoke         # any machine (CPU: the sequential path)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from modelpar.pipeline.runner import PipelineRunner
from modelpar.schedules import get_schedule


class _HostRoundTrip(torch.autograd.Function):
    """x -> pinned host -> device (the identity, on the copy engines); the gradient the same way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _round_trip(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _round_trip(grad)


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:
        return x.clone()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    out = torch.empty_like(x)
    out.copy_(host, non_blocking=True)
    return out


class Stage(nn.Module):
    """``layers`` Linear+GELU blocks, each followed by the host round trip of ``trips`` copies of its output."""

    def __init__(self, width: int, layers: int, trips: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.trips = trips

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.nn.functional.gelu(block(x))
            for _ in range(self.trips):
                x = _HostRoundTrip.apply(x)
        return x


def _run(name: str, stages: list[Stage], x: torch.Tensor, y: torch.Tensor, m: int, steps: int) -> tuple[float, list]:
    schedule = get_schedule(name, ranks=1, microbatches=m)
    runner = PipelineRunner(schedule, {0: stages[0], 1: stages[1]}, nn.functional.mse_loss, None)
    times = []
    for _ in range(steps):
        for p in runner.parameters():
            p.grad = None
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.step(x, y)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times), [p.grad.clone() for p in runner.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="1024,4096", help="comma-separated layer widths (one run each)")
    ap.add_argument("--rows", type=int, default=8192, help="rows of the batch (tokens)")
    ap.add_argument("--layers", type=int, default=4, help="Linear blocks per stage")
    ap.add_argument("--trips", type=int, default=1, help="host round trips after each block")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 3 steps, any device")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    widths = [64] if args.smoke else [int(w) for w in args.widths.split(",")]
    rows, steps = (64, 3) if args.smoke else (args.rows, args.steps)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; dualpipe-v, K = 1 (a V of "
          f"two stages on one GPU), M = {args.microbatches}, {args.layers} Linear+GELU per stage, {args.trips} host "
          f"round trip(s) after each")
    for width in widths:
        torch.manual_seed(0)
        for dtype in (torch.float64, torch.float32):  # float64: the numerics; float32: the timing
            stages = [Stage(width, args.layers, args.trips).to(device, dtype) for _ in range(2)]
            x = torch.randn(rows, width, device=device, dtype=dtype)
            y = torch.randn(rows, width, device=device, dtype=dtype)
            n = 2 if dtype == torch.float64 else steps
            t_on, g_on = _run("dualpipe-v", stages, x, y, args.microbatches, n)
            t_off, g_off = _run("dualpipe-v-serial", stages, x, y, args.microbatches, n)
            if dtype == torch.float64:
                for p in (p for s in stages for p in s.parameters()):
                    p.grad = None
                nn.functional.mse_loss(stages[1](stages[0](x)), y).backward()
                ref = [p.grad for s in stages for p in s.parameters()]
                same = max(float((a - b).abs().max()) for a, b in zip(g_on, g_off))
                plain = max(float((a - b).abs().max()) for a, b in zip(g_on, ref))
                print(f"width {width}: float64 gradients overlapped vs serial max |diff| {same:.1e}, "
                      f"vs one plain forward/backward {plain:.1e}")
            else:
                print(f"width {width}: float32 step overlapped {1e3 * t_on:.2f} ms, serial {1e3 * t_off:.2f} ms, "
                      f"ratio {t_on / t_off:.3f}")


if __name__ == "__main__":
    main()
