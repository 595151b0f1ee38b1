"""Experts in the planners: `modelpar plan` prices and searches ep (hand-checked terms, Mixtral on 16 H100s picks
ep > 1 and says why), and `train --plan auto` searches ep but proposes only what `TrainConfig.check` accepts."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelpar.cli import main
from modelpar.costmodel import make_cluster, model_preset
from modelpar.costmodel.assumptions import DEFAULT
from modelpar.costmodel.estimate import ep_layer_time
from modelpar.costmodel.local_search import Capabilities, plan_local
from modelpar.costmodel.presets import CPU_DEFAULT
from modelpar.costmodel.request import parse_plan_command
from modelpar.costmodel.specs import ParallelConfig
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig
from modelpar.training.autoplan import _accepted, _config
from modelpar.training.prediction import local_run

MIXTRAL = model_preset("mixtral-8x7b")


def test_mixtral_parameters_and_flops_by_hand():
    # 32 layers of attention (q, o 4096², k, v 4096·1024) + 2 RMSNorms + router 4096·8 + 8 experts of 3·4096·14336
    h, f = 4096, 14336
    layer = 2 * h * h + 2 * h * 1024 + 2 * h + h * 8 + 8 * 3 * h * f
    assert MIXTRAL.params == 32 * layer + 2 * 32000 * h
    # forward FLOPs per token and layer: 2 per active weight (router, 2 experts) + 4·s·h attention
    assert MIXTRAL.layer_flops_per_token == 2 * (2 * h * h + 2 * h * 1024 + h * 8 + 2 * 3 * h * f) + 4 * 4096 * h
    assert MIXTRAL.expert_flops_per_token == 2 * (h * 8 + 2 * 3 * h * f)  # whole on every tensor-parallel rank
    ds = model_preset("deepseek-v3")
    assert ds.moe_share == 58 / 61 and ds.params / 1e9 == pytest.approx(672.1, abs=0.1)  # "671B" (MLA as MHA)


def test_all_to_all_time_by_hand():
    # t = 1, ep = 8 inside a node (450 GB/s NVLink at DEFAULT's 0.85, 20 µs each): b·s = 4096 tokens, k = 2,
    # 16-bit: 4096·2·7/8·4096·2 B per all-to-all, 2 forward + 2 backward per layer; every layer is MoE
    cluster = make_cluster("h100-sxm", 64)
    sent = 4096 * 2 * 7 / 8 * 4096 * 2
    one = sent / (450e9 * 0.85) + 20e-6
    cfg = ParallelConfig(1, 1, 64, 1, recompute="none", ep=8)
    assert ep_layer_time(MIXTRAL, cluster, cfg, DEFAULT) == pytest.approx(4 * one)
    assert ep_layer_time(MIXTRAL, cluster, dataclasses.replace(cfg, recompute="full"), DEFAULT) == pytest.approx(6 * one)
    assert ep_layer_time(MIXTRAL, cluster, dataclasses.replace(cfg, ep=1), DEFAULT) == 0.0


def test_plan_picks_ep_for_mixtral_and_says_why(capsys):
    command = "--model mixtral-8x7b --gpu h100-sxm --gpus 16 --batch 256"
    res = parse_plan_command(command).search()
    best = res.ranked[0]  # ZeRO-3's gathers hidden under compute (FSDP prefetch): the experts' all-to-alls decide ep
    assert best.config.ep > 1 and best.time["ep"] > 0
    assert all(e.config.d % e.config.ep == 0 and 8 % e.config.ep == 0 for e in res.ranked)
    assert {e.config.ep for e in res.ranked} == {1, 2, 4, 8}
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "16", "--batch", "256"]) == 0
    out = capsys.readouterr().out
    assert f"Expert parallelism ep = {best.config.ep} (inside d = 16)" in out and "The best layout at ep = 1: +" in out
    assert parse_plan_command(command + " --ep 1").search().ranked[0].config.ep == 1  # pinned


def test_plan_moe_flags_and_bad_input(capsys):
    args = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--seq-len", "256", "--vocab", "1000",
            "--gpus", "8", "--batch", "64", "--experts", "8", "--top-k", "2", "--expert-ffn", "512", "--json", "--top", "1"]
    assert main(args) == 0
    assert '"ep"' in capsys.readouterr().out
    for bad, word in ((["--ep", "3"], "--ep"), (["--top-k", "9"], "--top-k"), (["--capacity-factor", "0"], "capacity")):
        assert main(args + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and word in err[0]
    assert main(args[:13] + ["--top-k", "2"]) == 2  # MoE flags without --experts on a dense model
    assert "--experts" in capsys.readouterr().err


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(experts=st.sampled_from([2, 4, 6, 8]), world=st.sampled_from([2, 4]), zero=st.sampled_from([0, 1]))
def test_local_plan_searches_ep_and_proposes_only_what_the_trainer_accepts(experts, world, zero):
    model = ModelConfig(arch="llama", hidden=32, heads=4, layers=2, seq_len=16, experts=experts, top_k=2)
    cfg = TrainConfig(model=model, batch_size=8, tp=1, pp=1, dp=world, zero=zero, precision="fp64")
    caps = Capabilities(schedules=("1f1b",), recompute=("none",), sequence_parallel=False, max_microbatches=2)
    plan = plan_local(local_run(cfg), world, CPU_DEFAULT, 1e12, caps, lambda run: _accepted(cfg, world, run))
    assert plan.ranked
    for run, _ in plan.ranked:
        planned = _config(cfg, run)
        assert planned.ep == run.ep and planned.check(world)  # the trainer's own rule, not a copy of it
    eps = {run.ep for run, _ in plan.ranked}
    assert eps == {e for e in (1, 2, 4) if e <= world and experts % e == 0 and world % e == 0}
    everything = plan_local(local_run(cfg), world, CPU_DEFAULT, 1e12, caps)  # without the trainer's check
    refused = [run for run, _ in everything.ranked if not _accepted(cfg, world, run)]
    assert any(run.cp > 1 for run in refused)  # a refusal of the trainer's (experts with cp > 1): searched, refused
    assert not any(run.cp > 1 for run, _ in plan.ranked)
    assert any(run.ep > 1 and run.zero for run, _ in plan.ranked)  # ZeRO with ep: the trainer runs it, so proposed
