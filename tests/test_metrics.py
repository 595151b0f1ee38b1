"""metrics.jsonl and TensorBoard: what the loop's events become on disk."""

import json
import sys

import pytest
import torch

from modelpar.cli import main
from modelpar.training.metrics import MetricsLog, Reporters, peak_memory_mb


def events(start, stop, eval_every=2):
    for step in range(start + 1, stop + 1):
        yield {"event": "step", "step": step, "loss": 5.0 - step / 10, "lr": 1e-3, "grad_norm": 0.5,
               "tokens_per_s": 1000.0, "step_time": 0.1, "peak_memory_mb": 100.0}
        if step % eval_every == 0:
            yield {"event": "eval", "step": step, "val_loss": 4.0, "val_bpb": 1.5}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_line_per_step_and_per_evaluation_and_a_resume_keeps_each_step_once(tmp_path):
    log = MetricsLog(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing before the run starts
    seen = []
    report = Reporters(log, None, seen.append)
    report({"event": "start", "start_step": 0, "steps": 6})
    for e in events(0, 5):  # steps 1..5 logged, then the run dies; its last checkpoint is step 4
        report(e)
    assert len(seen) == 1 + 5 + 2
    log({"event": "start", "start_step": 4, "steps": 6})
    for e in events(4, 6):
        log(e)
    log({"event": "done"})
    got = lines(tmp_path / "out" / "metrics.jsonl")
    assert [(g["event"], g["step"]) for g in got] == [("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("step", 4),
                                                    ("eval", 4), ("step", 5), ("step", 6), ("eval", 6)]
    assert set(got[0]) == {"event", "step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time", "peak_memory_mb"}
    log({"event": "start", "start_step": 0, "steps": 6})  # a fresh run starts a fresh file
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == ""


def test_tensorboard_gets_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, tensorboard=True)
    log({"event": "start", "start_step": 0, "steps": 4})
    for e in events(0, 4):
        log(e)
    log({"event": "done"})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "step/loss" in acc.Tags()["scalars"] and "eval/val_bpb" in acc.Tags()["scalars"]
    assert [(s.step, round(s.value, 6)) for s in acc.Scalars("step/loss")] == [(1, 4.9), (2, 4.8), (3, 4.7), (4, 4.6)]
    assert [s.step for s in acc.Scalars("eval/val_loss")] == [2, 4]


def test_tensorboard_missing_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    assert main(["train", "--tensorboard", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "modelpar train: error: --tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'"
    assert not (tmp_path / "out").exists()


def test_peak_memory_is_measured_on_the_cpu():
    assert 10 < peak_memory_mb(torch.device("cpu")) < 1e6  # this process's peak resident set, in MiB
