"""Activation offload on the command line: the summary shows the offloaded bytes, predicted and measured."""

import json

from modelpar.cli import main


def test_the_summary_shows_offloaded_bytes(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--tp", "1", "--pp", "1",
                 "--steps", "2", "--batch-size", "4", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
                 "--offload-activations", "all", "--out", str(out)])
    assert code == 0
    assert "predicted / measured offloaded" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert abs(summary["prediction"]["offloaded_bytes"]["error"]) <= 0.05
    assert abs(summary["prediction"]["activations_bytes"]["error"]) <= 0.05
