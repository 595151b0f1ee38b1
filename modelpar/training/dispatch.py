"""The ops the trainer dispatches, counted (``costmodel.dispatch.DispatchCounts``), and the host's time for one.

``count_dispatch``: a ``TorchDispatchMode`` counts every ATen op of the model's own forward and backward
(``build_stage`` wrapped as the trainer runs it: ``training.precision.wrap_stage``, the loss the trainer
uses, chunked or not), at one and two layers (the difference is a layer's; the rest the ends'), the
embedding alone, the loss at one and two chunks, and an optimizer step (fused AdamW as on a GPU, the
gradient norm with foreach ops, the zeroing) at one and two layers. The count does not depend on the widths or the
tokens, so it runs at 16 tokens with the model's structure kept (arch, heads, key/value heads, biases,
tied head, the vocabulary's padding) and its widths shrunk (head dim 8, MLP 64, vocabulary 128 rows): a
second or so on a CPU for any model size; cached per model config. MoE layers are priced apart
(``costmodel.moe``) and counted dense.

``measure_launch``: host seconds per dispatched op as the trainer dispatches them (Python, module calls,
autograd's bookkeeping, the launch), without waiting for the device: such a layer's forward and backward
at tiny shapes timed on the host, over its counted ops. On a GPU its kernels are tiny, so the host sets
the pace; a bare ``x.add_(1)`` loop would price the driver's launch alone (a few µs) and miss the rest.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any

import torch

from modelpar._compat import TorchDispatchMode
from modelpar.costmodel.dispatch import DispatchCounts
from modelpar.model import LMLoss, ModelConfig, build_stage
from modelpar.training.precision import compute_dtype, wrap_stage

__all__ = ["COUNT_TOKENS", "count_dispatch", "measure_launch", "shrunk"]

COUNT_TOKENS = 16  # tokens of the counting runs (one sequence): the count does not depend on them


class _Count(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it (every thread autograd runs the backward on included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def shrunk(cfg: ModelConfig, layers: int) -> ModelConfig:
    """``cfg``'s structure at ``layers`` dense layers with small widths: head dim 8, MLP 64, 128 vocabulary rows
    padded as ``cfg``'s are (the padded ids' masking is an op of its own), ``COUNT_TOKENS`` positions at least."""
    pad = cfg.padded_vocab_size - cfg.vocab_size
    return replace(cfg, layers=layers, hidden=8 * cfg.heads, ffn=64, vocab_size=128 - pad, experts=0,
                   seq_len=max(COUNT_TOKENS, 2))


def _device(device: str | None) -> torch.device:
    """``device``, else this process's GPU if it already uses one (a launcher that has not stays off the GPU: a
    CUDA context holds hundreds of MiB the run would lose), else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"))


def _counted(fn: Any) -> int:
    with _Count() as c:
        fn()
    return c.ops


def _pass(cfg: ModelConfig, precision: str, chunks: int, device: torch.device,
          seed: int = 0) -> tuple[int, int, int, int, int]:
    """(forward, backward, embedding forward, embedding backward, optimizer step) ops of one whole-model stage of
    ``cfg`` with the loss in ``chunks`` chunks (0: the logits whole), after two warm-up steps."""
    dtype = torch.float64 if precision == "fp64" else torch.float32
    model = build_stage(cfg, seed=seed, dtype=dtype, device=device, head_in_loss=chunks > 0)
    stage = wrap_stage(model, precision, last=True)
    chunk = -(-COUNT_TOKENS // chunks) if chunks else 0
    loss_fn = LMLoss(cfg.vocab_size, head=model.head if chunks else None, chunk=chunk,
                     compute_dtype=compute_dtype(precision))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (1, COUNT_TOKENS), generator=gen).to(device)
    y = torch.randint(0, cfg.vocab_size, (1, COUNT_TOKENS), generator=gen).to(device)
    params = [p for p in stage.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)  # as ``training.optimizer`` builds it on a GPU

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(2):  # the first calls check shapes and ids once; AdamW makes its state
        loss_fn(stage(x), y).backward()
        step()
    out: list[torch.Tensor] = []
    forward = _counted(lambda: out.append(loss_fn(stage(x), y)))
    backward = _counted(lambda: out[0].backward())
    embed = model.embed
    seen: list[torch.Tensor] = []
    embed_forward = _counted(lambda: seen.append(embed(x))) if embed is not None else 0
    ones = torch.ones_like(seen[0]) if seen else None
    embed_backward = _counted(lambda: seen[0].backward(ones)) if seen else 0
    return forward, backward, embed_forward, embed_backward, _counted(step)


@functools.lru_cache(maxsize=64)
def count_dispatch(cfg: ModelConfig, precision: str = "fp32", chunked: bool = True,
                   device: str | None = None, shrink: bool = True) -> DispatchCounts:
    """The ops ``cfg`` dispatches at ``precision`` (module docstring), on ``device`` (default: this process's GPU if
    it uses one, autocast's op lists being the device's; else the CPU, whose lists differ a little), the loss
    ``chunked`` or not, the optimizer step as on a GPU (fused AdamW, the norm with foreach ops); cached. ``shrink`` False: at the
    model's own widths (the tests' check that the count does not depend on them)."""
    dev = _device(device)
    chunks = 1 if chunked else 0
    at = shrunk if shrink else (lambda c, n: replace(c, layers=n, experts=0, seq_len=max(c.seq_len, COUNT_TOKENS)))
    f1, b1, ef, eb, s1 = _pass(at(cfg, 1), precision, chunks, dev)
    f2, b2, _, _, s2 = _pass(at(cfg, 2), precision, chunks, dev)
    layer_f, layer_b = f2 - f1, b2 - b1
    head_f, head_b = f1 - layer_f - ef, b1 - layer_b - eb
    chunk_f = chunk_b = 0
    if chunked:  # each further chunk of the loss: its product, softmax pieces and gradient products again
        f3, b3, _, _, _ = _pass(at(cfg, 1), precision, 2, dev)
        chunk_f, chunk_b = f3 - f1, b3 - b1
    return DispatchCounts(layer_f, layer_b, ef, eb, head_f, head_b, s1 - (s2 - s1), s2 - s1, chunk_f, chunk_b)


def measure_launch(device: torch.device, budget_s: float = 0.05) -> float:
    """Host seconds per op the trainer dispatches without waiting for the device (module docstring): a two-layer
    Llama-style stage's forward and backward at ``COUNT_TOKENS`` tokens, bf16 autocast on a GPU, timed on the
    host (the device synchronised before, not inside), over its counted ops; the median of the runs."""
    cfg = shrunk(ModelConfig(arch="llama", heads=4, kv_heads=2, layers=2), 2)
    precision = "bf16" if device.type == "cuda" else "fp32"
    stage = wrap_stage(build_stage(cfg, device=device), precision, last=True)
    loss_fn = LMLoss(cfg.vocab_size)
    x = torch.randint(0, cfg.vocab_size, (1, COUNT_TOKENS), generator=torch.Generator().manual_seed(0)).to(device)

    def once() -> None:
        loss_fn(stage(x), x).backward()

    once()
    ops = _counted(once)
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < end and len(times) < 200):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] / max(1, ops)
