"""`modelpar train` on the command line: flags to config, bad input as one line + exit code 2, a tiny run."""

import json
import math
import re
import time

import pytest
from _images import assert_drawn

from modelpar.cli import build_parser, main
from modelpar.commands.train import build_config
from modelpar.training import TrainConfig


def test_no_flags_is_the_documented_default():
    cfg = build_config(build_parser().parse_args(["train"]))
    assert cfg == TrainConfig()
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.dims.world_size) == (2, 2, 1, 4)


def test_flags_reach_the_config():
    args = build_parser().parse_args(["train", "--tp", "1", "--pp", "4", "--dp", "2", "--schedule", "interleaved",
                                      "--layers", "8", "--hidden", "64", "--recompute", "FULL", "--sequence-parallel",
                                      "--tie-embeddings", "--steps", "7", "--lr", "1e-3", "--exit-after", "3",
                                      "--stage-layers", "1,1,1,1,1,1,2,0"])
    cfg = build_config(args)
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.schedule, cfg.chunks, cfg.recompute, cfg.steps, cfg.lr, cfg.exit_after) == \
        (1, 4, 2, "interleaved", 2, "full", 7, 1e-3, 3)  # interleaved without --chunks: v = 2
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.tie_embeddings, cfg.sequence_parallel) == (8, 64, True, True)
    assert cfg.check().layer_split == (1, 1, 1, 1, 1, 1, 2, 0)  # per virtual stage, in pipeline order


