"""Micro-batch sizing (§2.4): the step-time formula, M*, the α + β·b fit, the table and its CLI."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpar.bench import (
    fit_linear,
    measure_stage_times,
    microbatch_table,
    optimal_microbatches,
    predicted_step_time,
)
from modelpar.bench import microbatch as microbatch_module
from modelpar.cli import main


def test_exercise_3_of_the_reference():
    """K = 4, t(b) = 0.2 + 0.01·b ms, backward = 2 × forward, N = 1024: 58.0, 72.4, 47.9 ms and M* ≈ 12.4."""
    assert round(predicted_step_time(0.2, 0.01, 1024, 4, 4), 1) == 58.0
    assert round(predicted_step_time(0.2, 0.01, 1024, 4, 64), 1) == 72.4
    assert round(predicted_step_time(0.2, 0.01, 1024, 4, 16), 1) == 47.9
    assert round(optimal_microbatches(0.2, 0.01, 1024, 4), 1) == 12.4
    assert predicted_step_time(0.2, 0.01, 1024, 4, 4, backward_ratio=0) == pytest.approx(58.0 / 3, abs=0.02)


@settings(max_examples=50, deadline=None)
@given(st.floats(1e-3, 10), st.floats(1e-4, 1), st.integers(8, 4096), st.integers(2, 16))
def test_m_star_is_where_the_integer_step_time_is_smallest(alpha, beta, batch, stages):
    m_star = optimal_microbatches(alpha, beta, batch, stages)
    best = min(range(1, batch + 1), key=lambda m: predicted_step_time(alpha, beta, batch, stages, m))
    assert math.floor(m_star) <= best <= math.ceil(m_star) or (best == batch and m_star > batch)


def test_one_stage_wants_one_microbatch():
    assert optimal_microbatches(1.0, 1.0, 100, 1) == 1.0  # no bubble to fill: the fewest microbatches


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_a_known_line(relative):
    rows = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    fit = fit_linear(rows, [70e-6 + 3e-6 * b for b in rows], relative=relative)
    assert fit.alpha == pytest.approx(70e-6, rel=1e-9)
    assert fit.beta == pytest.approx(3e-6, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    assert fit(100) == pytest.approx(370e-6, rel=1e-9)


def test_fit_with_proportional_noise_stays_close_and_reports_it():
    rng = random.Random(0)
    rows = [2**i for i in range(10)]
    times = [(60e-6 + 2e-6 * b) * (1 + rng.uniform(-0.03, 0.03)) for b in rows]
    fit = fit_linear(rows, times)
    assert fit.alpha == pytest.approx(60e-6, rel=0.05)
    assert fit.beta == pytest.approx(2e-6, rel=0.05)
    assert 0.99 < fit.r2 < 1.0


@settings(max_examples=50, deadline=None)
@given(st.floats(1e-6, 1e-2), st.floats(1e-8, 1e-4), st.lists(st.integers(1, 4096), min_size=2, max_size=12, unique=True))
def test_fit_is_exact_on_any_line(alpha, beta, rows):
    fit = fit_linear(rows, [alpha + beta * b for b in rows])
    assert fit.alpha == pytest.approx(alpha, rel=1e-6, abs=1e-15)
    assert fit.beta == pytest.approx(beta, rel=1e-6)


class FakeClock:
    """Stands in for perf_counter; the fake stage advances it by α + β·rows per call."""

    def __init__(self, alpha: float, beta: float) -> None:
        self.now, self.alpha, self.beta = 0.0, alpha, beta

    def __call__(self) -> float:
        return self.now

    def stage(self, rows: int) -> None:
        self.now += self.alpha + self.beta * rows


def test_table_on_a_stage_with_known_cost(monkeypatch):
    clock = FakeClock(alpha=80e-6, beta=4e-6)
    monkeypatch.setattr(microbatch_module, "perf_counter", clock)
    scan = microbatch_table(clock.stage, lambda b: b, batch=1024, stages=4, microbatch_counts=[1, 4, 16, 64, 256])
    assert [(r.microbatches, r.rows) for r in scan.rows] == [(1, 1024), (4, 256), (16, 64), (64, 16), (256, 4)]
    for r in scan.rows:
        assert r.stage_time == pytest.approx(80e-6 + 4e-6 * r.rows, rel=1e-9)
        assert r.measured_step == pytest.approx(3 * (r.microbatches + 3) * r.stage_time, rel=1e-12)
        assert r.predicted_step == pytest.approx(r.measured_step, rel=1e-9)
    assert scan.fit.alpha == pytest.approx(80e-6, rel=1e-6) and scan.fit.beta == pytest.approx(4e-6, rel=1e-6)
    assert scan.m_star == pytest.approx(math.sqrt(3 * 4e-6 * 1024 / 80e-6), rel=1e-6)  # 12.4
    assert scan.best_measured.microbatches == 16
    text = scan.format()
    assert "fit t(b) = 80.0 us + 4.000 us * b" in text and "M* = sqrt((K - 1) * beta * N / alpha) = 12.4" in text
    assert "16      64" in text.splitlines()[4] and "fastest measured" in text.splitlines()[4]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fit_linear([1, 2], [1.0]), "rows and times must have the same length, got 2 and 1"),
        (lambda: fit_linear([3, 3], [1.0, 2.0]), "rows must hold at least two distinct values"),
        (lambda: fit_linear([1, 2], [1.0, 0.0]), "times must all be > 0"),
        (lambda: optimal_microbatches(0.0, 1.0, 10, 2), "alpha must be > 0.0, got 0.0"),
        (lambda: predicted_step_time(1.0, 1.0, 10, 2, 11), "microbatches must be <= 10, got 11"),
        (lambda: predicted_step_time(1.0, 1.0, 10, 0, 1), "stages must be >= 1, got 0"),
        (lambda: microbatch_table(abs, abs, 8, 2, [1, 16]), r"microbatch_counts\[1\] must be <= 8, got 16"),
        (lambda: microbatch_table(abs, abs, 8, 2, [2, 2]), "at least two different micro-batch sizes"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.fixture
def synthetic_times(monkeypatch):
    """The CLI's plumbing without the machine's noise: every stage costs 50 us + 2 us per row."""
    monkeypatch.setattr(microbatch_module, "measure_stage_times",
                        lambda stage, rows, make_input, repeats: [50e-6 + 2e-6 * b for b in rows])


def test_measure_stage_times_runs_the_stage_on_each_size():
    seen = []

    def stage(x):  # at least 1 ms per row: a lower bound on each measured time that no clock can break
        seen.append(x.shape[0])
        time.sleep(1e-3 * x.shape[0])

    times = measure_stage_times(stage, [3, 1, 7], lambda b: torch.zeros(b, 2), repeats=2, min_seconds=0.0)
    assert len(times) == 3 and all(t >= 1e-3 * rows for t, rows in zip(times, [3, 1, 7]))
    assert seen == [3] * 3 + [1] * 3 + [7] * 3  # a warm-up call, then one call per repeat


def test_cli_prints_the_table(capsys, synthetic_times):
    assert main(["bench", "microbatch", "--batch", "256", "--hidden", "16", "--repeats", "2",
                 "--max-microbatches", "16", "--stages", "3"]) == 0
    out = capsys.readouterr().out
    assert "K = 3 stages, batch N = 256 rows" in out and "M* = sqrt((K - 1) * beta * N / alpha)" in out
    assert [line.split()[:2] for line in out.splitlines()[3:8]] == [["1", "256"], ["2", "128"], ["4", "64"],
                                                                    ["8", "32"], ["16", "16"]]
    assert "fit t(b) = 50.0 us + 2.000 us * b" in out
    assert f"M* = sqrt((K - 1) * beta * N / alpha) = {math.sqrt(2 * 2 * 256 / 50):.1f}" in out  # 4.5


def test_cli_loads_a_users_stage(tmp_path, monkeypatch, capsys, synthetic_times):
    (tmp_path / "my_stage.py").write_text(
        "import torch\n"
        "def make(hidden):\n    return torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.ReLU())\n"
        "wrong_shape = torch.nn.Linear(3, 3)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "microbatch", "--stage", "my_stage:make", "--hidden", "32", "--batch", "128",
                 "--repeats", "2", "--max-microbatches", "8"]) == 0
    assert "stage: my_stage:make" in capsys.readouterr().out
    assert main(["bench", "microbatch", "--stage", "my_stage:wrong_shape"]) == 2
    assert "--stage 'my_stage:wrong_shape' fails on a (1, 128) input" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "0"], "--stages must be >= 1, got 0"),
        (["--batch", "1"], "--batch must be >= 2, got 1"),
        (["--stage", "no_colon"], "--stage must look like 'package.module:attr'"),
        (["--stage", "no_such_module_xyz:f"], "--stage 'no_such_module_xyz:f' cannot be loaded"),
        (["--stage", "math:pi"], "--stage 'math:pi' must be an nn.Module or return one, got float"),
    ],
)
def test_cli_bad_flags_exit_2_with_one_line(argv, message, capsys):
    assert main(["bench", "microbatch", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
