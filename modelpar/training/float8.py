"""``--precision fp8``: the linear layers' matrix products in float8, through torchao's float8 training.

bf16 mixed precision (``precision.py``) with one change: each tensor-parallel linear layer's local
matrix product runs as torchao's ``Float8Linear`` does it — input, weight and output gradient cast
to float8 (e4m3) with dynamic tensor-wise scales, the products on the GPU's float8 matrix units
(``torch._scaled_mm``), outputs in bf16. The scaling is torchao's (a well-kept library), not ours.
Each layer keeps its parameter: a ``Float8Linear`` is built around the same ``weight`` and called in
place of ``F.linear``, so checkpoints, ZeRO's buckets and the tensor-parallel collectives around the
product are unchanged. As torchtitan does, the output layer stays in bf16 (its logits feed the loss)
and so do layers whose local shape is not a multiple of 16 (``_scaled_mm`` needs it).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from modelpar.tensor_parallel.head_loss import OutputLayer
from modelpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["FLOAT8_CAPABILITY", "check_float8_device", "float8_linears"]

FLOAT8_CAPABILITY = (8, 9)  # CUDA compute capability with float8 matrix units: Ada (8.9), Hopper (9.0) and later


def check_float8_device(device: torch.device) -> None:
    """A one-line ValueError unless ``device`` has float8 matrix units and torchao is installed."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FLOAT8_CAPABILITY:
        name = "cpu" if device.type != "cuda" else f"{torch.cuda.get_device_name(device)} " \
                                                    f"(compute capability {torch.cuda.get_device_capability(device)})"
        raise ValueError(f"precision fp8 needs a GPU with float8 matrix units (compute capability >= 8.9: H100, H200, "
                         f"L4, RTX 4090, B200), got {name}; use --precision bf16")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ValueError("precision fp8 trains through torchao's float8 training: pip install 'modelpar[fp8]' "
                         "(torchao)") from None


def float8_linears(modules: Mapping[int, nn.Module]) -> int:
    """Run the local products of the tensor-parallel linear layers of ``modules`` in float8; return how many."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig()
    count = 0
    for module in modules.values():
        for layer in module.modules():
            if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) or isinstance(layer, OutputLayer):
                continue
            out_features, in_features = layer.weight.shape
            if out_features % 16 or in_features % 16:
                continue
            with torch.device("meta"):
                shadow = nn.Linear(in_features, out_features, bias=False)
            shadow.weight = layer.weight  # the layer's own parameter: one copy, one gradient
            layer.use_matmul(Float8Linear.from_float(shadow, config=config))
            count += 1
    return count
