"""Training precision: what the parameters are stored in, what the stages compute in, what travels.

    precision   parameters, gradients,     forward / backward     pipeline messages    cross entropy
                dp reduction, AdamW state  (matmuls, attention)   (activations, grads)
    fp32        float32                    float32                float32              float32
    bf16        float32 (master weights)   bfloat16 (autocast)    bfloat16             float32
    fp8         float32 (master weights)   bf16, the linear       bfloat16             float32
                                           layers' products in
                                           float8 (``float8.py``)
    fp64        float64                    float64                float64              float64

bf16 is mixed precision the way ``torch.autocast`` does it (torchtitan's choice without FSDP):
the parameters *are* the fp32 master weights; inside a stage autocast casts them to bf16 for
each matmul and its backward turns the bf16 gradient into an fp32 one, which accumulates
across micro-batches in the fp32 ``.grad``. ``MixedPrecisionStage`` wraps one pipeline stage:
its input comes back to fp32 (the residual stream stays fp32, as on one process), its output,
the activation sent to the next stage, leaves in bf16 — so the pipeline's messages and their
gradients are half the bytes. The last stage's logits stay as autocast left them; the loss
(``vocab_parallel_cross_entropy``) computes in fp32. fp16 would need loss scaling and is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from modelpar._validate import check_choice

__all__ = ["PRECISIONS", "MixedPrecisionStage", "check_precision", "compute_dtype", "param_dtype", "wrap_stage"]

PRECISIONS = ("fp32", "bf16", "fp8", "fp64")
_PARAM = {"fp32": torch.float32, "bf16": torch.float32, "fp8": torch.float32, "fp64": torch.float64}
_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp64": torch.float64}


def check_precision(precision: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``; a one-line ValueError otherwise (fp16 says why)."""
    if precision in ("fp16", "float16", "half"):
        raise ValueError(f"precision {precision!r} is not supported: fp16 needs loss scaling, which modelpar does "
                         "not do; use bf16 (same speed on GPUs since A100, fp32's exponent range)")
    return check_choice("precision", precision, PRECISIONS)


def param_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters, gradients and optimizer state."""
    return _PARAM[check_precision(precision)]


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of the stages' matmuls and of the pipeline's messages."""
    return _COMPUTE[check_precision(precision)]


class MixedPrecisionStage(nn.Module):
    """One pipeline stage computing under ``torch.autocast(dtype)`` with parameters of another dtype.

    The input (an activation received in ``dtype``) is cast back to the parameters' dtype; the
    output of a stage that is not the last is cast to ``dtype``, the message the pipeline sends.
    Parameters are the wrapped module's own (same objects, same names under ``module.``).
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, last: bool) -> None:
        super().__init__()
        self.module, self.dtype, self.last = module, dtype, last
        first = next(module.parameters(), None)
        self.param_dtype = first.dtype if first is not None else torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            x = x.to(self.param_dtype)
        with torch.autocast(device_type=x.device.type, dtype=self.dtype):
            y = self.module(x)
        return y if self.last else y.to(self.dtype)


def wrap_stage(module: nn.Module, precision: str, last: bool) -> nn.Module:
    """``module`` as the pipeline runs it: wrapped in ``MixedPrecisionStage`` for bf16, itself otherwise."""
    if compute_dtype(precision) == param_dtype(precision):
        return module
    return MixedPrecisionStage(module, compute_dtype(precision), last)
