"""Every run predicted with its own device (``modelpar.calibrate.cache``): a short calibration of this machine at
the run's own shape the first time, the cached profile after; none when the run opts out. The real calibration
of a one-process run starts a process: tests/cli/test_calibrate.py."""

import dataclasses
import os

from modelpar.calibrate.cache import cache_path, machine_profile
from modelpar.calibrate.machine_load import busier, cpu_busy_share
from modelpar.costmodel.profiles import BUSY_WARNING, busy_warning
from modelpar.model import ModelConfig
from modelpar.training import TrainConfig

CFG = TrainConfig(model=ModelConfig(layers=2, hidden=32, heads=2, seq_len=16), tp=1, pp=1, dp=1, batch_size=4,
                  microbatches=2).check()


def test_no_calibration_where_the_run_opts_out_or_names_its_profile():
    assert machine_profile(CFG).hardware is None  # the suite's MODELPAR_NO_CALIBRATE
    assert machine_profile(dataclasses.replace(CFG, calibrate=False)).hardware is None
    given = machine_profile(dataclasses.replace(CFG, hardware="h100-sxm"))
    assert (given.hardware, given.how) == ("h100-sxm", "given")


def test_a_gpu_no_preset_names_gets_a_cache_file_of_its_own(monkeypatch):
    """Two GPUs of one host (or one host type with other GPUs attached) do not share a profile: the detected GPU's
    name is in the key, beside the CPU's."""
    cpu = cache_path(CFG).name
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    names = []
    for gpu in ("NVIDIA A10", "NVIDIA GeForce RTX 4090"):
        monkeypatch.setattr("torch.cuda.get_device_name", lambda device=None, gpu=gpu: gpu)
        names.append(cache_path(CFG).name)
    assert names == ["nvidia-a10-" + cpu, "nvidia-geforce-rtx-4090-" + cpu]


def test_the_busy_share_is_the_non_idle_ticks_of_the_window():
    ticks = iter([(1000, 600), (1200, 650)])  # 200 ticks, 50 idle: 75% busy
    assert cpu_busy_share(0.0, lambda: next(ticks)) == 0.75
    assert cpu_busy_share(0.0, lambda: (5, 5)) is None  # no ticks passed
    def unreadable() -> tuple[int, int]:
        raise OSError("no /proc/stat")
    assert cpu_busy_share(0.0, unreadable) is None
    assert (cpu_busy_share(0.05) is not None) == os.path.exists("/proc/stat")  # the real file parses
    assert busy_warning(None) is None and busy_warning(BUSY_WARNING) is None
    assert (busier(0.1, 0.7), busier(0.7, 0.1), busier(None, 0.3), busier(0.3, None), busier(None, None)) == \
        (0.7, 0.7, 0.3, 0.3, None)
    assert busy_warning(0.62) == ("measured while 62% of the CPUs were busy with other work: its step times are "
                                  "priced slow")



def test_a_less_certain_step_time_says_why_beside_it(monkeypatch):
    """Ranks sharing cores, a profile measured beside other work, a compiled run priced as eager."""
    from modelpar.costmodel.presets import CPU_DEFAULT, PROFILES
    from modelpar.training.prediction import _cores_shared, step_time_caveats

    four = dataclasses.replace(CFG, tp=2, pp=2).check()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cpu, gpu = CPU_DEFAULT, PROFILES["h100-sxm"]
    assert _cores_shared(four, cpu) == ("4 ranks on 2 cores: the step time is the least certain prediction "
                                        "(docs/calibrate.md)")
    assert step_time_caveats(four, cpu) == [("  cores shared", _cores_shared(four, cpu))]
    assert _cores_shared(CFG, cpu) is None  # one rank
    assert _cores_shared(four, gpu) is None  # a GPU run: its host cores do not compute
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 of the 4 ranks on this node
    assert _cores_shared(four, cpu) is None
    assert step_time_caveats(four, cpu) == []
    busy, compiled = dataclasses.replace(cpu, cpu_busy=0.5), dataclasses.replace(CFG, compile=True)
    assert step_time_caveats(compiled, busy) == [
        ("  profile", "measured while 50% of the CPUs were busy with other work: its step times are priced slow"),
        ("  compiled", "priced as the eager run: the profile has no compiled layer (modelpar calibrate --compile "
                       "measures it)")]
    assert step_time_caveats(CFG, gpu) == []
    rows = [[32, 2, 16, n, 1e-4, 2e-4, 1e-4, 3e-4] for n in (16, 64)]  # the run's shape (32 tokens) inside
    measured = dataclasses.replace(cpu, layer={"fp32": {"1": rows}}, layer_compiled={"fp32": {"1": rows}})
    assert step_time_caveats(compiled, measured) == [
        ("  compiled", "the layers priced from the profile's compiled layer (calibrate --compile)")]
    eager_backend = dataclasses.replace(compiled, compile_backend="aot_eager")
    assert step_time_caveats(eager_backend, measured) == [
        ("  compiled", "priced as the eager run: the profile times inductor's kernels, not aot_eager's")]


def test_a_compiled_run_has_its_own_cache_file():
    """A --compile run (inductor) calibrates its compiled layer too, so its profile is another file; another
    backend's run is priced as eager and shares the eager run's."""
    compiled = dataclasses.replace(CFG, compile=True)
    assert cache_path(compiled).name == cache_path(CFG).name.replace(".json", "-compiled.json")
    assert cache_path(dataclasses.replace(compiled, compile_backend="aot_eager")) == cache_path(CFG)
