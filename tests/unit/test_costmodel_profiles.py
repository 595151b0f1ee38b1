"""Hardware profiles: JSON round trip, table entries = the named GPUs, measured numbers priced, bad input."""

import dataclasses
import json

import pytest

from modelpar.cli import main
from modelpar.costmodel import GPUS, PROFILES, HardwareProfile, ParallelConfig, estimate, make_cluster, model_preset
from modelpar.costmodel.measured import gemm_efficiency, layer_gemms
from modelpar.costmodel.profiles import PROFILE_VERSION, installed_torch, load_profile, save_profile
from modelpar.costmodel.request import parse_plan_command
from modelpar.formulas import allreduce_bytes


def measured(**changes) -> HardwareProfile:
    """A small hand-made CPU profile: 0.1 TFLOP/s at every GEMM, 10 GB/s element-wise, gloo collectives."""
    base = HardwareProfile(
        name="test-cpu", device="cpu", backend="gloo", memory_gb=8.0, devices_per_node=2, peak_tflops={"fp32": 0.2},
        intra_node_gbps=5.0, inter_node_gbps=1.0, hbm_tb_s=0.01, torch=installed_torch(), host="test", cores=2,
        matmul={"fp32": {"1": [[256, 128, 128, 0.1], [1024, 512, 512, 0.1]], "2": [[256, 128, 128, 0.05]]}},
        attention={"fp32": {"1": 0.05}}, elementwise_gbps={"1": 10.0, "2": 5.0}, op_latency_s={"1": 1e-5},
        collectives={"all_reduce": {"intra": {"2": [1e-4, 2.0]}}, "p2p": {"intra": {"2": [5e-5, 4.0]}}})
    return dataclasses.replace(base, **changes)


def test_json_round_trip(tmp_path):
    p = measured()
    path = tmp_path / "p.json"
    save_profile(p, path)
    data = json.loads(path.read_text())
    assert data["format"] == "modelpar-hardware-profile" and data["version"] == PROFILE_VERSION
    assert data["torch"] == installed_torch()
    assert load_profile(path) == p
    for name, table in PROFILES.items():  # the table entries are profiles of the same form
        save_profile(table, tmp_path / f"{name}.json")
        assert load_profile(tmp_path / f"{name}.json") == table and not table.measured


def test_table_profiles_are_the_named_gpus():
    for name, node in GPUS.items():
        assert node.profile is PROFILES[name]
        assert node.gpu.peak_tflops == PROFILES[name].peak_tflops["bf16"] and node.gpu.memory_gb == PROFILES[name].memory_gb
        assert make_cluster(name, 64).measured is None  # no measured points: the assumptions price everything


def test_lookups_are_the_measured_numbers():
    p = measured()
    assert p.matmul_tflops(256, 128, 128) == 0.1 and p.matmul_tflops(256, 128, 128, ranks=2) == 0.05
    assert p.matmul_tflops(300, 100, 140) == pytest.approx(0.1)  # every point 0.1: any weighting gives 0.1
    assert p.ranks_measured(4) == "2" and p.ranks_measured(1) == "1"
    assert p.elementwise_bytes_per_s(2) == 5e9
    cost = p.collective("all_reduce", 2)
    assert cost is not None and cost.time(2e9) == pytest.approx(1e-4 + 1.0)
    assert p.collective("all_gather", 2) is None and p.collective("all_reduce", 1) is None


def test_measured_profile_prices_gemms_and_collectives():
    """Two ranks share the node: every GEMM at the 2-rank table's 0.05 of a 0.2 TFLOP/s peak is an
    efficiency of exactly 0.25; the tensor-parallel all-reduce costs the profile's latency + bytes/bandwidth."""
    from modelpar.costmodel.estimate import layer_time
    from modelpar.costmodel.presets import profile_node
    from modelpar.costmodel.request import default_assumptions

    model = model_preset("gpt3-175b")
    model = dataclasses.replace(model, layers=4, hidden=256, heads=4, seq=256, vocab=512)
    cluster = make_cluster(profile_node(measured()), 2)
    cfg = ParallelConfig(2, 1, 1, 1, recompute="none")
    assert gemm_efficiency(model, cluster, cfg) == pytest.approx(0.25)
    assert layer_gemms(model, 256, 2) == [(256, 384, 256), (256, 256, 128), (256, 512, 256), (256, 256, 512)]
    a = default_assumptions(cluster)
    assert a.param_bytes == 4 and a.layer_latency_s == pytest.approx(12e-5)
    _, tp = layer_time(model, cluster, cfg, a, 0.25)
    one = 1e-4 + allreduce_bytes(256 * 256 * 4, 2) / 2e9
    assert tp == pytest.approx((2 + 0) * one)  # forward 2; the backward's 2 hide under the weight gradient (megatron)
    e = estimate(model, cluster, cfg, 4, a)
    assert e.efficiency == pytest.approx(0.25) and e.step_time_s > 0


def test_plan_hardware_cli(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    save_profile(measured(), path)
    req = parse_plan_command(f"--hardware {path} --layers 4 --hidden 256 --heads 4 --seq-len 256 --vocab 512 "
                             "--gpus 2 --batch 8")
    assert req.cluster.gpu.name == "test-cpu" and req.cluster.measured is not None and req.search().ranked
    code = main(["plan", "--hardware", str(path), "--layers", "4", "--hidden", "256", "--heads", "4", "--seq-len", "256",
                 "--vocab", "512", "--gpus", "2", "--batch", "8", "--json", "--top", "1"])
    assert code == 0 and json.loads(capsys.readouterr().out)[0]["t"] * 1 >= 1


@pytest.mark.parametrize("content, message", [
    ("{", "is not JSON"),
    ('{"format": "other"}', "is not a modelpar hardware profile"),
    ('{"format": "modelpar-hardware-profile", "version": 99}', "profile version 99"),
    ('{"format": "modelpar-hardware-profile", "version": 1, "name": "x"}', "version 1; this modelpar reads version 2: "
                                                                           "run modelpar calibrate again"),
    ('{"format": "modelpar-hardware-profile", "version": 2, "name": "x"}', "is malformed"),
])
def test_bad_profiles_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    code = main(["plan", "--hardware", str(path), "--model", "gpt3-175b", "--gpus", "8", "--batch", "8"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_other_torch_bad_values_and_gpu_together(tmp_path, capsys):
    other = tmp_path / "other.json"
    save_profile(measured(torch="0.0.1"), other)
    bad = tmp_path / "bad.json"
    data = measured().to_json()
    data["matmul"] = {"fp32": {"1": [[256, 128, -1, 0.1]]}}
    bad.write_text(json.dumps(data))
    busy = tmp_path / "busy.json"
    busy.write_text(json.dumps({**measured().to_json(), "cpu_busy": 1.5}))
    for args, message in (([str(other)], "measured with torch 0.0.1"), ([str(bad)], "matmul[fp32][1] points"),
                          ([str(busy)], "cpu_busy must be in [0, 1], got 1.5"),
                          ([str(other), "--gpu", "h100-sxm"], "give one"),
                          ([str(tmp_path / "missing.json")], "No such file")):
        code = main(["plan", "--model", "gpt3-175b", "--gpus", "8", "--batch", "8", "--hardware", *args])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
