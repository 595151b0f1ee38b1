"""Published runs: a fit set (a parameter was fitted on them) and a test set, reported separately by `plan --validate`."""

import json

from modelpar.cli import main
from modelpar.costmodel.published import ENGINE, GRID, PUBLISHED, mean_abs_error, validate


def test_every_run_is_in_one_set_named_by_what_was_fitted():
    assert {r.split for r in PUBLISHED} == {"fit", "test"}
    assert all((r.split == "fit") == bool(r.fitted) for r in PUBLISHED)
    assert {r.fitted for r in PUBLISHED if r.fitted} == {GRID, ENGINE}  # the two fitted parameter sets
    assert sum(r.split == "test" for r in PUBLISHED) == 14  # 13 dense + DeepSeek-V3


def test_validate_reports_the_two_sets_apart(capsys):
    assert main(["plan", "--validate"]) == 0
    head = capsys.readouterr().out.splitlines()[:2]
    rows = validate()
    test = [r for r in rows if r.run.split == "test"]
    assert head[0].startswith("test set (held out, nothing fitted on them): "
                              f"{mean_abs_error(test):.1%} mean absolute step-time error over 14 runs")
    assert head[1].startswith("fit set (a parameter was fitted on them): ")
    assert main(["plan", "--validate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["set"] for r in data["runs"]} == {"fit", "test"}
    assert all((r["set"] == "fit") == bool(r["fitted"]) for r in data["runs"])
