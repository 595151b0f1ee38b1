"""The accuracy table (``modelpar plan --validate``): every published run is a plan command line, the error on
the runs nothing was fitted on stays within the issue's bounds, and the fitted runs are labelled as fits."""

import json
import shlex

import pytest

from modelpar.cli import main
from modelpar.costmodel.published import ENGINE, GRID, PUBLISHED, mean_abs_error, validate
from modelpar.costmodel.report import accuracy_summary


@pytest.fixture(scope="module")
def rows():
    return validate()


def test_every_published_run_is_a_plan_command_line_and_validate_runs_it_that_way(rows, capsys):
    assert len(rows) == len(PUBLISHED) == 32
    for r in rows:
        assert main(["plan", *shlex.split(r.run.command), "--json", "--top", "1"]) == 0
        best = json.loads(capsys.readouterr().out)[0]
        assert best["step_time_s"] == r.best.step_time_s  # the same code path, the same answer
        c = r.best.config
        assert (best["t"], best["p"], best["d"], best["v"], best["zero"]) == (c.t, c.p, c.d, c.v, c.zero)


def test_held_out_runs_within_5_percent_on_average_and_10_percent_each(rows):
    held = [r for r in rows if not r.run.fitted and not r.run.unmodelled]
    assert len(held) == 13  # SC'21 Table 2 PTD-P ×6, Korthikanti full recomputation ×4, BLOOM, Llama 3 ×2
    assert mean_abs_error(held) <= 0.05
    worst = max(held, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.10, (worst.run.name, worst.error)


def test_many_stage_megatron_runs_held_out(rows):
    # the runs the model was too slow on (p = 8-64, d = 1, hundreds of microbatches): within 10%, mean within 6%
    korthikanti = [r for r in rows if r.run.name.startswith("Korthikanti") and "full" in r.run.name]
    assert [r.best.config.p for r in korthikanti] == [1, 8, 35, 64]
    assert all(abs(r.error) <= 0.07 for r in korthikanti)
    assert mean_abs_error(korthikanti) <= 0.05


def test_fit_residuals_on_the_runs_the_parameters_were_fitted_on(rows):
    # fits, not accuracy: DEFAULT's GEMM curve and latency were fitted on SC'21 Table 1 and Korthikanti's
    # SP + selective MFU, DeepSpeed's engine overhead on MT-NLG; these bound how well the fit reproduces them
    grid = [r for r in rows if r.run.fitted == GRID]
    engine = [r for r in rows if r.run.fitted == ENGINE]
    assert (len(grid), len(engine)) == (15, 3)
    assert mean_abs_error(grid) <= 0.04 and max(abs(r.error) for r in grid) <= 0.10
    assert mean_abs_error(engine) <= 0.04 and max(abs(r.error) for r in engine) <= 0.07


def test_validate_prints_the_table_with_fits_marked_and_errors_per_source(capsys):
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "Korthikanti 1T, full recompute" in out and "s/step" in out and "BLOOM 176B, 384 GPUs" in out
    assert "held out (nothing fitted on them)" in out and f"{GRID}: 15 runs" in out and f"{ENGINE}: 3 runs" in out
    assert main(["plan", "--validate", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert len(table["runs"]) == 32 and all(r["command"].startswith("modelpar plan --") for r in table["runs"])
    summary = accuracy_summary(validate())
    assert table["mean_abs_error"] == pytest.approx(summary)
    assert set(summary) >= {"held out (nothing fitted on them)", "fitted", "all", "Korthikanti et al. 2022 Tables 3, 5"}


def test_deepseek_v3_is_held_out_and_reported_not_bounded(rows):
    """The MoE run is in the test set with what the model does not price named; its error is what it is (the
    all-to-alls priced exposed where DualPipe hides them, 16-bit GEMMs where it ran FP8): reported, not bounded."""
    (ds,) = [r for r in rows if r.run.name.startswith("DeepSeek-V3")]
    assert ds.run.split == "test" and "MLA" in ds.run.unmodelled and "FP8" in ds.run.unmodelled
    c = ds.best.config
    assert (c.t, c.p, c.d, c.ep, c.zero) == (1, 16, 128, 64, 1)
    assert ds.best.time["ep"] > 0 and ds.error > 0  # slower than the run: nothing it hides is hidden here
