"""``modelpar plan --validate-local``: the grid, the arithmetic of the report, and two real runs (no timings asserted)."""

import dataclasses
import statistics

import pytest

from modelpar.calibrate.validate_local import (
    LocalCase,
    cases,
    format_report,
    repeatability,
    spread,
    summarise,
    validate_local,
)
from modelpar.cli import main
from modelpar.costmodel.presets import CPU_DEFAULT


def test_the_grid_on_two_cores():
    grid = cases([1, 2, 4], cores=2)
    per_core = [c for c in grid if not c.shared]
    assert len(per_core) >= 12 and all(c.cfg.dims.world_size <= 2 for c in per_core)
    # every split of 1 and 2 ranks, both model sizes, both recomputations, m = 2 and 4
    assert {(c.cfg.tp, c.cfg.pp, c.cfg.dp) for c in per_core} == {(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert {c.model for c in per_core} == {"h64", "h128"} and {c.cfg.recompute for c in per_core} == {"none", "full"}
    assert {c.cfg.schedule for c in per_core if c.cfg.pp > 1} == {"1f1b", "gpipe"}
    assert {(c.model, c.cfg.microbatches) for c in per_core if c.cfg.cp == 2} == {(m, n) for m in ("h64", "h128")
                                                                                for n in (2, 4)}
    shared = [c for c in grid if c.shared]
    assert {(c.cfg.tp, c.cfg.pp, c.cfg.dp) for c in shared} == {(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1),
                                                                 (4, 1, 1)}
    assert {c.cfg.schedule for c in shared if c.cfg.pp > 1} == {"1f1b", "gpipe"} and len(shared) == 9
    assert len({c.name for c in grid}) == len(grid)


def _case(name, world, predicted, measured, shared=False):
    cfg = next(c.cfg for c in cases([world], 2) if c.cfg.dims.world_size == world)
    return LocalCase(name, dataclasses.replace(cfg, microbatches=2 if predicted > 0.15 else 4), shared,
                     {"step_time_s": predicted, "bubble": 0.1, "parameters_bytes": 100.0},
                     {"step_time_s": measured, "bubble": 0.2, "parameters_bytes": 100.0})


def test_summary_arithmetic_hand_checked():
    done = [_case("a", 1, 0.11, 0.10), _case("a", 1, 0.18, 0.20), _case("a", 4, 0.3, 0.2, shared=True)]
    s = summarise(done)
    assert s["step_mape"] == pytest.approx((0.1 + 0.1) / 2) and s["step_mape_shared"] == pytest.approx(0.5)
    assert s["configurations"] == 3 and s["one_rank_per_core"] == 2 and s["worst_memory_error"] == 0.0
    pick = next(p for p in s["picks"] if p["ranks"] == 1)
    assert pick["pick_over_fastest"] == 0.0  # the least predicted (0.11) is the fastest measured (0.10)
    report = format_report(done, CPU_DEFAULT)
    assert "step-time MAPE: 10.0% over 2 configurations" in report and "50.0% over the 1 with shared cores" in report


def test_the_measurements_own_noise_hand_checked():
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.5 - 1.5) / 3.0)  # quartiles of 5 (exclusive)
    assert spread([0.2, 0.2, 0.2]) == 0.0 and spread([0.3]) == 0.0
    a, b = _case("a", 1, 0.11, 1.0), _case("a", 1, 0.18, 2.0)
    a.round_steps, b.round_steps = [1.0, 1.2, 0.8], [2.0, 2.0]  # a: 0, 20%, 20% off its median; b: none
    assert repeatability([a, b]) == pytest.approx(0.4 / 5)
    assert repeatability([_case("a", 1, 0.1, 0.1)]) is None  # one round: nothing to compare
    a.measured["step_spread"] = 0.25
    s = summarise([a, b])
    assert s["repeatability"] == pytest.approx(0.08) and s["step_spread"] == 0.25
    assert "its rounds 8.0% from their median" in format_report([a, b], CPU_DEFAULT)


def test_real_runs_go_round_the_process_counts_and_have_exact_state_bytes():
    """Two rounds of two one-rank cases and a two-rank one: each round runs every process count in turn."""
    events = []
    todo = [c for c in cases([1], 2) if c.model == "h64"][:2] + [
        next(c for c in cases([2], 2) if c.model == "h64" and c.cfg.dp == 2)]
    done = validate_local(todo, CPU_DEFAULT, lambda c: events.append(c.cfg.dims.world_size), rounds=2)
    assert events == [1, 1, 2] * 2
    for c in done:
        assert c.measured["step_time_s"] == statistics.median(c.round_steps) > 0 and len(c.round_steps) == 2
        assert c.measured["step_spread"] >= 0
        for key in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
            assert c.predicted[key] == c.measured[key]
        assert c.predicted["activations_bytes"] == pytest.approx(c.measured["activations_bytes"], rel=0.1)


def test_bad_input(capsys):
    for args, message in ((["--local-ranks", "0"], "--local-ranks must be >= 1"),
                          (["--rounds", "0"], "--rounds must be >= 1"),
                          (["--gpu", "h100-sxm"], "use --hardware PROFILE")):
        assert main(["plan", "--validate-local", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
