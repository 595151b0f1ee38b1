"""``modelpar plan``: table, JSON, pins, plot, errors (one line, exit 2) and no torch import."""

import dataclasses
import json
import subprocess
import sys

import pytest
from _images import assert_drawn

from modelpar.cli import main
from modelpar.costmodel import DEFAULT, memory_breakdown, model_preset
from modelpar.costmodel.request import parse_plan_command

BASE = ["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "1024", "--batch", "1536"]
result_model = model_preset("gpt3-175b")


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
    keys = {"t", "p", "d", "micro_batch", "v", "recompute", "sequence_parallel", "zero", "device_layers",
            "step_time_s", "tflops_per_gpu", "mfu", "memory_gb", "bubble_over_ideal_compute"}
    assert all(keys <= set(r) for r in rows)
    assert [r["step_time_s"] for r in rows] == sorted(r["step_time_s"] for r in rows)
    assert all(r["memory_gb"] <= 80 and r["t"] * r["p"] * r["d"] == 1024 for r in rows)


def test_pins_and_numbers_instead_of_presets(capsys):
    args = ["plan", "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq-len", "2048", "--vocab", "51200",
            "--peak-tflops", "312", "--gpu-mem-gb", "80", "--gpus", "1024", "--batch", "1536", "--tp", "8",
            "--micro-batch", "1", "--chunks", "1", "--recompute", "full", "--sequence-parallel", "off", "--zero", "0",
            "--json"]
    code, out, _ = run(capsys, *args)
    rows = json.loads(out)
    # p = 64 splits the 96 layers unevenly (1 or 2 per stage, the first and last 1)
    assert code == 0 and {(r["p"], r["d"]) for r in rows} == {(8, 16), (16, 8), (32, 4), (64, 2)}
    assert all(r["t"] == 8 and r["recompute"] == "full" and not r["sequence_parallel"] for r in rows)


def test_plot_writes_a_png(capsys, tmp_path):
    import matplotlib.image

    from modelpar.costmodel import assumptions_for, make_cluster, model_preset, search
    from modelpar.costmodel.report import best_by_tp

    path = tmp_path / "plan.png"
    code, out, _ = run(capsys, "plan", "--model", "gpt3-175b", "--gpus", "64", "--batch", "64", "--plot", str(path))
    assert code == 0 and f"plot: {path}" in out
    assert_drawn(path)
    grid = best_by_tp(search(model_preset("gpt3-175b"), make_cluster("a100-80gb", 64), 64, assumptions_for("a100")))
    ts, ps = {t for t, _ in grid}, {p for _, p in grid}
    # one heat-map cell per (t, p): the figure is (4 + 1.3·|p|) × (1.2 + 0.75·|t|) inches at 120 dpi
    assert matplotlib.image.imread(path).shape[:2] == (round((1.2 + 0.75 * len(ts)) * 120),
                                                        round((4 + 1.3 * len(ps)) * 120))


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
        (["--stage-layers", "5,6"], "--stage-layers sums to 11, but the model has 96 layers"),
        (["--pp", "8", "--stage-layers", "12,12,12,12,12,12,24"], "--stage-layers has 7 entries, expected p·v = 8·1 = 8"),
        (["--chunks", "2", "--pp", "4", "--stage-layers", "24,24,24,24"],
         "--stage-layers has 4 entries, expected p·v = 4·2 = 8"),
        (["--stage-layers", "48,0,48"], "only the first and last chunk may be empty"),
        (["--stage-layers", "12,x"], "--stage-layers must be comma-separated whole numbers, got '12,x'"),
        (["--engine", "nemo"], "unknown engine 'nemo'; known: megatron, megatron-2021, deepspeed, pytorch"),
        (["--zero", "4"], "--zero must be one of {0, 1, 2, 3}, got 4"),
        (["--gpus", "64", "--batch", "64", "--tp", "1", "--pp", "1", "--cp", "1", "--zero", "3", "--recompute", "none"],
         "GPU memory too small: the leanest layout with the pinned values of gpt3-175b on 64 GPUs"),
        (["--plot", "/nonexistent-folder/plan.png"], "--plot: folder '/nonexistent-folder' does not exist"),
        (["--plot", "plan.pdf"], "--plot must name a .png or .svg file, got 'plan.pdf'"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, extra, message):
    code = main([*BASE, *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_bloom_real_layout_uneven_stages_and_its_engine(capsys):
    # 70 layers on 12 stages: the middle ten get 6, the first and last (embedding, output layer) 5
    bloom = ["plan", "--model", "bloom-176b", "--gpus", "384", "--batch", "2048", "--tp", "4", "--pp", "12", "--dp", "8",
             "--micro-batch", "2", "--recompute", "full", "--sequence-parallel", "off", "--engine", "deepspeed"]
    code, out, _ = run(capsys, *bloom, "--json", "--top", "1")
    row = json.loads(out)[0]
    assert code == 0 and (row["t"], row["p"], row["d"], row["v"]) == (4, 12, 8, 1)
    assert row["device_layers"] == [5] + [6] * 10 + [5]
    code, out, _ = run(capsys, *bloom, "--stage-layers", "6,6,6,6,6,6,6,6,6,6,6,4", "--json", "--top", "1")
    pinned = json.loads(out)[0]
    assert pinned["device_layers"] == [6] * 11 + [4]
    # the last stage's 250880-word output layer costs about a layer, but the first stage now holds 6 layers and
    # the embedding, whose gradients DeepSpeed adds up every microbatch: it sets the pace, 0.5% slower
    # (93.84 and 94.28 s before the ends' own work: the embedding's dense gradient, the cross entropy's counted
    # bytes, the tied embedding's gradient sync between the first and last stage; 94.46 before the inventory's
    # parameter count, whose norms and row biases are whole over t: the gradient pass over a 6-layer stage grows)
    assert (row["step_time_s"], pinned["step_time_s"]) == pytest.approx((94.02, 94.47), abs=0.005)
    code, out, _ = run(capsys, *bloom, "--top", "1")
    assert "Engine: DeepSpeed pipeline engine: plain 1F1B" in out and "layers per device 5/6×10/5" in out


def test_zero_pinned_or_searched_and_an_opt_style_run(capsys):
    code, out, _ = run(capsys, "plan", "--model", "opt-175b", "--gpus", "992", "--batch", "992", "--tp", "8", "--pp", "1",
                       "--zero", "3", "--engine", "pytorch", "--json", "--top", "3")
    rows = json.loads(out)
    assert code == 0 and all((r["t"], r["p"], r["d"], r["zero"]) == (8, 1, 124, 3) for r in rows)
    code, out, _ = run(capsys, *BASE, "--json", "--top", "40")
    assert {r["zero"] for r in json.loads(out)} == {1}
    # searched: ZeRO-1 (never slower than ZeRO-0, which is tried only when pinned), ZeRO-2 or 3 where it does not fit
    result = parse_plan_command(" ".join(BASE[1:])).search()
    assert {e.config.zero for e in result.ranked if e.config.d > 1} == {1, 2, 3}
    assert {e.config.zero for e in result.ranked if e.config.d == 1} == {0}  # nothing to shard over d = 1
    for e in result.ranked:
        if e.config.zero > 1:  # the same layout one stage lower would not fit
            lower = dataclasses.replace(e.config, zero=e.config.zero - 1)
            assert sum(memory_breakdown(result_model, lower, e.microbatches, DEFAULT).values()) > 80e9


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


# --- the schedule for the chosen layout: the family and auto within the device's memory ------------------
@pytest.mark.parametrize("limit, own, chosen, why", [
    # K = 4, M = 8, F = I = W = 1 (T_B = 2): 1F1B (M+K-1)(T_F+T_B) = 33 holding 4; ZB-V 3M·T_F + (K-1)T_F/2 = 25.5
    # holding 4; V-Half 27.5 holding 3 (until W); V-Min 29.5 holding 2; interleaved v = 2: 28.5 holding 5.5
    (4, ("1f1b", 1), "zb-v", "zb-v: 6% bubble vs 1f1b 27% at the same memory (4 microbatches held per device), "
                             "step -22.7%"),
    (3, ("1f1b", 1), "v-half", "v-half: 13% bubble vs 1f1b 27% holding 3 vs 4 microbatches per device, step -16.7%; "
                               "1f1b does not fit (limit 3)"),
    (2, ("1f1b", 1), "v-min", "v-min: 19% bubble vs 1f1b 27% holding 2 vs 4 microbatches per device, step -10.6%"),
    (8, ("interleaved", 2), "zb-v", "zb-v: 6% bubble vs interleaved v=2 16% holding 4 vs 5.5 microbatches per "
                                    "device, step -10.5%"),
])
def test_the_schedule_choice_by_hand(limit, own, chosen, why):
    from modelpar.costmodel.schedule_choice import choose_schedule
    from modelpar.simulate.synthesis import StageCosts

    for synthesise in (True, False):  # auto cannot beat ZB-V, V-Half or V-Min at these limits
        choice = choose_schedule(StageCosts.uniform(4, 1, 1, 1), 8, limit, own, synthesise=synthesise)
        assert choice.chosen.schedule.name == chosen and choice.why().startswith(why)


def test_the_layout_s_own_schedule_wins_when_nothing_beats_it():
    """Interleaved v = 8 at K = 4, M = 8: 24 + (K-1)(T_F+T_B)/v = 25.125 beats ZB-V's 25.5 (the family has v <= 2)."""
    from modelpar.costmodel.schedule_choice import choose_schedule
    from modelpar.simulate.synthesis import StageCosts

    choice = choose_schedule(StageCosts.uniform(4, 1, 1, 1), 8, 5.5, ("interleaved", 8), synthesise=False)
    assert choice.chosen is choice.own and choice.own.step_time == pytest.approx(25.125)
    assert choice.why() == ("interleaved v=8: no schedule of the family, nor auto, is faster within 4.375 "
                            "microbatches held per device (limit 5.5)")


def test_plan_names_the_schedule_and_why(capsys):
    code, out, _ = run(capsys, "plan", "--layers", "24", "--hidden", "2048", "--heads", "16", "--seq-len", "2048",
                       "--vocab", "50304", "--gpus", "16", "--batch", "64", "--pp", "4", "--tp", "4",
                       "--gpu-mem-gb", "12")
    line = out.strip().splitlines()[-1]
    assert code == 0 and line.startswith("Schedule: ") and " bubble vs interleaved v=2 " in line
    code, out, _ = run(capsys, "plan", "--layers", "24", "--hidden", "2048", "--heads", "16", "--seq-len", "2048",
                       "--vocab", "50304", "--gpus", "16", "--batch", "64", "--pp", "1")
    assert out.strip().splitlines()[-1] == "Schedule: one pipeline stage: no schedule to choose."
