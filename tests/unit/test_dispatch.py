"""GPU step time: the ops a model dispatches (training.dispatch, counted; costmodel.dispatch) and the pacing rule
(costmodel.local_compute.paced): on a GPU max(host, kernels), on a CPU their sum, the CPU's predictions unchanged."""

import dataclasses

import pytest
import torch

from modelpar.costmodel.dispatch import DispatchCounts
from modelpar.costmodel.local import predict_local
from modelpar.costmodel.local_compute import OPS_FORWARD, kernel_ends, kernel_layer, paced, step_end_seconds
from modelpar.costmodel.presets import CPU_DEFAULT, PROFILES
from modelpar.costmodel.profiles import HardwareProfile
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig
from modelpar.training.dispatch import count_dispatch, measure_launch
from modelpar.training.prediction import local_run

LLAMA = ModelConfig(arch="llama", hidden=64, heads=4, kv_heads=2, layers=2, seq_len=32)
GPU = dataclasses.replace(PROFILES["h100-sxm"], launch_s={"1": 1e-5})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("chunked", [True, False])
def test_the_count_does_not_depend_on_the_widths(precision, chunked):
    shrunk = count_dispatch(LLAMA, precision, chunked, device="cpu")
    assert count_dispatch(LLAMA, precision, chunked, device="cpu") is shrunk  # cached
    assert count_dispatch(LLAMA, precision, chunked, device="cpu", shrink=False) == shrunk
    assert count_dispatch(dataclasses.replace(LLAMA, hidden=128, seq_len=64), precision, chunked, device="cpu") == shrunk


def test_counts_are_the_models_own():
    fp32 = count_dispatch(LLAMA, "fp32", True, device="cpu")
    bf16 = count_dispatch(LLAMA, "bf16", True, device="cpu")
    gpt = count_dispatch(ModelConfig(hidden=64, heads=4, layers=2, seq_len=32), "fp32", True, device="cpu")
    assert fp32.layer_forward > OPS_FORWARD and fp32.layer_backward > fp32.layer_forward
    assert bf16.layer_forward > fp32.layer_forward  # autocast's casts are ops of their own
    assert gpt.embed_forward > fp32.embed_forward  # learned positions: a second lookup and the sum
    assert fp32.chunk_forward > 0 and fp32.head(3) == (fp32.head_forward + 2 * fp32.chunk_forward,
                                                       fp32.head_backward + 2 * fp32.chunk_backward)
    whole = count_dispatch(LLAMA, "fp32", False, device="cpu")
    assert whole.chunk_forward == 0 and whole.head(5) == (whole.head_forward, whole.head_backward)


def test_paced_adds_on_a_cpu_and_takes_the_longer_on_a_gpu():
    assert paced(CPU_DEFAULT, 2.0, 3.0) == 5.0
    assert paced(GPU, 2.0, 3.0) == 3.0 and paced(GPU, 4.0, 3.0) == 4.0


def _run(hw):
    cfg = TrainConfig(model=LLAMA, precision="bf16", batch_size=4, microbatches=2, tp=1, pp=1, dp=1)
    return local_run(cfg, hw)


def test_a_gpu_layer_is_paced_by_its_counted_ops():
    run = _run(GPU)
    assert run.ops == count_dispatch(LLAMA, "bf16", True)
    host_bound = dataclasses.replace(GPU, launch_s={"1": 1.0})  # a second per op: the host sets the pace
    layer, _ = kernel_layer(run, host_bound)
    assert (layer.forward, layer.backward) == (run.ops.layer_forward, run.ops.layer_backward)
    _, head = kernel_ends(run, host_bound, 0)
    assert (head.forward, head.backward) == run.ops.head(1)
    assert step_end_seconds(run, host_bound, 17, 1.0, 1.0) == run.ops.step(2)
    kernel_bound = dataclasses.replace(GPU, launch_s={"1": 1e-15})
    fast, _ = kernel_layer(run, kernel_bound)
    assert 0 < fast.forward < 1e-3 and fast.forward == kernel_layer(dataclasses.replace(run, ops=DispatchCounts(
        0, 0, 0, 0, 0, 0)), kernel_bound)[0].forward  # the kernels alone


