"""``--precision fp8``: torchao's float8 products in place of the linear layers' F.linear, the model otherwise
unchanged; refused in one line where the device has no float8 matrix units (here: the CPU).

torch emulates ``_scaled_mm`` on CPUs, so the conversion itself is checked here against the bf16 model, at
float8's accuracy; the speed and the loss curve need a GPU (benchmarks/gpu_single.py, docs/performance.md).
"""

import pytest
import torch

from modelpar.model import LMLoss, ModelConfig, build_stage
from modelpar.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from modelpar.training import TrainConfig
from modelpar.training.float8 import check_float8_device, float8_linears

pytest.importorskip("torchao.float8")

LLAMA = ModelConfig(arch="llama", hidden=64, heads=4, kv_heads=2, layers=2, seq_len=32)


def test_fp8_is_refused_in_one_line_on_a_cpu():
    with pytest.raises(ValueError, match=r"^precision fp8 needs a GPU with float8 matrix units \(compute capability "
                                         r">= 8\.9.*got cpu; use --precision bf16$"):
        check_float8_device(torch.device("cpu"))
    TrainConfig(precision="fp8").check()  # a valid setting: the device decides, on every rank alike


def _loss(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = LMLoss(LLAMA.vocab_size, head=model.head, compute_dtype=torch.bfloat16)(out, x)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_float8_linears_keep_the_model_and_approximate_bf16():
    bf16 = build_stage(LLAMA, seed=0, head_in_loss=True)
    fp8 = build_stage(LLAMA, seed=0, head_in_loss=True)
    params = dict(fp8.named_parameters())
    assert float8_linears({0: fp8}) == 5 * LLAMA.layers  # q, kv, proj, fc1, fc2 of each block (shapes of 16s)
    assert dict(fp8.named_parameters()) == params and fp8.state_dict().keys() == bf16.state_dict().keys()
    swapped = [m for m in fp8.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and "matmul" in m.__dict__]
    assert all(m.__dict__["matmul"].weight is m.weight for m in swapped)  # the layer's own parameter, one gradient
    assert fp8.head not in swapped  # the output layer stays in bf16
    x = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.seq_len))
    loss, grads = _loss(bf16, x)
    loss8, grads8 = _loss(fp8, x)
    assert loss8 == pytest.approx(loss, rel=2e-2)  # e4m3 keeps 3 mantissa bits
    for name, g in grads.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), grads8[name].flatten(), dim=0)
        assert cos > 0.95, name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with float8 matrix units")
def test_on_a_float8_gpu_the_products_run_in_float8():
    device = torch.device("cuda", torch.cuda.current_device())
    check_float8_device(device)  # no error here
    bf16 = build_stage(LLAMA, seed=0, device=device, head_in_loss=True)
    fp8 = build_stage(LLAMA, seed=0, device=device, head_in_loss=True)
    assert float8_linears({0: fp8}) == 5 * LLAMA.layers
    x = torch.randint(0, LLAMA.vocab_size, (4, LLAMA.seq_len), device=device)
    losses = []
    for model in (bf16, fp8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        losses.append(LMLoss(LLAMA.vocab_size, head=model.head, compute_dtype=torch.bfloat16)(out, x).item())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
