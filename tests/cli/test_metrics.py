"""metrics.jsonl and TensorBoard: what the loop's events become on disk."""

import json
import sys

import pytest
import torch

from modelpar.cli import main
from modelpar.training.metrics import MetricsLog, Reporters, peak_memory_mb, read_metrics
from tests.cli.test_checkpoint_cli import TINY


def events(start, stop, eval_every=2):
    for step in range(start + 1, stop + 1):
        yield {"event": "step", "step": step, "loss": 5.0 - step / 10, "lr": 1e-3, "grad_norm": 0.5,
               "tokens_per_s": 1000.0, "step_time": 0.1, "peak_memory_mb": 100.0}
        if step % eval_every == 0:
            yield {"event": "eval", "step": step, "val_loss": 4.0, "val_bpb": 1.5}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(stop):
    return [5.0 - step / 10 for step in range(1, stop + 1)]


def test_one_line_per_step_and_per_evaluation_and_a_resume_keeps_each_step_once(tmp_path):
    log = MetricsLog(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing before the run starts
    seen = []
    report = Reporters(log, None, seen.append)
    report({"event": "start", "start_step": 0, "steps": 6, "losses": []})
    for e in events(0, 5):  # steps 1..5 logged, then the run dies; its last checkpoint is step 4
        report(e)
    assert len(seen) == 1 + 5 + 2
    log({"event": "start", "start_step": 4, "steps": 6, "losses": losses(4)})  # the checkpoint's losses: its own
    for e in events(4, 6):
        log(e)
    log({"event": "done"})
    got = lines(tmp_path / "out" / "metrics.jsonl")
    assert [(g["event"], g["step"]) for g in got] == [("start", 0), ("step", 1), ("step", 2), ("eval", 2), ("step", 3),
                                                    ("step", 4), ("eval", 4), ("start", 4), ("step", 5), ("step", 6),
                                                    ("eval", 6)]
    assert {g["run"] for g in got} == {log.run} and len(log.run) == 12  # one run, resumed
    assert set(got[1]) == {"event", "step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time", "peak_memory_mb",
                           "run"}
    assert set(got[0]) == {"event", "step", "steps", "started", "run"} and got[0]["steps"] == 6
    first = log.run
    log({"event": "start", "start_step": 0, "steps": 6, "losses": []})  # a fresh run starts a fresh file
    assert [(g["event"], g["run"]) for g in lines(tmp_path / "out" / "metrics.jsonl")] == [("start", log.run)]
    assert log.run != first


def test_a_resume_does_not_continue_another_runs_lines(tmp_path, capsys):
    """Run A stops at step 3; run B writes the same --out; A resumed: B's steps are not A's (issue 35 #6)."""
    a = MetricsLog(tmp_path)
    a({"event": "start", "start_step": 0, "steps": 6, "losses": []})
    for e in events(0, 3):
        a(e)
    b = MetricsLog(tmp_path)
    b({"event": "start", "start_step": 0, "steps": 2, "losses": []})
    for e in events(0, 3):
        b({**e, "loss": e.get("loss", 0) + 1})  # another model: other losses
    notes = []
    again = MetricsLog(tmp_path, note=notes.append)
    again({"event": "start", "start_step": 3, "steps": 6, "losses": losses(3)})
    for e in events(3, 6):
        again(e)
    got = lines(tmp_path / "metrics.jsonl")
    assert [(g["event"], g["step"]) for g in got] == [("start", 3), ("step", 4), ("eval", 4), ("step", 5),
                                                    ("step", 6), ("eval", 6)]
    assert {g["run"] for g in got} == {again.run} and again.run not in (a.run, b.run)
    assert notes == [f"warning: {str(tmp_path / 'metrics.jsonl')!r} held the metrics of another run ({b.run}), not "
                     "the steps 1-3 this run resumes after: it starts anew at step 4"]


@pytest.mark.parametrize("torn", [b'{"event": "step", "st', b'{"event": "ste\xc3', b"[1, "])
def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, torn):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event": "start", "step": 0, "run": "r"}\n{"event": "step", "step": 1, "run": "r"}\n' + torn)
    records, warning = read_metrics(tmp_path)
    assert [r["event"] for r in records] == ["start", "step"]
    assert warning == (f"dropped the last line of {str(path)!r} (line 3, {len(torn)} bytes), cut short by a crash "
                       "while it was written")
    path.write_bytes(path.read_bytes()[:-len(torn)])
    assert read_metrics(tmp_path) == (records, None)
    assert read_metrics(tmp_path / "none") == ([], None)


