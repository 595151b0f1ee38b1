"""``modelpar train --plan auto``: the capability list, the ranking, the memory limit and the refusal."""

import dataclasses

import pytest

from modelpar.cli import main
from modelpar.costmodel.local import PRICED_ZERO, predict_local
from modelpar.costmodel.local_search import layouts, plan_local
from modelpar.costmodel.presets import CPU_DEFAULT
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig
from modelpar.training.autoplan import CAPABILITIES, auto_plan
from modelpar.training.config import SCHEDULE_CHOICES, ZERO_CHOICES
from modelpar.training.prediction import local_run

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
CFG = TrainConfig(model=TINY, batch_size=8, microbatches=2, steps=2, eval_every=0, eval_batches=1)


def test_capabilities_are_the_trainers():
    assert CAPABILITIES.schedules == (*SCHEDULE_CHOICES, "auto")
    assert CAPABILITIES.zero == tuple(z for z in ZERO_CHOICES if z in PRICED_ZERO) == (0, 1, 2, 3)


def test_every_planned_layout_is_one_the_trainer_accepts_and_they_are_ranked():
    cfg, pred, line = auto_plan(CFG, 4)
    assert cfg.dims.world_size == 4 and cfg.check(4) is cfg
    assert pred.step_time_s == predict_local(local_run(cfg), CPU_DEFAULT).step_time_s
    cp = f" cp={cfg.cp} ({cfg.cp_comm})" if cfg.cp > 1 else ""
    assert "predicted step" in line and f"t={cfg.tp}{cp} p={cfg.pp} d={cfg.dp}" in line
    plan = plan_local(local_run(CFG), 4, CPU_DEFAULT, 1e12, CAPABILITIES)
    times = [p.step_time_s for _, p in plan.ranked]
    every = list(layouts(TINY.spec(), 4, 8, CAPABILITIES, local_run(CFG)))
    assert times == sorted(times) and plan.tried == len(plan.ranked) == len(every)
    assert {(r.t, r.cp, r.p, r.d) for r, _ in plan.ranked if r.cp == 1} == \
        {(1, 1, 1, 4), (1, 1, 2, 2), (1, 1, 4, 1), (2, 1, 1, 2), (2, 1, 2, 1), (4, 1, 1, 1)}
    assert {(r.t, r.cp, r.p, r.d) for r, _ in plan.ranked if r.cp > 1} == \
        {(1, 2, 1, 2), (1, 2, 2, 1), (2, 2, 1, 1), (1, 4, 1, 1)}  # s = 16: cp 2 and 4 (2·cp | s)
    assert {r.cp_comm for r, _ in plan.ranked if r.cp > 1} == {"ring", "allgather"}
    assert all(r.zero < 2 for r, _ in plan.ranked if r.cp > 1)  # the trainer refuses ZeRO-2/3 with cp


