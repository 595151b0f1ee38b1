"""DualPipe-V's overlapped F&B pairs on real gloo processes: the single-process MoE model in float64.

Two ranks, ``ep = d = 2``, p = 1: each rank runs the one-rank V (two chunks) with its overlapped
pairs, the experts' all-to-alls inside them. Losses, gradient norms and the router's choices equal
the plain one-process loop (tests/oracle.py) to 1e-9, with the pairs overlapped ("dualpipe-v") and
back to back ("dualpipe-v-serial"), and the two runs agree exactly. On a CPU the pair's halves run
one after the other through the same code as on a GPU's two streams (``pipeline.pair_streams``).
"""

import dataclasses

import pytest
import torch
from oracle import plain_loop

from modelpar.model import ModelConfig
from modelpar.schedules import get_schedule
from modelpar.training import TrainConfig, train

MOE = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=2, layers=4, seq_len=16, experts=4, top_k=2,
                  shared_experts=1, expert_ffn=32, aux_loss_coef=0.1, init_std=0.1)
BASE = TrainConfig(model=MOE, steps=4, batch_size=8, microbatches=4, precision="fp64", warmup=1, lr=1e-2, clip=0.5,
                   eval_every=0, eval_batches=1, tp=1, pp=1, dp=2, ep=2, schedule="dualpipe-v", chunks=2)
TOL = 1e-9


def _train(cfg):
    torch.set_num_threads(1)
    events: list[dict] = []
    r = train(cfg, report=events.append)
    return r.losses, r.grad_norms, [e["expert_tokens"] for e in events if e.get("event") == "step"]


def test_the_schedule_has_pairs_and_the_serial_one_none():
    s = get_schedule("dualpipe-v", ranks=1, microbatches=BASE.microbatches)
    assert s.has_overlap and not get_schedule("dualpipe-v-serial", ranks=1, microbatches=4).has_overlap


def test_overlapped_pairs_with_expert_parallel_equal_one_process(c2):
    oracle = plain_loop(BASE)
    overlapped = c2.run(_train, BASE)
    serial = c2.run(_train, dataclasses.replace(BASE, schedule="dualpipe-v-serial"))
    for losses, norms, tokens in overlapped:
        assert losses == pytest.approx(oracle.losses, abs=TOL, rel=0)
        assert norms == pytest.approx(oracle.norms, abs=TOL, rel=0)
    assert overlapped[0][2] == [[[int(t) for t in layer[:MOE.experts]] for layer in step] for step in oracle.experts]
    assert [r[:2] for r in serial] == [r[:2] for r in overlapped]  # the same arithmetic, in the same order
