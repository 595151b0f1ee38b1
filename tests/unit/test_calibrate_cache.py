"""Every run predicted with its own device (``modelpar.calibrate.cache``): a short calibration of this machine at
the run's own shape the first time, the cached profile after; none when the run opts out. One real calibration
of a one-process run (seconds); the cache is a tmp directory (conftest points every test's elsewhere too)."""

import dataclasses

from modelpar.calibrate.cache import NO_CALIBRATE_ENV, cache_path, machine_profile
from modelpar.costmodel.profiles import load_profile
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig
from modelpar.training.prediction import predict_run

CFG = TrainConfig(model=ModelConfig(layers=2, hidden=32, heads=2, seq_len=16), tp=1, pp=1, dp=1, batch_size=4,
                  microbatches=2).check()


def test_no_calibration_where_the_run_opts_out_or_names_its_profile():
    assert machine_profile(CFG).hardware is None  # the suite's MODELPAR_NO_CALIBRATE
    assert machine_profile(dataclasses.replace(CFG, calibrate=False)).hardware is None
    given = machine_profile(dataclasses.replace(CFG, hardware="h100-sxm"))
    assert (given.hardware, given.how) == ("h100-sxm", "given")


def test_the_first_run_calibrates_briefly_and_the_next_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(NO_CALIBRATE_ENV)
    heard: list[str] = []
    first = machine_profile(CFG, heard.append)
    path = cache_path(CFG)
    assert first.hardware == str(path) and path.parent == tmp_path / "modelpar" and "just now" in first.how
    assert len(heard) == 1 and "calibrating this machine" in heard[0]
    profile = load_profile(path)
    rows = profile.layer_rows("fp32", 1)  # the run's own layer shape alone: hidden 32, 2 × 16 tokens a micro-batch
    assert [(r[0], r[2], r[3]) for r in rows] == [(32, 16, 32)]
    stamp = path.stat().st_mtime_ns
    again = machine_profile(CFG, heard.append)
    assert again.hardware == str(path) and again.how == "calibrated once for this machine, cached"
    assert len(heard) == 1 and path.stat().st_mtime_ns == stamp  # nothing measured again
    assert predict_run(dataclasses.replace(CFG, hardware=again.hardware)).step_time_s > 0
    other = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, hidden=64))
    assert cache_path(other) != path  # another layer shape: another file (its own short calibration)



def test_a_cpu_run_with_more_ranks_than_cores_is_flagged_as_the_least_certain(monkeypatch):
    from modelpar.costmodel.presets import CPU_DEFAULT, PROFILES
    from modelpar.training.prediction import _cores_shared

    four = dataclasses.replace(CFG, tp=2, pp=2).check()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cpu, gpu = CPU_DEFAULT, PROFILES["h100-sxm"]
    assert _cores_shared(four, cpu) == ("4 ranks on 2 cores: the step time is the least certain prediction "
                                        "(docs/calibrate.md)")
    assert _cores_shared(CFG, cpu) is None  # one rank
    assert _cores_shared(four, gpu) is None  # a GPU run: its host cores do not compute
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 of the 4 ranks on this node
    assert _cores_shared(four, cpu) is None