def test_a_cpu_prediction_is_unchanged_by_the_counts():
    run = _run(CPU_DEFAULT)
    assert run.ops is None
    counted = dataclasses.replace(run, ops=count_dispatch(LLAMA, "bf16", True))
    assert predict_local(counted, CPU_DEFAULT).step_time_s == predict_local(run, CPU_DEFAULT).step_time_s


def test_more_launch_time_never_makes_a_gpu_step_faster():
    run = _run(GPU)
    times = [predict_local(run, dataclasses.replace(GPU, launch_s={"1": s})).step_time_s for s in (1e-7, 1e-5, 1e-3)]
    assert times == sorted(times) and times[-1] > times[0]


def test_launch_s_in_the_profile():
    data = GPU.to_json()
    assert HardwareProfile.from_json(data).launch(1) == 1e-5
    assert CPU_DEFAULT.launch(1) is None
    with pytest.raises(ValueError, match=r"launch_s\[1\]"):
        dataclasses.replace(GPU, launch_s={"1": -1.0})


def test_measure_launch_on_this_cpu():
    assert 0 < measure_launch(torch.device("cpu"), budget_s=0.01) < 0.01


def test_a_models_own_kernels_are_timed():
    from modelpar.calibrate.model_kernels import measure_model_kernels

    got = measure_model_kernels(LLAMA, 2, torch.device("cpu"), "bf16")
    assert set(got) == {"attention_forward_s", "attention_backward_s", "adamw_step_s", "weight_casts_s"}
    assert all(v > 0 for v in got.values())


def test_with_counted_ops_a_gpu_layer_is_composed_not_read_from_the_gpt_table():
    from modelpar.costmodel.local_compute import end_seconds, layer_seconds

    run = _run(GPU)
    rows = [[h, 4, 32, n, 1.0, 2.0, 1.0, 3.0] for h in (32, 128) for n in (32, 256)]  # a second per layer: absurd
    ends = [[h, n, 256, 1.0, 1.0, 1.0, 1.0] for h in (32, 128) for n in (32, 256)]
    tabled = dataclasses.replace(GPU, layer={"bf16": {"1": rows}}, ends={"bf16": {"1": ends}})
    layer, _ = kernel_layer(run, tabled)
    got = layer_seconds(run, tabled)
    assert (got.forward, got.backward) == (layer.forward, layer.backward) and got.forward < 0.1
    assert end_seconds(run, tabled, 0).forward < 0.1
    plain = dataclasses.replace(run, ops=None)  # without the counts the table prices it, as before
    assert layer_seconds(plain, tabled).forward > 0.5


@pytest.mark.cuda  # asynchronous kernel launches: skipped without a GPU
def test_a_small_gpu_stage_is_paced_by_its_dispatch():
    """A small bf16 Llama stage (h 256, 4 layers, 256 tokens: tiny kernels) on a GPU: its forward and backward take
    what the counted ops × the calibrated host seconds per op predict, within 30% (not yet run on a GPU: the
    first GPU session checks it)."""
    import time

    from modelpar.model import LMLoss, build_stage
    from modelpar.training.precision import wrap_stage

    device = torch.device("cuda")
    model = ModelConfig(arch="llama", hidden=256, heads=4, kv_heads=2, layers=4, seq_len=256)
    launch = measure_launch(device)
    ops = count_dispatch(model, "bf16", False)
    stage = wrap_stage(build_stage(model, device=device), "bf16", last=True)
    loss_fn = LMLoss(model.vocab_size)
    x = torch.randint(0, model.vocab_size, (1, 256), device=device)
    for _ in range(3):
        loss_fn(stage(x), x).backward()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        loss_fn(stage(x), x).backward()
    torch.cuda.synchronize()
    measured = (time.perf_counter() - t0) / 10
    counted = 4 * (ops.layer_forward + ops.layer_backward) + sum(ops.head(1)) + ops.embed_forward + ops.embed_backward
    assert counted * launch == pytest.approx(measured, rel=0.3)
