"""Activation offload in the trainer at (1, 1, 1) (the session's one-rank cluster): the plain run's losses and
weights bitwise, and the held and offloaded bytes the cost model says; on a GPU, the side-stream path.
"""

import dataclasses

import pytest
import torch

from modelpar.model import ModelConfig, build_stage
from modelpar.recompute.offload import HostOffload, apply_offload
from modelpar.training import TrainConfig, train
from modelpar.training.prediction import predict_run

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
LLAMA = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=2, layers=4, seq_len=16)
BASE = TrainConfig(model=TINY, steps=3, batch_size=8, microbatches=2, precision="fp64", warmup=1, lr=1e-2, clip=0.5,
                   eval_every=0, eval_batches=1, tp=1, pp=1, dp=1)


# --- the trainer at (1, 1, 1): the plain run's losses and weights, the bytes the cost model says ----------------

def _train(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    return (r.losses, r.grad_norms, r.val, r.saved_bytes, r.offloaded_bytes, r.activation_bytes,
            r.offloaded_activation_bytes, r.peak_held)


def _weights(path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, path.parent / (path.name + ".pt"))
    state = torch.load(path.parent / (path.name + ".pt"), weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _final(directory):
    (step,) = sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith("step_"))[-1:]
    return step


@pytest.mark.parametrize("changes", [{"offload_activations": "all"},
                                     {"offload_activations": "1", "recompute": "selective"},
                                     {"offload_activations": "every-2", "model": LLAMA}],
                         ids=["all", "first-selective", "every-2-llama"])
def test_one_rank_equals_the_plain_run_and_holds_the_predicted_bytes(c1, tmp_path, changes):
    cfg = dataclasses.replace(BASE, **{k: v for k, v in changes.items() if k != "offload_activations"})
    moved_cfg = dataclasses.replace(cfg, offload_activations=changes["offload_activations"])
    (plain,) = c1.run(_train, dataclasses.replace(cfg, checkpoint_dir=str(tmp_path / "plain")))
    (moved,) = c1.run(_train, dataclasses.replace(moved_cfg, checkpoint_dir=str(tmp_path / "moved")))
    assert moved[:3] == plain[:3]  # every step's loss, gradient norm and the validation: bitwise (float64)
    want, got = _weights(_final(tmp_path / "plain")), _weights(_final(tmp_path / "moved"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    pred = predict_run(moved_cfg)
    held_plain, held, host = plain[5], moved[5], moved[6]
    assert held == pytest.approx(pred.memory["activations"], rel=0.05)
    assert host == pytest.approx(pred.host_bytes, rel=0.05)
    assert held_plain - held == pytest.approx(pred.host_bytes, rel=0.05)  # the peak falls by the offloaded share


@pytest.mark.cuda
def test_on_a_gpu_the_copies_overlap_and_the_device_holds_less():
    """The side-stream path: pinned host buffers, copies on their own stream, the reload one layer ahead. The
    gradients are the plain run's bitwise and the device's peak falls by about what went to the host."""
    model = dataclasses.replace(LLAMA, hidden=256, heads=4, kv_heads=2, seq_len=256)
    ids = torch.randint(0, model.vocab_size, (8, model.seq_len), device="cuda")
    peaks, grads = [], []
    for offload in ("none", "all"):
        torch.manual_seed(0)
        stage = build_stage(model, dtype=torch.float32, device="cuda")
        store = HostOffload()
        if offload != "none":
            apply_offload(stage, offload, store)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stage(ids).square().mean().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append([p.grad.clone() for p in stage.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert peaks[1] < peaks[0] - store.reading.peak_bytes / 2
