"""Context parallelism composed with t, p and d on 4 real gloo ranks (one cluster for the module).

Every case trains a few float64 steps and must give the plain one-process loop's losses, gradient
norms and validation loss at 1e-9 (tests/oracle.py).
"""

import dataclasses

import pytest
import torch
from oracle import plain_loop

from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, train

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
LLAMA = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=1, layers=4, seq_len=16)  # kv head replicated at t = 2
BASE = TrainConfig(model=TINY, steps=3, batch_size=8, microbatches=2, precision="fp64", warmup=1, lr=1e-2,
                   clip=0.5, eval_every=0, eval_batches=1, tp=1, pp=1, dp=1, cp=2)
TOL = 1e-9


def _train(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    return r.losses, r.grad_norms, r.val[-1][1]


CASES = {
    "t2-cp2-sp": dict(tp=2, sequence_parallel=True),
    "t2-cp2-llama-gqa-allgather": dict(tp=2, model=LLAMA, cp_comm="allgather"),
    "cp2-p2-1f1b-recompute": dict(pp=2, schedule="1f1b", recompute="full"),
    "cp2-p2-interleaved-llama": dict(pp=2, schedule="interleaved", chunks=2, model=LLAMA),
    "cp2-d2-zero1": dict(dp=2, zero=1),
    "cp2-p2-zb-h1": dict(pp=2, schedule="zb-h1"),  # the split backward: I, then W, around the ring's backward
    "cp2-p2-zb-v-llama-allgather": dict(pp=2, schedule="zb-v", chunks=2, model=LLAMA, cp_comm="allgather"),
    "cp4-ring": dict(cp=4),
    "cp4-allgather": dict(cp=4, cp_comm="allgather"),
}


@pytest.mark.parametrize("name", CASES)
def test_cp_composes_with_t_p_d(c4, name):
    cfg = dataclasses.replace(BASE, **CASES[name])
    ref = plain_loop(cfg)
    for losses, norms, val in c4.run(_train, cfg):
        assert max(abs(a - b) for a, b in zip(losses, ref.losses)) <= TOL
        assert max(abs(a - b) for a, b in zip(norms, ref.norms)) <= TOL
        assert abs(val - ref.val) <= TOL
