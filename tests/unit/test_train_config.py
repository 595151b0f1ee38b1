"""TrainConfig checks, the learning-rate schedule and the checkpoint metadata rules (no processes)."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from modelpar.corpus import rank_batch
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig, lr_at
from modelpar.training.config import default_microbatches
from modelpar.training.state import check_meta, init_optimizer_state, resumed_config, run_meta


def test_lr_schedule_hand_checked():
    cfg = TrainConfig(lr=1.0, warmup=4, steps=104)
    assert [lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 54) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert lr_at(cfg, 104) == pytest.approx(0.1) and lr_at(cfg, 500) == pytest.approx(0.1)


@given(st.integers(0, 50), st.integers(1, 400), st.integers(0, 500))
def test_lr_stays_within_its_bounds(warmup, steps, step):
    cfg = TrainConfig(lr=3e-3, warmup=warmup, steps=steps)
    low = 0.0 if step < warmup else 0.1 * 3e-3 - 1e-15  # warm-up rises from lr/warmup; decay ends at lr/10
    assert low < lr_at(cfg, step) <= 3e-3 + 1e-15
    if step + 1 < warmup:
        assert lr_at(cfg, step) < lr_at(cfg, step + 1)


@given(st.integers(1, 8), st.integers(1, 6), st.booleans(), st.booleans())
def test_replica_rows_tile_the_global_batch(dp, rows_per_replica, first, last):
    x = torch.arange(dp * rows_per_replica * 3).view(-1, 3)
    parts = [rank_batch(x, x + 1, dp_rank=r, dp=dp, first_stage=first, last_stage=last) for r in range(dp)]
    if first:
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
    if last:
        assert torch.equal(torch.cat([p[1] for p in parts]), x + 1)
    assert all((p[0] is None) != first and (p[1] is None) != last for p in parts)


@pytest.mark.parametrize("changes, message", [
    ({"schedule": "interleaved", "chunks": 1}, "chunks must be >= 2, got 1"),
    ({"chunks": 2}, r"chunks must be 1 for schedule '1f1b' \(only 'interleaved', 'looped-bfs' take a chunks count\), "
                    r"got 2"),
    ({"schedule": "zb-v"}, r"chunks must be 2 for schedule 'zb-v' \(a V: two stages per rank\), got 1"),
    ({"schedule": "interleaved", "chunks": 2, "microbatches": 3, "batch_size": 12},
     r"microbatches \(3\) must be divisible by pp \(2\)"),
    ({"recompute": "3"}, "recompute must be <= 2, got 3"),  # 4 layers over p = 2 stages
    ({"dp": 3}, r"batch_size \(16\) must be divisible by dp \(3\)"),
    ({"lr": 0.0}, "lr must be > 0.0, got 0.0"),
    ({"precision": "fp16"}, r"precision 'fp16' is not supported: fp16 needs loss scaling"),
    ({"precision": "float64"}, r"precision must be one of \{fp32, bf16, fp8, fp64\}, got 'float64'"),
    ({"zero": 4}, r"zero must be one of \{0, 1, 2, 3\}, got 4"),
    ({"zero": 2}, r"zero 2 shards over the data-parallel replicas and needs dp >= 2, got dp 1"),
    ({"bucket_mb": 0.0}, "bucket_mb must be > 0.0, got 0.0"),
    ({"exit_after": -1}, "exit_after must be >= 0, got -1"),
    ({"tp": 0}, "tp must be >= 1, got 0"),
])
def test_bad_settings_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        replace(TrainConfig(), **changes).check()


def test_world_size_and_round_trip():
    cfg = TrainConfig(tp=2, pp=2, dp=2, model=ModelConfig(hidden=64, tie_embeddings=True))
    assert cfg.check(8) is cfg and cfg.tokens_per_step == 16 * 64
    with pytest.raises(ValueError, match=r"= 8 must equal the number of processes \(world size 4\)"):
        cfg.check(4)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_checkpoint_metadata_rules():
    cfg = TrainConfig()
    meta = run_meta(cfg, 10, [5.0, 4.0])
    check_meta(meta, replace(cfg, schedule="gpipe", microbatches=8), "ck")  # the same gradients: may differ
    check_meta(meta, replace(cfg, tp=1, pp=4, dp=2, schedule="interleaved", chunks=2), "ck")  # any split
    with pytest.raises(ValueError, match=r"different model: heads, hidden differ \(checkpoint \[4, 128\], this run \[8, 256\]\)"):
        check_meta(meta, replace(cfg, model=ModelConfig(hidden=256, heads=8)), "ck")
    for key, value in (("seed", 1), ("batch_size", 32), ("precision", "fp64")):
        with pytest.raises(ValueError, match=f"written with {key}="):
            check_meta(meta, replace(cfg, **{key: value}), "ck")
    check_meta(meta, replace(cfg, zero=1, overlap_grad_reduce=False, bucket_mb=1.0), "ck")  # layout, not arithmetic
    legacy = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "precision"} | {"dtype": "float64"}}
    assert TrainConfig.from_dict(legacy["config"]).precision == "fp64"  # configs written before precision
    with pytest.raises(ValueError, match="written with precision='fp64', this run has precision='fp32'"):
        check_meta(legacy, cfg, "ck")


def test_prefilled_adamw_state_steps_like_lazy_state():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    init_optimizer_state(opt_b)
    assert all(float(s["step"]) == 0.0 for s in opt_b.state.values())
    for _ in range(3):
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            m(torch.ones(4, 3, dtype=torch.float64)).pow(2).sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not math.isnan(float(next(iter(opt_b.state.values()))["step"]))


@pytest.mark.parametrize("change", [{"lr": 1e-3}, {"warmup": 3}, {"clip": 0.5}, {"weight_decay": 0.0},
                                    {"steps": 400}])
def test_resume_refuses_changed_optimisation_settings(change):
    cfg = TrainConfig()
    check_meta(run_meta(cfg, 10, []), cfg, "ckpt")  # the same settings resume
    (key, value), = change.items()
    with pytest.raises(ValueError, match=rf"written with {key}=.*this run has {key}={value!r}"):
        check_meta(run_meta(cfg, 10, []), replace(cfg, **change), "ckpt")


def test_resume_takes_what_the_flags_leave_out_from_the_checkpoint():
    written = TrainConfig(model=ModelConfig(hidden=64, heads=2, layers=6), tp=1, pp=3, seed=5, lr=1e-3, steps=50)
    meta = run_meta(written, 20, [4.0])
    now = resumed_config(replace(TrainConfig(), tp=2, pp=2, lr=2e-3), meta, given={"tp", "pp", "lr"})
    assert now.model == written.model and (now.seed, now.steps) == (5, 50)  # from the checkpoint
    assert (now.tp, now.pp, now.lr) == (2, 2, 2e-3)  # from the flags: the split is free, lr is then refused
    with pytest.raises(ValueError, match=r"written with lr=0.001, this run has lr=0.002"):
        check_meta(meta, now, "ck")
    assert resumed_config(TrainConfig(), meta, given={"heads"}).model == replace(written.model, heads=4)


@pytest.mark.parametrize("changes, m, why", [
    ({"pp": 1}, 1, "p = 1: no pipeline to fill"),
    ({}, 4, "bubble <= 25% of the ideal compute"),  # p = 2: 4(p - 1), the bubble 1/(4 + 1) = 20% of the step
    ({"pp": 4, "batch_size": 24}, 12, "bubble <= 25%"),  # 4(p - 1) = 12 divides the 24 rows
    ({"pp": 4}, 16, "dividing the per-replica batch 16"),  # 12 does not divide 16: the next divisor
    ({"pp": 4, "batch_size": 8}, 8, "would be 12: capped by the per-replica batch 8"),
    ({"pp": 2, "schedule": "interleaved", "chunks": 2}, 2, "bubble <= 25%"),  # (p - 1)/(v·m) = 1/4
    ({"pp": 4, "schedule": "interleaved", "chunks": 2, "batch_size": 32}, 8, "bubble <= 25%"),  # a multiple of p
])
def test_default_microbatches_fill_the_pipeline_and_fit_the_batch(changes, m, why):
    cfg = TrainConfig(**changes)
    assert cfg.microbatches == m and default_microbatches(cfg) == (m, default_microbatches(cfg)[1])
    assert why in default_microbatches(cfg)[1]
    assert replace(cfg, microbatches=3).microbatches == 3  # a set m stays
    assert replace(cfg, microbatches=0, pp=1).microbatches == 1  # 0 chooses again for the new split


def test_no_microbatch_default_at_one_process_from_the_cli():
    from modelpar.cli import build_parser
    from modelpar.commands.train import build_config

    cfg = build_config(build_parser().parse_args(["train", "--tp", "1", "--pp", "1"]))
    assert cfg.microbatches == 1  # issue 21 §6: 4 micro-batches at (1, 1, 1) cost 15%
    cfg = build_config(build_parser().parse_args(["train", "--pp", "4", "--tp", "1", "--batch-size", "24"]))
    assert cfg.microbatches == 12


def test_check_runs_once_per_value(monkeypatch):
    """The settings of a (frozen) config are checked once; a replaced or pickled copy as its value says."""
    import pickle

    calls = []
    real = TrainConfig._check_settings
    monkeypatch.setattr(TrainConfig, "_check_settings", lambda self: (calls.append(1), real(self))[1])
    cfg = TrainConfig()
    assert cfg.check() is cfg and cfg.check() is cfg and cfg.check(cfg.dims.world_size) is cfg
    assert len(calls) == 1
    pickle.loads(pickle.dumps(cfg)).check(cfg.dims.world_size)  # a rank's copy: only the world size is new
    assert len(calls) == 1
    replace(cfg, steps=3).check()
    assert len(calls) == 2
    with pytest.raises(ValueError, match="world"):
        cfg.check(cfg.dims.world_size + 1)
    with pytest.raises(ValueError, match="steps"):
        replace(cfg, steps=0).check()
    with pytest.raises(ValueError, match="steps"):  # a failed check is not remembered
        replace(cfg, steps=0).check()


def test_result_fields_are_listed_once():
    """The step event and summary.json take the result's fields from one list each, every name a real field."""
    from modelpar.training.loop import STEP_FIELDS, SUMMARY_FIELDS, TrainResult

    result = TrainResult(3)
    assert set(STEP_FIELDS) <= set(SUMMARY_FIELDS)
    assert result.fields(SUMMARY_FIELDS)["start_step"] == 3 and len(result.fields(SUMMARY_FIELDS)) == len(SUMMARY_FIELDS)