@pytest.mark.parametrize("line, why", [(b"[1, 2]", "is a JSON list, not an object"),
                                       (b'{"event": "step", "st', "is not JSON (Unterminated string starting at "
                                                                  "column 19)"),
                                       (b"\xff\xfe", "is not UTF-8 text"),
                                       (b'{"event": "step", "step": "1"}', "has no string 'event' or no whole-number "
                                                                           "'step'"),
                                       (b'{"step": 1}', "has no string 'event' or no whole-number 'step'")])
def test_a_bad_line_before_the_last_names_the_file_and_the_line(tmp_path, line, why):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"event": "start", "step": 0}\n' + line + b'\n{"event": "step", "step": 1}\n')
    with pytest.raises(ValueError) as err:
        read_metrics(tmp_path)
    assert str(err.value) == (f"metrics {str(path)!r} line 2 {why}: each line must be one JSON object with an "
                              "'event' and a whole-number 'step'; fix or delete the line, or give another --out")
    path.write_bytes(b'{"event": "start", "step": 0}\n' + line + b"\n")  # last, but whole (it ends the line)
    with pytest.raises(ValueError, match="line 2 "):
        read_metrics(tmp_path)


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


# --- on the command line: real runs into one --out ---------------------------------------------------------
def train(capsys, tmp_path, *flags):
    """``modelpar train`` (one rank, a tiny float64 model): (exit code, stderr lines, metrics records)."""
    code = main(["train", *TINY, "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("modelpar train: warning")]
    metrics = tmp_path / "out" / "metrics.jsonl"
    return code, err, lines(metrics) if metrics.exists() else []


def test_a_resume_continues_only_its_own_runs_metrics(capsys, tmp_path):
    """Issue 35 #6: run A stops at step 3, run B writes the same --out, A resumes twice (the second time
    after a crash tore the file's last line, #12): the file ends holding A's steps 4-6 once, under one
    run id, and the prediction is at step 6 of the 6-step run."""
    a = ["--steps", "6", "--checkpoint-dir", str(tmp_path / "a")]
    code, err, first = train(capsys, tmp_path, *a, "--exit-after", "3")
    assert code == 0 and err == [] and [(m["event"], m["step"]) for m in first][-3:] == [
        ("step", 3), ("eval", 3), ("prediction", 3)]
    code, err, other = train(capsys, tmp_path, "--steps", "2", "--lr", "0.01")  # run B, fresh: a new file
    assert code == 0 and [m["step"] for m in other if m["event"] == "step"] == [1, 2]
    assert len({m["run"] for m in first}) == len({m["run"] for m in other}) == 1 and other[0]["run"] != first[0]["run"]

    code, err, resumed = train(capsys, tmp_path, *a, "--resume", "--exit-after", "1")
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert code == 0 and err == [f"modelpar train: warning: {str(metrics)!r} held the metrics of another run "
                                 f"({other[0]['run']}), not the steps 1-3 this run resumes after: it starts anew at "
                                 "step 4"]
    assert [(m["event"], m["step"]) for m in resumed] == [("start", 3), ("step", 4), ("eval", 4), ("prediction", 4)]
    with open(metrics, "a") as f:
        f.write('{"event": "step", "step": 5, "lo')  # a crash mid-write
    code, err, done = train(capsys, tmp_path, *a, "--resume")
    assert code == 0 and err == [f"modelpar train: warning: dropped the last line of {str(metrics)!r} (line 5, 32 "
                                 "bytes), cut short by a crash while it was written"]
    assert [(m["event"], m["step"]) for m in done] == [("start", 3), ("step", 4), ("eval", 4), ("prediction", 4),
                                                     ("start", 4), ("step", 5), ("step", 6), ("eval", 6),
                                                     ("prediction", 6)]
    assert {m["run"] for m in done} == {resumed[0]["run"]} and done[:4] == resumed  # its own lines kept as they were
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [m["loss"] for m in done if m["event"] == "step"] == summary["losses"][3:]


def test_a_bad_metrics_line_refuses_a_resume_before_any_lock_or_rank(capsys, tmp_path, monkeypatch):
    """Issue 35 #12: one line naming the file and the line, exit 2, nothing written, no LOCK left."""
    import modelpar.training.start as launch_module

    monkeypatch.setattr(launch_module, "LocalCluster", lambda *a, **k: pytest.fail("a rank was started"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n[1, 2]\n{"event": "step", "step": 1}\n')
    before = sorted(tmp_path.rglob("*"))
    code = main(["train", *TINY, "--out", str(out), "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                 "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (f"modelpar train: error: metrics {str(out / 'metrics.jsonl')!r} line 2 is a JSON list, "
                                 "not an object: each line must be one JSON object with an 'event' and a whole-number "
                                 "'step'; fix or delete the line, or give another --out")
    assert sorted(tmp_path.rglob("*")) == before
