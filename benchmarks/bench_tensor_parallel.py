"""Our Megatron layers vs PyTorch's own tensor parallelism, side by side, 2 gloo processes.

The same MLP block (h → 4h → h, GeLU) and causal attention block (fused qkv, h → 3h; proj h → h)
run forward + backward on both: ours (``modelpar.tensor_parallel``, with the cross-rank shape
check on and off) and ``torch.distributed.tensor.parallel.parallelize_module`` with
ColwiseParallel on fc1/qkv and RowwiseParallel on fc2/proj (DTensor). The three variants
alternate step by step so they see the same machine load; each figure is the median step time.
Bytes: ours from ``comm_log``; torch's by intercepting its functional collectives. The MLP's
outputs are compared too (same full weights on both sides).

    python benchmarks/bench_tensor_parallel.py [--hidden 256] [--batch 4] [--seq 128] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import modelpar.tensor_parallel as tp
from modelpar.costmodel import allgather_bytes, allreduce_bytes
from modelpar.distributed import launch


class TorchMLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TorchAttention(nn.Module):
    """Fused qkv like ours; after ColwiseParallel each rank's qkv output is 3h/t wide (local heads)."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.head_dim = h // heads
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        q, k, v = (u.reshape(b, s, -1, self.head_dim).transpose(1, 2) for u in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class CollectiveBytes(TorchDispatchMode):
    """Counts DTensor's functional collectives (full-tensor elements, as ``comm_log`` does) and ring bytes sent."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.count, self.sent = n, 0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if func.namespace == "_c10d_functional" and name.startswith(("all_reduce", "all_gather", "reduce_scatter")):
            size = args[0].numel() * args[0].element_size()
            self.count += 1
            if name.startswith("all_reduce"):
                self.sent += allreduce_bytes(size, self.n)
            else:  # all-gather: input is 1/n of the full tensor; reduce-scatter: input is the full tensor
                full = size * self.n if name.startswith("all_gather") else size
                self.sent += allgather_bytes(full, self.n)
        return func(*args, **(kwargs or {}))


def _step(model: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    model(x).sum().backward()
    return time.perf_counter() - start


def _run(hidden: int, heads: int, batch: int, seq: int, steps: int) -> dict:
    torch.set_num_threads(1)
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    group = mesh.get_group()
    out = {}
    for block in ("mlp", "attention"):
        torch.manual_seed(0)
        ref = TorchMLP(hidden) if block == "mlp" else TorchAttention(hidden, heads)
        kw = {"group": group}
        ours = tp.ParallelMLP(hidden, **kw) if block == "mlp" else tp.ParallelAttention(hidden, heads, **kw)
        tp.load_full_state_dict(ours, ref.state_dict())
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()} if block == "mlp" else \
            {"qkv": ColwiseParallel(), "proj": RowwiseParallel()}
        theirs = parallelize_module(ref, mesh, plan)
        x = torch.randn(batch, seq, hidden, requires_grad=True)
        # attention's fused q/k/v: ColwiseParallel gives each rank a contiguous part of the [3h, h] weight's rows,
        # ours a part of each of q, k and v (Megatron's layout): the ranks hold different heads, so the
        # two outputs are not compared
        same = (ours(x) - theirs(x)).abs().max().item() if block == "mlp" else None
        times: dict[str, list[float]] = {"ours": [], "ours_nocheck": [], "torch": []}
        for i in range(steps + 3):
            for name in times:
                tp.set_shape_checks(ours, name != "ours_nocheck")
                t = _step(theirs if name == "torch" else ours, x)
                if i >= 3:  # warm-up
                    times[name].append(t)
        tp.set_shape_checks(ours, True)
        with tp.comm_log() as log:
            _step(ours, x)
        counter = CollectiveBytes(n)
        with counter:
            _step(theirs, x)
        out[block] = {k: statistics.median(v) for k, v in times.items()}
        out[block].update(max_diff=same, ours_count=log.count() - log.count("shape_check"),
                          ours_sent=log.sent_bytes(), torch_count=counter.count, torch_sent=counter.sent)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    res = launch(_run, 2, args.hidden, args.heads, args.batch, args.seq, args.steps, timeout=600)[0]
    print(f"t = 2 gloo processes, one thread each; b = {args.batch}, s = {args.seq}, h = {args.hidden}, "
          f"{args.heads} heads, float32; median of {args.steps} forward+backward steps")
    print(f"{'block':<10} {'ours ms':>8} {'no check':>9} {'torch ms':>9} {'ours/torch':>11} {'(no check)':>11} "
          f"{'colls ours/torch':>17} {'KB sent ours/torch':>19} {'max |diff|':>11}")
    for block, r in res.items():
        print(f"{block:<10} {r['ours'] * 1e3:>8.2f} {r['ours_nocheck'] * 1e3:>9.2f} {r['torch'] * 1e3:>9.2f} "
              f"{r['ours'] / r['torch']:>11.2f} {r['ours_nocheck'] / r['torch']:>11.2f} "
              f"{r['ours_count']:>8} / {r['torch_count']:<6} {r['ours_sent'] / 1e3:>9.0f} / {r['torch_sent'] / 1e3:<7.0f} "
              f"{'-' if r['max_diff'] is None else format(r['max_diff'], '.1e'):>11}")


if __name__ == "__main__":
    main()