@pytest.mark.parametrize("flags, message", [
    (["--tp", "3"], "heads (4) must be divisible by tp (3)"),
    (["--microbatches", "5"], "batch_size per replica (16) must be divisible by microbatches (5)"),
    (["--schedule", "dualpipe"], "schedule must be one of {gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zb-h2, zb-v, "
                                 "v-half, v-min, dualpipe-v, dualpipe-v-serial, auto}, got 'dualpipe'"),
    (["--schedule", "auto", "--memory-limit", "0.5"], "memory limit must be >= 1 microbatches' activations per "
                                                      "rank (the least any schedule for K = 2, M = 4 holds), got 0.5"),
    (["--memory-limit", "2"], "memory_limit applies to schedule auto (it picks the schedule that fits), got 2"),
    (["--recompute", "often"], "recompute must be one of {none, selective, full, sqrt, recompute-all} or a positive "
                               "integer k, got 'often'"),
    (["--arch", "llama", "--kv-heads", "3"], "heads (4) must be divisible by kv_heads (3)"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0, got 0.0"),
    (["--init-from", "/nonexistent"], "/nonexistent: no config.json (expected a Hugging Face model directory)"),
    (["--layers", "6", "--pp", "2", "--stage-layers", "3,2"], "stage_layers 3,2: sums to 5, not the model's 6 layers"),
    (["--stage-layers", "3;1"], "--stage-layers must be comma-separated whole numbers, got '3;1'"),
    (["--resume"], "resume needs checkpoint_dir"),
    (["--dtype", "float64"], "--dtype float64 is retired: use --precision fp32 (was float32), fp64 (was float64) or bf16"),
    (["--precision", "fp16"], "precision 'fp16' is not supported: fp16 needs loss scaling"),
    (["--zero", "4"], "zero must be one of {0, 1, 2, 3}, got 4"),
    (["--zero", "3"], "zero 3 shards over the data-parallel replicas and needs dp >= 2, got dp 1; use zero 0"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, flags, message):
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"modelpar train: error: {err.split('error: ', 1)[1]}" and message in err and "\n" not in err


def test_numerics_flags_reach_the_config():
    args = build_parser().parse_args(["train", "--precision", "bf16", "--zero", "1", "--no-overlap-grad-reduce",
                                      "--bucket-mb", "4"])
    cfg = build_config(args)
    assert (cfg.precision, cfg.zero, cfg.overlap_grad_reduce, cfg.bucket_mb) == ("bf16", 1, False, 4.0)
    assert (TrainConfig().precision, TrainConfig().zero, TrainConfig().overlap_grad_reduce) == ("fp32", 0, True)


def test_llama_flags_reach_the_model_config():
    args = build_parser().parse_args(["train", "--arch", "llama", "--kv-heads", "2", "--ffn", "256",
                                      "--rope-theta", "5e5", "--norm-eps", "1e-6", "--recompute", "selective"])
    cfg = build_config(args)
    assert (cfg.model.arch, cfg.model.kv_heads, cfg.model.ffn_hidden, cfg.model.rope_theta, cfg.model.norm_eps,
            cfg.recompute, cfg.recompute_arg) == ("llama", 2, 256, 5e5, 1e-6, "selective", "selective")


def test_a_tiny_run_writes_the_summary_and_the_loss_curve(tmp_path, capsys):
    out = tmp_path / "out"
    start = time.monotonic()
    code = main(["train", "--tp", "1", "--pp", "2", "--stage-layers", "1,3", "--hidden", "32", "--seq-len", "16",
                 "--steps", "4",
                 "--batch-size", "4", "--microbatches", "2", "--eval-every", "2", "--no-progress", "--out", str(out)])
    elapsed = time.monotonic() - start
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 4 and [s for s, _ in summary["val"]] == [2, 4]
    assert 0 < summary["bubble_measured"] < 1 and summary["bubble_ideal"] == pytest.approx(1 / 3)  # (p-1)/(m+p-1)
    assert_drawn(out / "loss.png")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["event"], m["step"]) for m in metrics] == [("start", 0), ("step", 1), ("step", 2), ("eval", 2),
                                                          ("step", 3), ("step", 4), ("eval", 4), ("prediction", 4)]
    assert len({m["run"] for m in metrics}) == 1
    assert [m["loss"] for m in metrics if m["event"] == "step"] == summary["losses"]
    assert all(m["step_time"] > 0 and m["peak_memory_mb"] > 0 and m["lr"] > 0 for m in metrics if m["event"] == "step")
    assert sum(m["step_time"] for m in metrics if m["event"] == "step") < elapsed  # the steps happened inside the run
    steps = [m for m in metrics if m["event"] == "step"]  # rank 0's accounting: fp32 AdamW is two moments, d = 1
    assert all(m["optimizer_state_bytes"] == summary["optimizer_state_bytes"] == 2 * m["gradient_bytes"] > 0
               and m["dp_bytes_sent"] == 0.0 for m in steps)
    assert [m["val_bpb"] for m in metrics if m["event"] == "eval"] == pytest.approx(
        [v / math.log(2) for _, v in summary["val"]])  # bytes: bits per byte = nats / ln 2
    printed = capsys.readouterr().out
    assert "unigram baseline" in printed and "1, 3 (--stage-layers)" in printed
    assert "this layer split" in printed and "42.9%" in printed  # 1 | 3, m = 2, F ∝ layers: 3/7 idle
    assert summary["config"]["schedule"]["stage_layers"] == [1, 3]  # the settings by section
    assert summary["mfu"] is None and summary["peak_tflops"] is None  # on CPUs only with --peak-tflops


def test_a_tiny_llama_run_reports_flops_per_token_and_mfu(tmp_path, capsys):
    from modelpar.model import ModelConfig

    out = tmp_path / "out"
    code = main(["train", "--arch", "llama", "--kv-heads", "1", "--tp", "2", "--pp", "1", "--hidden", "32",
                 "--seq-len", "16", "--steps", "2", "--batch-size", "4", "--microbatches", "2", "--eval-every", "0",
                 "--peak-tflops", "0.5", "--no-progress", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    model = ModelConfig.from_dict(summary["config"]["model"])
    spec = model.spec()  # the cost model's count of the same numbers
    assert summary["flops_per_token"] == spec.model_flops(1) == 3 * (4 * spec.layer_flops_per_token
                                                                     + spec.logits_flops_per_token)
    assert summary["num_parameters"] == model.num_parameters() == spec.params + 32  # + the final RMSNorm
    assert summary["mfu"] == pytest.approx(summary["flops_per_token"] * summary["tokens_per_s"] / (2 * 0.5e12))
    assert "MFU" in capsys.readouterr().out


# --- settings in sections: one declaration per field -> flags, help, file keys, docs -----------------
def _train_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["train"]


def test_every_field_is_a_flag_in_its_section_with_its_real_default():
    from modelpar._options import SECTIONS, field_infos
    from modelpar.commands.train_options import RunOptions, section_fields
    from modelpar.model import ModelConfig
    from modelpar.text import DataConfig

    parser = _train_parser()
    parser.format_help()  # builds the flags
    groups = {g.title: {o for a in g._group_actions for o in a.option_strings} for g in parser._action_groups}
    listed = {(s, i.name) for s in SECTIONS for i in section_fields(s)}
    declared = {("model", i.name) for i in field_infos(ModelConfig)} | {("data", i.name) for i in field_infos(DataConfig)}
    for cls in (TrainConfig, RunOptions):
        declared |= {(i.section, i.name) for i in field_infos(cls) if not i.nested}
    assert listed == declared  # every field in exactly the section it declares, none without one
    for section in SECTIONS:
        for info in section_fields(section):
            assert info.help, info.name
            assert (info.flag in groups[section]) == info.cli, (section, info.flag)
    helps = {o: a.help for a in parser._actions for o in a.option_strings}
    assert "(default: 25.0)" in helps["--bucket-mb"] and "(default: 300)" in helps["--steps"]
    assert "(default: 1f1b)" in helps["--schedule"] and "(default: off)" in helps["--sequence-parallel"]
    assert "--no-overlap-grad-reduce" in helps and "--vocab-size" in groups["data"]  # the data's, not the model's


def test_docs_list_every_setting_as_generated():
    from pathlib import Path

    from modelpar.commands.train_options import settings_markdown

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    start = text.index("<!-- settings:begin")
    block = text[text.index("\n", start) + 1:text.index("<!-- settings:end -->")]
    assert block == settings_markdown(), "regenerate with: python -m modelpar.commands.train_options"


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_config_file_sets_the_run_and_flags_override_it(tmp_path):
    from pathlib import Path

    example = str(Path(__file__).resolve().parents[2] / "examples" / "run.toml")
    cfg = build_config(build_parser().parse_args(["train", "--config", example]))
    assert (cfg.model.arch, cfg.model.kv_heads, cfg.model.layers, cfg.tp, cfg.pp, cfg.stage_layers, cfg.steps) == \
        ("llama", 2, 6, 1, 4, (1, 2, 2, 1), 200)
    assert cfg.microbatches == 12 and cfg.check(4) is cfg  # chosen: 4(p - 1) divides the 24 sequences
    over = build_config(build_parser().parse_args(["train", "--config", example, "--steps", "50", "--pp", "2",
                                                   "--stage-layers", "3,3"]))
    assert (over.steps, over.pp, over.stage_layers, over.model.arch, over.microbatches) == (50, 2, (3, 3), "llama", 4)
    as_json = _write(tmp_path, "run.json", json.dumps({"parallelism": {"tp": 1, "dp": 2}, "data": {"paths": ["a"]},
                                                      "schedule": {"recompute": "FULL"}}))
    cfg = build_config(build_parser().parse_args(["train", "--config", as_json]))
    assert (cfg.tp, cfg.dp, cfg.data.paths, cfg.recompute) == (1, 2, ("a",), "full")


def test_summary_config_reads_back_as_a_config_file(tmp_path):
    cfg = TrainConfig(tp=1, pp=2, stage_layers=(1, 3), microbatches=2)
    path = _write(tmp_path, "summary.json", json.dumps(cfg.to_sections()))
    assert build_config(build_parser().parse_args(["train", "--config", path])) == cfg


@pytest.mark.parametrize("text, message", [
    ("[parallelism]\ntpp = 2\n", r"run.toml: \[parallelism\] unknown key 'tpp'; allowed: tp, pp, dp, "),
    ("[run]\ntp = 2\n", r"run.toml: \[run\] unknown key 'tp' \(tp belongs in \[parallelism\]\)"),
    ("tp = 2\n", r"run.toml: unknown section or top-level key 'tp' \(tp belongs in \[parallelism\]\)"),
    ("[parallel]\ntp = 2\n", r"run.toml: unknown section or top-level key 'parallel'; sections: model, data, "),
    ("[parallelism]\ntp = \"two\"\n", r"run.toml: \[parallelism\] tp must be a whole number, got 'two'"),
    ("[model]\ntie_embeddings = 1\n", r"run.toml: \[model\] tie_embeddings must be true or false, got 1"),
    ("[schedule]\nstage_layers = \"1;3\"\n", r"--stage-layers must be comma-separated whole numbers, got '1;3'"),
    ("[parallelism]\ntp = 0\n", r"run.toml: \[parallelism\] tp must be >= 1, got 0"),
    ("[parallelism\n", r"run.toml: not valid TOML: "),
])
def test_a_bad_config_file_is_one_line_naming_file_section_and_key(tmp_path, capsys, text, message):
    path = _write(tmp_path, "run.toml", text)
    assert main(["train", "--config", path]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err


def test_unknown_keys_are_refused_everywhere():
    with pytest.raises(ValueError, match=r"train config: unknown key 'tpp'; allowed: model, data, tp, pp, dp"):
        TrainConfig.from_dict({"tpp": 2})
    with pytest.raises(ValueError, match=r"train config: \[data\] unknown key 'path'; allowed: paths, glob"):
        TrainConfig.from_dict({"data": {"path": "x"}})
    assert TrainConfig.from_dict({"dtype": "float64"}).precision == "fp64"  # old checkpoints: retired, accepted
    assert TrainConfig.from_dict(TrainConfig(stage_layers=(1, 3)).to_dict()).stage_layers == (1, 3)


@pytest.mark.parametrize("schedule", ["zb-v", "v-half", "v-min", "dualpipe-v", "looped-bfs"])
def test_two_chunk_schedules_default_to_v_2(schedule):
    args = build_parser().parse_args(["train", "--tp", "1", "--pp", "2", "--schedule", schedule, "--layers", "4"])
    cfg = build_config(args).check()
    assert (cfg.schedule, cfg.chunks) == (schedule, 2)
