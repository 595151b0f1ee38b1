"""The chunked head and loss against the whole logits: bytes kept for the backward, the largest tensor, time.

One last stage (final norm, head, cross entropy) of a Llama-shaped model with a large vocabulary, one
microbatch, forward and backward, float32 on this machine: autograd's kept bytes counted with
saved-tensor hooks (what the trainer's ``saved_bytes`` measures), the largest tensor any operation
produced (a dispatch mode), the cost model's figure for the same stage (``costmodel.local_memory``: its one
layer and the end), and the median time of each. ``loss_chunk_mb`` is the trainer's setting (default 256).

    python benchmarks/bench_chunked_loss.py [--vocab 32000 --tokens 2048 --hidden 256 --chunk-mb 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from modelpar.costmodel.local_memory import activation_bytes
from modelpar.model import LMLoss, ModelConfig, build_stage
from modelpar.training import TrainConfig
from modelpar.training.prediction import local_run


class Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def measure(cfg: TrainConfig, repeats: int) -> tuple[int, int, float]:
    """(bytes kept for the backward, the largest tensor's bytes, median seconds of forward + backward)."""
    model = build_stage(cfg.model, 1, 2, seed=0, head_in_loss=cfg.loss_chunk > 0)
    loss_fn = LMLoss(cfg.model.vocab_size, head=model.head if cfg.loss_chunk else None, chunk=cfg.loss_chunk)
    b = cfg.batch_size // cfg.microbatches
    x = torch.randn(b, cfg.model.seq_len, cfg.model.hidden, requires_grad=True)
    y = torch.randint(0, cfg.model.vocab_size, (b, cfg.model.seq_len))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Largest() as largest:
        loss_fn(model(x), y).backward()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        times.append(time.perf_counter() - t0)
    return sum(kept.values()), largest.bytes, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the microbatch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk-mb", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    seq = 1024
    model = ModelConfig(arch="llama", vocab_size=args.vocab, hidden=args.hidden, heads=8, kv_heads=2, layers=2,
                        seq_len=seq)
    base = TrainConfig(model=model, tp=1, pp=2, dp=1, microbatches=1, batch_size=args.tokens // seq, precision="fp32")
    print(f"last stage: h {args.hidden}, V {model.padded_vocab_size}, {args.tokens} tokens, fp32; whole logits "
          f"{args.tokens * model.padded_vocab_size * 4 / 2**20:,.0f} MiB\n")
    print(f"{'loss':>28} {'kept MiB':>9} {'model MiB':>10} {'largest MiB':>12} {'ms':>8}")
    for label, mb in (("whole logits (loss_chunk_mb 0)", 0.0), (f"chunked ({args.chunk_mb:g} MiB)", args.chunk_mb)):
        cfg = replace(base, loss_chunk_mb=mb)
        kept, largest, seconds = measure(cfg, args.repeats)
        predicted = activation_bytes(local_run(cfg), 1)
        print(f"{label:>28} {kept / 2**20:>9.2f} {predicted / 2**20:>10.2f} {largest / 2**20:>12.2f} {1e3 * seconds:>8.1f}")


if __name__ == "__main__":
    main()
