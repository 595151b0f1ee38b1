"""Activation offload over a pipeline of 2 ranks: ZB-H1 (the split backward keeps tensors from I until W) and
interleaved, with and without recomputation, equal the plain run at the same layout (float64, every step's loss
and the final weights), and every rank's held and offloaded bytes are the cost model's.

The session's 2-rank cluster; the runs are three steps of a tiny model.
"""

import dataclasses

import pytest
import torch

from modelpar.costmodel.local_memory import activation_bytes, offloaded_bytes
from modelpar.model import ModelConfig
from modelpar.schedules import get_schedule
from modelpar.training import TrainConfig, train
from modelpar.training.prediction import local_run, predict_run

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
LLAMA = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=2, layers=4, seq_len=16)
BASE = TrainConfig(model=TINY, steps=3, batch_size=8, microbatches=2, precision="fp64", warmup=1, lr=1e-2, clip=0.5,
                   eval_every=0, eval_batches=1, tp=1, pp=2, dp=1, schedule="zb-h1")


def _train(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    path = None
    if cfg.checkpoint_dir:
        import pathlib

        path = str(sorted(pathlib.Path(cfg.checkpoint_dir).glob("step_*"))[-1])
    return r.losses, r.grad_norms, r.val, r.saved_bytes, r.offloaded_bytes, r.peak_held, path, r.offload_peak_bytes


def _weights(path):
    import pathlib

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = pathlib.Path(path + ".pt")
    dcp_to_torch_save(path, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


CASES = [
    {"offload_activations": "all"},
    {"offload_activations": "1", "recompute": "selective", "model": LLAMA},
    {"offload_activations": "all", "recompute": "full"},  # the layers save nothing: nothing moves, same numbers
    {"offload_activations": "all", "schedule": "interleaved", "chunks": 2},
]


@pytest.mark.parametrize("changes", CASES, ids=lambda c: "-".join(str(v) if not isinstance(v, ModelConfig) else v.arch
                                                                   for v in c.values()))
def test_pipeline_equals_the_plain_run_and_holds_the_predicted_bytes(c2, tmp_path, changes):
    offload = changes["offload_activations"]
    cfg = dataclasses.replace(BASE, **{k: v for k, v in changes.items() if k != "offload_activations"})
    moved_cfg = dataclasses.replace(cfg, offload_activations=offload)
    plain = c2.run(_train, dataclasses.replace(cfg, checkpoint_dir=str(tmp_path / "plain")))
    moved = c2.run(_train, dataclasses.replace(moved_cfg, checkpoint_dir=str(tmp_path / "moved")))
    for a, b in zip(plain, moved):
        assert a[:3] == b[:3]  # every step's loss, gradient norm, validation: bitwise
    want, got = _weights(plain[0][6]), _weights(moved[0][6])
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    run = local_run(moved_cfg.check(2))
    schedule = get_schedule(cfg.schedule, ranks=cfg.pp, microbatches=cfg.microbatches, chunks=cfg.chunks)
    for rank, (a, b) in enumerate(zip(plain, moved)):
        saved_plain, saved, offloaded, held = a[3], b[3], b[4], b[5]
        assert held == a[5]
        for s in schedule.stages_on(rank):  # per microbatch: what stays, what moved, and the fall is what moved
            assert saved[s] == pytest.approx(activation_bytes(run, s), rel=0.05)
            assert offloaded.get(s, 0) == pytest.approx(offloaded_bytes(run, s), rel=0.05, abs=0)
            assert saved_plain[s] - saved[s] == pytest.approx(offloaded_bytes(run, s), rel=0.05, abs=0)
    pred = predict_run(moved_cfg)  # rank 0 at its peak: held and offloaded
    measured_held = moved[0][5] * sum(moved[0][3].values()) / len(moved[0][3])
    assert measured_held == pytest.approx(pred.memory["activations"], rel=0.05)
    if offloaded_bytes(run, 0):
        measured_host = moved[0][5] * sum(moved[0][4].values()) / len(moved[0][4])
        assert measured_host == pytest.approx(pred.host_bytes, rel=0.05)
        assert moved[0][7] == pytest.approx(pred.host_bytes, rel=0.05)  # the host store's own peak over the steps
