"""One model's own kernels at its real shapes, timed on the device: what ``benchmarks/gpu_calibrate.py`` prints
beside the cost model's kernel prices (not in the profile: a profile holds no model's shapes).

- SDPA attention forward and backward at the model's heads, key/value heads and sequence (causal, the
  compute dtype: the backend torch picks, flash on recent GPUs);
- the AdamW step over the model's parameters (fused on a GPU, as ``training.optimizer`` builds it);
- autocast's casts: every layer's and the head's weights to bf16 once (what a microbatch's forward makes).

On a GPU with CUDA events around each (the host's dispatch left out); on a CPU with the host's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from modelpar.model import ModelConfig

__all__ = ["measure_model_kernels"]


def _timed(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median seconds of ``fn()`` on ``device`` after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_model_kernels(cfg: ModelConfig, micro_batch: int, device: torch.device,
                          precision: str = "bf16") -> dict[str, float]:
    """Seconds of ``cfg``'s attention forward and backward per layer (``micro_batch`` sequences), its AdamW step
    and its weight casts (module docstring)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    b, s, a, kv, d = micro_batch, cfg.seq_len, cfg.heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(b, a, s, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv, s, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv, s, d, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(b, a, s, d, device=device, dtype=dtype)

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != a)

    attention_f = _timed(forward, device)
    attention_fb = _timed(lambda: torch.autograd.grad(forward(), (q, k, v), grad), device)
    n = cfg.num_parameters()
    params = [torch.zeros(n, device=device, requires_grad=True)]
    params[0].grad = torch.randn(n, device=device)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    adamw = _timed(opt.step, device)
    weights = torch.randn(n, device=device)
    cast = _timed(lambda: weights.to(dtype), device) if dtype != torch.float32 else 0.0
    return {"attention_forward_s": attention_f, "attention_backward_s": max(0.0, attention_fb - attention_f),
            "adamw_step_s": adamw, "weight_casts_s": cast}