def test_memory_limit_drops_what_does_not_fit():
    base = plan_local(local_run(CFG), 4, CPU_DEFAULT, 1e12)
    limit = sorted(p.memory_bytes for _, p in base.ranked)[len(base.ranked) // 2]
    capped = plan_local(local_run(CFG), 4, CPU_DEFAULT, limit)
    assert capped.ranked and all(p.memory_bytes <= limit for _, p in capped.ranked)
    assert len(capped.ranked) < len(base.ranked) and capped.leanest is not None
    assert capped.leanest[1].memory_bytes > limit
    cfg, pred, _ = auto_plan(dataclasses.replace(CFG, memory_limit_gb=limit / 1e9), 4)
    assert pred.memory_bytes <= limit


def test_refused_in_one_line_before_any_process(capsys):
    code = main(["train", "--plan", "auto", "--memory-limit-gb", "0.0001", "--layers", "4", "--hidden", "32",
                 "--heads", "4", "--seq-len", "16", "--batch-size", "8", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no layout fits 0.0001 GB per rank on 4 ranks" in err and "on pipeline stage" in err and "GB" in err


def test_plan_auto_runs_the_plan(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--plan", "auto", "--plan-ranks", "2", "--layers", "2", "--hidden", "32",
                 "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--eval-every", "0",
                 "--eval-batches", "1", "--no-progress", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0 and "modelpar train: plan on cpu-default" in captured.err
    assert "predicted / measured parameters" in captured.out and (out / "summary.json").exists()


@pytest.mark.parametrize("flags, message", [(["--plan", "maybe"], "plan must be one of"),
                                            (["--memory-limit-gb", "-1"], "memory_limit_gb must be >= 0")])
def test_bad_plan_flags(capsys, flags, message):
    assert main(["train", *flags, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_bad_hardware_profile_is_refused_before_training(tmp_path, capsys):
    bad = tmp_path / "hw.json"
    bad.write_text('{"format": "modelpar-hardware-profile", "version": 2, "name": "x"}')
    assert main(["train", "--hardware", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is malformed" in err and len(err.strip().splitlines()) == 1


def test_a_named_gpu_plans_too():
    cfg, pred, line = auto_plan(dataclasses.replace(CFG, hardware="h100-sxm"), 4)
    assert "plan on h100-sxm" in line and cfg.check(4) is cfg and pred.step_time_s > 0


def test_auto_is_planned_within_the_bytes_and_the_trainer_builds_the_same_schedule():
    """p = 2: at each byte limit the planner's auto layouts fit it, and the trainer's config rebuilds them."""
    from modelpar.costmodel.local import layout_schedule
    from modelpar.training.autoplan import _config
    from modelpar.training.prediction import resolve_schedule, run_schedule

    base = plan_local(local_run(CFG), 2, CPU_DEFAULT, 1e12, CAPABILITIES)
    need = sorted(p.memory_bytes for r, p in base.ranked if r.p == 2)
    for limit in (need[len(need) // 2], need[-1]):  # the held limit is the least over v = 1 and 2's placements
        plan = plan_local(local_run(CFG), 2, CPU_DEFAULT, limit, CAPABILITIES)
        auto = [(r, p) for r, p in plan.ranked if r.schedule == "auto"]
        assert auto and all(p.memory_bytes <= limit for _, p in auto)
        for run, _ in auto[:3]:
            cfg, _ = resolve_schedule(_config(CFG, run))
            assert cfg.chunks == run.v
            assert run_schedule(cfg).actions == layout_schedule(run, CPU_DEFAULT).actions


def test_why_the_schedule_by_hand():
    from modelpar.costmodel.local import LocalPrediction
    from modelpar.costmodel.local_search import LocalPlan, why_schedule

    one = dataclasses.replace(local_run(CFG), t=1, p=2, d=1)
    zbv = dataclasses.replace(one, schedule="zb-v", v=2)
    pred = {"1f1b": LocalPrediction(0.010, 0.25, {}, busiest=(0, 2**20)),
            "zb-v": LocalPrediction(0.008, 0.0625, {}, busiest=(0, 1.5 * 2**20))}
    plan = LocalPlan([(zbv, pred["zb-v"]), (one, pred["1f1b"])], None, 2)
    assert why_schedule(plan, zbv, pred["zb-v"]) == ("zb-v, v=2: 6.2% bubble vs 1f1b 25.0%, step 8.00 vs 10.00 ms, "
                                                     "busiest rank 1.50 vs 1.00 MiB")
    assert why_schedule(plan, one, pred["1f1b"]).startswith("1f1b: no schedule of the family, nor auto, is faster")
    alone = LocalPlan([(zbv, pred["zb-v"])], None, 1)
    assert why_schedule(alone, zbv, pred["zb-v"]) == "zb-v, v=2: 6.2% bubble; 1f1b does not fit the limit at this layout"


def test_a_limit_only_context_parallelism_meets(monkeypatch):
    """One head, one layer, one sequence, 2 ranks: t, p and d cannot split it, so cp = 2 (each rank s/2 tokens,
    ZeRO-1 over the 2 ranks) is the only layout, and under the limit it recomputes; without cp nothing splits it.
    (With the whole logits kept, cp = 2 also beat the leanest d = 2 layout at batch 2; the chunked loss keeps
    no logits, and there d = 2 under ZeRO-3 is leaner.)"""
    cfg = dataclasses.replace(CFG, model=ModelConfig(hidden=32, heads=1, layers=1, seq_len=256), batch_size=1,
                              microbatches=1, memory_limit_gb=0.55e-3)
    offloaded, _, _ = auto_plan(cfg, 2)  # activation offload (issue 40) lets cp = 2 keep its layer's tensors on the host
    assert (offloaded.cp, offloaded.recompute, offloaded.offload_activations) == (2, "none", "all")
    monkeypatch.setattr("modelpar.training.autoplan.CAPABILITIES", dataclasses.replace(CAPABILITIES, offload=False))
    planned, pred, line = auto_plan(cfg, 2)
    assert (planned.cp, planned.cp_comm, planned.dp, planned.zero) == (2, "ring", 1, 1) and planned.check(2) is planned
    assert planned.recompute == "full" and pred.memory_bytes <= 0.55e6 and "t=1 cp=2 (ring) p=1 d=1" in line
    monkeypatch.setattr("modelpar.training.autoplan.CAPABILITIES", dataclasses.replace(CAPABILITIES, cp_comms=(),
                                                                                        offload=False))
    with pytest.raises(ValueError, match=r"no layout the trainer runs splits this model on 2 ranks \(batch 1"):
        auto_plan(cfg, 2)


def test_given_layout_flags_are_pins():
    """Issue 35 #9: --tp 2 --pp 2 --schedule zb-v (or --cp 2) with --plan auto are kept, the rest is searched."""
    cfg, _, line = auto_plan(dataclasses.replace(CFG, schedule="zb-v", chunks=2), 4, {"tp", "pp", "schedule"})
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.schedule, cfg.chunks) == (2, 2, 1, "zb-v", 2)
    assert "layouts with --tp 2 --pp 2 --schedule zb-v kept fit" in line and "schedule as given (--schedule)" in line
    free, _, _ = auto_plan(dataclasses.replace(CFG, cp=2), 4)
    assert free.cp != 2  # unpinned, the planner's choice differs: the pin below is what keeps it
    cfg, _, line = auto_plan(dataclasses.replace(CFG, cp=2), 4, {"cp"})
    assert cfg.cp == 2 and cfg.dims.world_size == 4 and "with --cp 2 kept" in line


def test_pins_that_no_layout_meets_are_named(capsys):
    code = main(["train", "--plan", "auto", "--plan-ranks", "4", "--tp", "2", "--pp", "2", "--schedule", "zb-v",
                 "--memory-limit-gb", "0.0001", "--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16",
                 "--batch-size", "8", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "on 4 ranks with --tp 2 --pp 2 --schedule zb-v kept: the leanest (t=2 p=2 d=1, zb-v" in err


@pytest.mark.parametrize("flags, message", [
    (["--stage-layers", "1,3"], "--stage-layers 1,3 with --plan auto: the planner prices the default split"),
    (["--schedule", "auto", "--memory-limit", "4"], "--memory-limit 4 with --plan auto"),
])
def test_settings_the_planner_does_not_price_are_refused(tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    code = main(["train", "--plan", "auto", *flags, "--layers", "4", "--hidden", "32", "--heads", "4",
                 "--seq-len", "16", "--batch-size", "8", "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and not out.exists()


def test_plan_ranks_needs_plan_auto(capsys):
    assert main(["train", "--plan-ranks", "8", "--no-progress"]) == 2
    assert "plan_ranks 8 applies to plan auto" in capsys.readouterr().err
