"""Expert parallelism on real gloo processes: every layout computes the single-process MoE model (float64).

The oracle is the plain PyTorch loop of tests/oracle.py on the whole batch (no pipeline, no
micro-batches, no all-to-all). Losses and gradient norms agree to 1e-9 over 6 steps, the router's
choices (tokens per expert, per layer and step) and the dropped assignments are identical, and
checkpoints move between ep = 2 and ep = 1 both ways, and between ZeRO with ep and neither. Under ZeRO
the expert weights' state is sharded over the d/ep replicas holding them: every rank holds the bytes
the cost model's ``state_bytes`` predicts. One cluster of 4 ranks for the module.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from oracle import plain_loop

from modelpar.costmodel.local_memory import state_bytes
from modelpar.model import ModelConfig
from modelpar.schedules import get_schedule
from modelpar.training import TrainConfig, train
from modelpar.training.prediction import held_parameter_bytes, local_run

MOE = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=2, layers=2, seq_len=16, experts=4, top_k=2,
                  shared_experts=1, expert_ffn=32, aux_loss_coef=0.1, init_std=0.1)
BASE = TrainConfig(model=MOE, steps=6, batch_size=8, microbatches=2, precision="fp64", warmup=1, lr=1e-2, clip=0.5,
                   eval_every=0, eval_batches=1, tp=1, pp=1, dp=4, ep=2)
TOL = 1e-9


def _train(cfg):
    torch.set_num_threads(1)
    events: list[dict] = []
    r = train(cfg, report=events.append)
    return r.losses, r.grad_norms, r.start_step, [e for e in events if e.get("event") == "step"]


def _train_bytes(cfg):
    """``_train``'s results and (rank, parameter, gradient, AdamW state bytes it holds)."""
    torch.set_num_threads(1)
    events: list[dict] = []
    r = train(cfg, report=events.append)
    held = (dist.get_rank(), held_parameter_bytes(cfg, r), r.gradient_bytes, r.optimizer_state_bytes)
    return r.losses, r.grad_norms, r.start_step, [e for e in events if e.get("event") == "step"], held


def _check(cfg, results, oracle, start=0):
    for losses, norms, first, steps, *_ in results:
        assert first == start
        assert losses == pytest.approx(oracle.losses[:len(losses)], abs=TOL, rel=0)
        assert norms == pytest.approx(oracle.norms[start:start + len(norms)], abs=TOL, rel=0)
        for event in steps:  # rank 0 reports: the router's choices are the single process's
            want = oracle.experts[event["step"] - 1]
            assert event["expert_tokens"] == [[int(t) for t in layer[:cfg.model.experts]] for layer in want]
            assert event["dropped_tokens"] == sum(int(layer[cfg.model.experts]) for layer in want)
            assert event["aux_loss"] == pytest.approx(sum(layer[-2] / layer[-1] for layer in want) / len(want),
                                                      abs=1e-12)


@pytest.mark.parametrize("changes", [
    {"model": dataclasses.replace(MOE, capacity_factor=1.0)},  # d = 4: two ep groups, experts summed over 2 replicas
    {"dp": 2, "pp": 2},  # ep = d = 2 under a 1F1B pipeline, dropless
    {"dp": 2, "tp": 2},  # the routed experts replicated over t, the shared experts split
    {"dp": 2, "pp": 2, "schedule": "zb-h1", "recompute": "full"},  # split backward (I, W), recomputed forward
], ids=["ep2-d4-capacity", "ep2-p2-dropless", "ep2-t2", "ep2-p2-zbh1-recompute"])
def test_expert_parallel_equals_one_process(c4, changes):
    cfg = dataclasses.replace(BASE, **changes)
    oracle = plain_loop(cfg)
    assert max(oracle.norms) > cfg.clip  # clipping was active
    results = c4.run(_train, cfg)
    _check(cfg, results, oracle)
    dropped = results[0][3][-1]["dropped_tokens"]
    assert (dropped > 0) == (cfg.model.capacity_factor is not None)
    assert results[0][3][-1]["expert_imbalance"] >= 1.0


@pytest.mark.parametrize("changes", [
    {"zero": 1},  # d = 4: the dense state over 4 ranges, each expert's over its 2 replicas
    {"zero": 2, "model": dataclasses.replace(MOE, capacity_factor=1.0)},  # gradients reduce-scattered per micro-batch
    {"zero": 3},  # parameters gathered per use, an expert bucket from its 2 replicas
    {"zero": 1, "dp": 2, "pp": 2, "schedule": "interleaved", "chunks": 2,  # d = ep = 2: experts unsharded
     "model": dataclasses.replace(MOE, layers=4)},
    {"zero": 2, "dp": 2, "tp": 2},  # expert TP 1: the routed experts whole (and their state) on both tp ranks
], ids=["ep2-d4-zero1", "ep2-d4-zero2-capacity", "ep2-d4-zero3", "ep2-p2-zero1-interleaved", "ep2-t2-zero2"])
def test_zero_with_expert_parallel_equals_one_process(c4, changes):
    cfg = dataclasses.replace(BASE, **changes)
    oracle = plain_loop(cfg)
    assert max(oracle.norms) > cfg.clip
    results = c4.run(_train_bytes, cfg)
    _check(cfg, results, oracle)
    run = local_run(cfg.check(4))
    schedule = get_schedule(cfg.schedule, ranks=cfg.pp, microbatches=cfg.microbatches, chunks=cfg.chunks)
    for *_, (rank, params, grads, state) in results:  # what each rank holds is what the cost model prices
        where = cfg.dims.coordinates(rank)
        want = state_bytes(run, schedule.stages_on(where["pp"]), where["dp"])
        assert (params, grads, state) == (want["parameters"], want["gradients"], want["optimizer"]), rank


def test_checkpoints_move_between_ep2_and_ep1(c4, tmp_path):
    """(d 4, ep 2, ZeRO-1) -> (p 2, d 2, ep 1, ZeRO-0) -> (d 4, ep 2, ZeRO-3): the losses of one run throughout."""
    cfg = dataclasses.replace(BASE, checkpoint_dir=str(tmp_path), exit_after=2)
    oracle = plain_loop(cfg)
    for step, changes in ((0, {"zero": 1}), (2, {"dp": 2, "pp": 2, "ep": 1}), (4, {"zero": 3})):
        run = dataclasses.replace(cfg, resume=step > 0, **changes)
        _check(run, c4.run(_train, run), oracle, start=step)

