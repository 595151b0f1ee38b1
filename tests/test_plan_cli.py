"""``modelpar plan``: table, JSON, pins, plot, errors (one line, exit 2) and no torch import."""

import json
import subprocess
import sys

import pytest

from modelpar.cli import main

BASE = ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--batch", "1536"]


def run(capsys, *extra):
    code = main([*BASE, *extra] if extra and extra[0] != "plan" else list(extra) or BASE)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_and_explanation(capsys):
    code, out, _ = run(capsys, *BASE)
    assert code == 0
    assert "174.6B parameters" in out and "Best: t = " in out and "TFLOP/s" in out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 5  # --top default


def test_json_keys_and_order(capsys):
    code, out, _ = run(capsys, *BASE, "--json", "--top", "7")
    rows = json.loads(out)
    assert code == 0 and len(rows) == 7
    keys = {"t", "p", "d", "micro_batch", "v", "recompute", "sequence_parallel", "step_time_s",
            "tflops_per_gpu", "mfu", "memory_gb", "bubble"}
    assert all(keys <= set(r) for r in rows)
    assert [r["step_time_s"] for r in rows] == sorted(r["step_time_s"] for r in rows)
    assert all(r["memory_gb"] <= 80 and r["t"] * r["p"] * r["d"] == 1024 for r in rows)


def test_pins_and_numbers_instead_of_presets(capsys):
    args = ["plan", "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq-len", "2048", "--vocab", "51200",
            "--peak-tflops", "312", "--gpu-mem-gb", "80", "--gpus", "1024", "--batch", "1536", "--tp", "8",
            "--micro-batch", "1", "--chunks", "1", "--recompute", "full", "--sequence-parallel", "off", "--json"]
    code, out, _ = run(capsys, *args)
    rows = json.loads(out)
    assert code == 0 and {(r["p"], r["d"]) for r in rows} == {(8, 16), (16, 8), (32, 4)}
    assert all(r["t"] == 8 and r["recompute"] == "full" and not r["sequence_parallel"] for r in rows)


def test_plot_writes_a_png(capsys, tmp_path):
    path = tmp_path / "plan.png"
    code, out, _ = run(capsys, "plan", "--model", "gpt3-175b", "--gpus", "64", "--batch", "64", "--plot", str(path))
    assert code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--gpus", "0"], "--gpus must be >= 1, got 0"),
        (["--batch", "-4"], "--batch must be >= 1, got -4"),
        (["--tp", "0"], "--tp must be >= 1"),
        (["--model", "gpt5"], "unknown model preset 'gpt5'; known: gpt3-175b, megatron-1t"),
        (["--gpu", "tpu"], "unknown gpu preset 'tpu'; known: a100-80gb"),
        (["--recompute", "half"], "--recompute must be one of"),
        (["--gpus", "4"], "the smallest GPU count that fits is"),
        (["--gpus", "1021"], "nearest at or above 1021 is 1024"),
        (["--gpu-mem-gb", "0.5"], "GPU memory too small"),
        (["--tp", "3"], "t = 3 does not divide the 1024 GPUs"),
        (["--tp", "8", "--pp", "64"], "p = 64 does not divide layers (96)"),
        (["--plot", "/nonexistent-folder/plan.png"], "--plot: folder '/nonexistent-folder' does not exist"),
        (["--plot", "plan.pdf"], "--plot must name a .png or .svg file, got 'plan.pdf'"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, extra, message):
    code = main([*BASE, *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_memory_error_says_by_how_much(capsys):
    code = main(["plan", "--model", "gpt3-175b", "--gpus", "8", "--batch", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "GB more than the 80 GB available" in err and "smallest GPU count that fits is" in err


def test_missing_model_numbers(capsys):
    code = main(["plan", "--layers", "4", "--gpus", "8", "--batch", "8"])
    assert code == 2 and "--hidden, --heads, --seq-len, --vocab are required" in capsys.readouterr().err


def test_plan_does_not_import_torch():
    code = (
        "import sys, io, contextlib\n"
        "from modelpar.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['plan', '--model', 'megatron-1t', '--gpus', '3072', '--batch', '3072', '--json'])\n"
        "assert rc == 0, rc\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    bad = subprocess.run([sys.executable, "-m", "modelpar", "plan", "--gpus", "0", "--batch", "1", "--model",
                          "gpt3-175b"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
