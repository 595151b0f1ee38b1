"""Recomputation on a chain of MLP blocks: time and held activations, ours vs torch.utils.checkpoint.

    python benchmarks/bench_recompute.py                    # CPU, 16 blocks of width 256
    python benchmarks/bench_recompute.py --device cuda --width 2048 --rows 4096

Each row is one forward + backward (median of --repeats, strategies interleaved so that drift
hits all alike). "held" is the peak of what autograd saved for backward, measured with
saved-tensor hooks (the non-reentrant torch checkpoint hides its saves from outer hooks: n/a);
on CUDA "peak mem" is max_memory_allocated above the parameters, which sees everything.
Expected (reference §4.3): every-k re-runs one forward, about 1/3 of forward + backward.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from modelpar.recompute import ActivationMeter, Recompute, best_k


class MLPBlock(nn.Module):
    """x + W2 · GELU(W1 · LayerNorm(x)): a transformer's MLP half."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def strategies(blocks: nn.Sequential, k: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n = len(blocks)
    segments = [blocks[a:a + k] for a in range(0, n, k)]

    def torch_every_k(x: torch.Tensor, reentrant: bool) -> torch.Tensor:
        for segment in segments:
            x = checkpoint(segment, x, use_reentrant=reentrant)
        return x

    return {
        "store-all": blocks,
        f"every-{k} (ours)": Recompute(blocks, k),
        f"every-{k} torch": lambda x: torch_every_k(x, False),
        f"every-{k} torch reentrant": lambda x: torch_every_k(x, True),
        f"checkpoint_sequential({n // k}) torch": lambda x: checkpoint_sequential(blocks, n // k, x, use_reentrant=False),
        "full (ours)": Recompute(blocks, "full"),
        "recompute-all (ours)": Recompute(blocks, "recompute-all"),
    }


def step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    fn(x).sum().backward()


def held_bytes(name: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> str:
    if "torch" in name and "reentrant" not in name:
        return "n/a"
    meter = ActivationMeter()
    with meter:
        step(fn, x)
    return f"{meter.peak_bytes / 2**20:8.1f} MiB"


def peak_memory(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> str:
    if x.device.type != "cuda":
        return "-"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(fn, x)
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - base) / 2**20:8.1f} MiB"


def timed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(fn, x)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-quadratic", action="store_true", help="leave out recompute-all (n(n+1)/2 re-runs)")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    blocks = nn.Sequential(*[MLPBlock(args.width) for _ in range(args.blocks)]).to(device)
    x = torch.randn(args.rows, args.width, device=device, requires_grad=True)
    k = best_k(args.blocks)
    runs = strategies(blocks, k)
    if args.skip_quadratic:
        runs.pop("recompute-all (ours)")
    for fn in runs.values():  # warm up
        step(fn, x)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn, x))
    median = {name: statistics.median(t) for name, t in times.items()}
    base = median["store-all"]
    print(f"{args.blocks} MLP blocks, width {args.width}, {args.rows} rows, {device}, k = {k} ≈ √{args.blocks}, "
          f"median of {args.repeats} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"{'strategy':34} {'fwd+bwd':>10} {'vs store-all':>13} {'held (hooks)':>13} {'peak mem':>12}")
    for name, fn in runs.items():
        print(f"{name:34} {median[name] * 1e3:8.1f}ms {median[name] / base:12.2f}x "
              f"{held_bytes(name, fn, x):>13} {peak_memory(fn, x):>12}")
    ours, anchor, anchor_re = (median[f"every-{k} (ours)"], median[f"every-{k} torch"], median[f"every-{k} torch reentrant"])
    print(f"every-{k} overhead over store-all: {ours / base - 1:+.0%} (one extra forward ≈ +33%)")
    print(f"ours / torch (same segments): {ours / anchor:.2f} (non-reentrant), {ours / anchor_re:.2f} (reentrant)")
    assert math.isfinite(ours)


if __name__ == "__main__":
    main()
