"""``modelpar calibrate``: the fit, the profile it writes (structure, not timings) and bad input."""

import dataclasses
import json
import os

import pytest

from modelpar.calibrate import build_profile, default_ranks
from modelpar.calibrate.busy import BUSY_OPS
from modelpar.calibrate.comm import fit_line, measured_cost, non_decreasing
from modelpar.calibrate.compute import gemm_shapes
from modelpar.cli import main
from modelpar.costmodel.profiles import busy_warning, installed_torch, load_profile


def test_fit_line_hand_checked():
    # time = 1 ms + bytes / 2 GB/s, exactly
    points = [(b, 1e-3 + b / 2e9) for b in (1e3, 1e5, 1e7)]
    latency, gbps = fit_line(points)
    assert latency == pytest.approx(1e-3) and gbps == pytest.approx(2.0)
    # noise that makes the slope negative: no latency below zero, the best bytes/s seen
    assert fit_line([(1e3, 2e-3), (1e6, 1e-3)]) == (pytest.approx(1e-3), pytest.approx(1.0))


def test_measured_cost_keeps_the_points_non_decreasing():
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]  # the violating pair pooled
    assert non_decreasing([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0] and non_decreasing([1.0, 2.0]) == [1.0, 2.0]
    latency, gbps, points = measured_cost([(1e5, 3e-3), (1e3, 1e-3), (1e6, 2e-3)])
    assert points == [[1e3, 1e-3], [1e5, 2.5e-3], [1e6, 2.5e-3]]  # sorted by bytes, then pooled
    assert (latency, gbps) == pytest.approx(fit_line([(1e3, 1e-3), (1e5, 3e-3), (1e6, 2e-3)]))


def test_default_ranks_and_shapes():
    assert default_ranks(2) == [1, 2, 4] and default_ranks(1) == [1, 2] and default_ranks(3) == [1, 2, 4]
    shapes = gemm_shapes("cpu")
    assert (256, 384, 128) in shapes and (256, 128, 512) in shapes  # QKV (h → 3h) and the MLP's 4h → h at h = 128
    assert len(shapes) == len(set(shapes)) == 48


def test_build_profile_from_measurements():
    one = {"device": "cpu", "name": "x86", "memory": 8e9, "matmul": {"fp32": [[64, 64, 64, 0.01], [256, 128, 128, 0.05]]},
           "attention": {"fp32": 0.002}, "elementwise_gbps": 3.0, "op_latency_s": 2e-5}
    two = {**one, "matmul": {"fp32": [[64, 64, 64, 0.005]]}, "elementwise_gbps": 2.0,
           "collectives": {"all_reduce": {"intra": {"2": [1e-4, 1.5]}}, "p2p": {"intra": {"2": [5e-5, 0.8]}}}}
    p = build_profile({1: one, 2: two}, "gloo", "box")
    assert p.name == "box" and p.measured and p.torch == installed_torch() and p.devices_per_node == 2
    assert p.peak_tflops == {"fp32": 0.05} and p.hbm_tb_s == 3e-3 and p.intra_node_gbps == 0.8
    assert p.matmul_tflops(64, 64, 64, ranks=2) == 0.005 and p.elementwise_bytes_per_s(2) == 2e9
    assert p.collective("all_reduce", 2).latency_s == 1e-4
    assert p.layer == p.ends == p.blockwise == {} and p.runtime_s == p.optimizer == {}  # not measured: the kernels
    whole = {"layer": {"fp32": [[64, 4, 64, 128, 1e-3, 2e-3, 1e-3, 3e-3]]}, "ends": {"fp32": [[64, 128, 256, 1, 1, 1, 1]]},
             "blockwise": {"fp32": []}, "runtime_s": [1e-4, 1e-3],
             "optimizer": [[t, b, 1e-3 + t * 1e-5 + b / 2e9] for t, b in ((10, 1e6), (40, 4e6), (20, 1e7))]}
    p = build_profile({1: {**one, **whole}, 2: two}, "gloo", "box")  # 2 processes sharing 2 cores: not measured
    assert p.layer == {"fp32": {"1": whole["layer"]["fp32"]}} and p.runtime_s == {"1": [1e-4, 1e-3]}
    assert p.layer_rows("fp32", 2) == whole["layer"]["fp32"]
    assert p.optimizer_fit(4) == pytest.approx((1e-3, 1e-5, 2.0), rel=1e-6)  # the rows fitted


def test_the_compiled_layer_is_measured_as_compile_runs_it():
    """One process, one tiny shape, inductor for real (one compilation, seconds): the row has the layer's key
    columns and positive times, full recomputation derived (its forward the forward, its backward forward and
    backward), and the profile prices compiled runs from it."""
    from modelpar.calibrate.run import measure_rank

    got = measure_rank(("fp32",), None, 1, False, 0.001, grid=((32,), (32,), 16), compiled=True)
    (row,) = got["layer_compiled"]["fp32"]
    assert row[:4] == [32, 4, 16, 32] and row[4] > 0 and row[5] > 0 and row[6] == row[4] and row[7] == row[4] + row[5]
    p = build_profile({1: got}, "gloo")
    assert p.layer_rows("fp32", 1, compiled=True) == [row] and p.layer_rows("fp32", 1) == got["layer"]["fp32"]
    assert "layer_compiled" not in measure_rank(("fp32",), None, 1, False, 0.001, grid=((32,), (32,), 16))


def test_calibrate_writes_a_profile_plan_reads(tmp_path, capsys):
    """Two local gloo ranks, a tiny time budget: every table is there, and `plan --hardware` uses the file."""
    out = tmp_path / "hw.json"
    assert main(["calibrate", "--out", str(out), "--ranks", "1,2", "--budget", "0.001"]) == 0
    said = capsys.readouterr()
    assert "modelpar calibrate:" in said.out
    p = load_profile(out)
    assert (p.cpu_busy is not None) == os.path.exists("/proc/stat")  # other work on the CPUs before or after it measured
    busy = busy_warning(p.cpu_busy)
    assert said.err == (f"modelpar calibrate: warning: the profile was {busy}; measure again when the machine is "
                        "quiet\n" if busy else "")
    data = json.loads(out.read_text())
    assert data["version"] == 2 and data["torch"] == installed_torch() and p.device == "cpu" and p.backend == "gloo"
    assert set(p.matmul["fp32"]) == {"1", "2"} and len(p.matmul["fp32"]["1"]) == len(gemm_shapes("cpu"))
    assert set(p.elementwise_gbps) == set(p.op_latency_s) == set(p.attention["fp32"]) == set(p.launch_s) == {"1", "2"}
    assert all(s > 0 for s in p.launch_s.values())  # host seconds per dispatched op (training.dispatch)
    assert set(p.layer["fp32"]) == set(p.ends["fp32"]) == set(p.runtime_s) == set(p.optimizer) == {"1", "2"}
    assert p.step_end_measured  # the trainer's own step end on every rank (calibrate.layers.trainer_step_end)
    assert set(p.tp_layer["fp32"]) == {"2"} and all(row[0] == 2 for row in p.tp_layer_rows("fp32", 2))  # a pair
    assert set(p.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    assert all(set(links["intra"]) == {"2"} for links in p.collectives.values())
    assert set(p.busy) == set(BUSY_OPS) and all(set(table) == {"2"} for table in p.busy.values())  # 2 processes
    assert p.busy_cost("p2p", 2) is not None and p.busy_cost("p2p", 8) == p.busy_cost("p2p", 2)  # the most measured
    assert main(["plan", "--hardware", str(out), "--layers", "4", "--hidden", "128", "--heads", "4", "--seq-len", "64",
                 "--vocab", "256", "--gpus", "2", "--batch", "8", "--json", "--top", "1"]) == 0


@pytest.mark.parametrize("args, message", [
    (["--ranks", "0"], "--ranks must be >= 1"),
    (["--ranks", "a"], "--ranks must be comma-separated"),
    (["--dtypes", "int8"], "--dtypes must be one of"),
    (["--out", "hw.txt"], "--out must name a .json file"),
    (["--budget", "0"], "--budget must be > 0"),
    # issue 35: --ranks 1,64 started 64 processes on 2 cores; at most twice the cores, refused before any starts
    (["--ranks", f"1,{2 * (os.cpu_count() or 1) + 1}"], f"at most {2 * (os.cpu_count() or 1)} local processes on "
                                                          f"this machine's {os.cpu_count() or 1} cores (2 per core)"),
])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(["calibrate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_slowest_rank_sets_the_whole_work_tables():
    """A synchronous step goes at its slowest rank's pace: each cell of the whole-work tables is the ranks' largest,
    the optimizer's rows the largest seconds (fitted afterwards); the rest is rank 0's."""
    from modelpar.calibrate.run import slowest

    a = {"matmul": {"fp32": [[1, 2, 3, 0.5]]}, "layer": {"fp32": [[64, 4, 64, 128, 1.0, 2.0, 1.5, 3.0]]},
         "ends": {"fp32": [[64, 128, 256, 0.1, 0.4, 0.3, 0.2]]}, "blockwise": {"fp32": [[2, 64, 64, 64, 0.5, 0.9]]},
         "runtime_s": [1e-4, 2e-4], "optimizer": [[10, 1e6, 1e-3], [40, 4e6, 2e-3]]}
    b = {"matmul": {"fp32": [[1, 2, 3, 0.4]]}, "layer": {"fp32": [[64, 4, 64, 128, 2.0, 1.0, 1.0, 4.0]]},
         "ends": {"fp32": [[64, 128, 256, 0.2, 0.3, 0.3, 0.1]]}, "blockwise": {"fp32": [[2, 64, 64, 64, 0.4, 1.0]]},
         "runtime_s": [3e-4, 1e-4], "optimizer": [[10, 1e6, 2e-3], [40, 4e6, 1e-3]]}
    got = slowest([a, b])
    assert got["layer"] == {"fp32": [[64, 4, 64, 128, 2.0, 2.0, 1.5, 4.0]]}
    assert got["ends"] == {"fp32": [[64, 128, 256, 0.2, 0.4, 0.3, 0.2]]}
    assert got["blockwise"] == {"fp32": [[2, 64, 64, 64, 0.5, 1.0]]}
    assert got["runtime_s"] == [3e-4, 2e-4] and got["optimizer"] == [[10, 1e6, 2e-3], [40, 4e6, 2e-3]]
    assert got["matmul"] == a["matmul"] and slowest([a]) == a  # the kernels stay rank 0's
    lone = {**b, "tp_layer": {"fp32": []}}  # a rank with no t = 2 partner measured none of that table
    pair = [[2, 64, 4, 64, 128, 1.0, 2.0, 1.5, 3.0]]
    assert slowest([{**a, "tp_layer": {"fp32": pair}}, lone])["tp_layer"] == {"fp32": pair}


def test_passes_are_averaged_cell_by_cell():
    """The whole-work tables of two passes: each number the mean of the two, the key columns as they were."""
    from modelpar.calibrate.run import mean_passes

    a = {"layer": {"fp32": [[64, 4, 64, 128, 1.0, 3.0]]}, "runtime_s": [1e-4, 3e-4], "optimizer": [[10, 1e6, 1e-3]]}
    b = {"layer": {"fp32": [[64, 4, 64, 128, 2.0, 1.0]]}, "runtime_s": [3e-4, 1e-4], "optimizer": [[10, 1e6, 3e-3]]}
    got = mean_passes([a, b])
    assert got["layer"] == {"fp32": [[64, 4, 64, 128, 1.5, 2.0]]}
    assert got["runtime_s"] == pytest.approx([2e-4, 2e-4]) and got["optimizer"] == [[10, 1e6, pytest.approx(2e-3)]]
    assert mean_passes([a]) == a


def test_the_first_run_calibrates_briefly_and_the_next_reuses_it(tmp_path, monkeypatch):
    """Every run predicted with its own device (``modelpar.calibrate.cache``): one real short calibration of a
    one-process run (a process of its own, seconds), kept in the cache and reused."""
    from modelpar.calibrate.cache import NO_CALIBRATE_ENV, cache_path, machine_profile
    from modelpar.costmodel.profiles import save_profile
    from modelpar.training.prediction import predict_run
    from tests.unit.test_calibrate_cache import CFG

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(NO_CALIBRATE_ENV)
    readings = iter([0.0, 0.8])  # quiet before; other work began during the calibration and still runs after it
    monkeypatch.setattr("modelpar.calibrate.run.cpu_busy_share", lambda: next(readings))
    heard: list[str] = []
    first = machine_profile(CFG, heard.append)
    path = cache_path(CFG)
    assert first.hardware == str(path) and path.parent == tmp_path / "modelpar" and "just now" in first.how
    profile = load_profile(path)
    assert "calibrating this machine" in heard[0]
    assert profile.cpu_busy == 0.8 and next(readings, None) is None  # read before and after: the larger kept
    busy = busy_warning(profile.cpu_busy)  # said once, after the measurement
    assert heard[1:] == [f"warning: this machine's profile was {busy} (cached all the same; delete {path} to "
                         "measure again when the machine is quiet)"]
    said = len(heard)
    rows = profile.layer_rows("fp32", 1)  # the run's own layer shape alone: hidden 32, 2 × 16 tokens a micro-batch
    assert [(r[0], r[2], r[3]) for r in rows] == [(32, 16, 32)]
    stamp = path.stat().st_mtime_ns
    again = machine_profile(CFG, heard.append)
    assert again.hardware == str(path) and again.how.startswith("calibrated once for this machine, cached")
    assert len(heard) == said and path.stat().st_mtime_ns == stamp  # nothing measured again
    assert predict_run(dataclasses.replace(CFG, hardware=again.hardware)).step_time_s > 0
    other = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, hidden=64))
    assert cache_path(other) != path  # another layer shape: another file (its own short calibration)
    save_profile(dataclasses.replace(profile, cpu_busy=0.62), path)  # as if measured beside other work
    flagged = machine_profile(CFG, heard.append)
    assert flagged.how == ("calibrated once for this machine, cached; measured while 62% of the CPUs were busy with "
                           f"other work: its step times are priced slow: delete {path} to measure again")
    assert len(heard) == said  # still nothing measured again: the user decides
    save_profile(dataclasses.replace(profile, cpu_busy=0.1), path)  # quiet: no word of it
    assert machine_profile(CFG).how == "calibrated once for this machine, cached"
