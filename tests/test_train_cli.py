"""`modelpar train` on the command line: flags to config, bad input as one line + exit code 2, a tiny run."""

import json
import math

import pytest

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
                                      "--tie-embeddings", "--steps", "7", "--lr", "1e-3", "--exit-after", "3"])
    cfg = build_config(args)
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.schedule, cfg.chunks, cfg.recompute, cfg.steps, cfg.lr, cfg.exit_after) == \
        (1, 4, 2, "interleaved", 2, "full", 7, 1e-3, 3)  # interleaved without --chunks: v = 2
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.tie_embeddings, cfg.sequence_parallel) == (8, 64, True, True)


@pytest.mark.parametrize("flags, message", [
    (["--tp", "3"], "heads (4) must be divisible by tp (3)"),
    (["--microbatches", "5"], "batch_size per replica (16) must be divisible by microbatches (5)"),
    (["--schedule", "dualpipe"], "schedule must be one of {gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zb-h2, zb-v, "
                                 "v-half, v-min, dualpipe-v}, got 'dualpipe'"),
    (["--recompute", "often"], "recompute must be one of {none, selective, full, sqrt, recompute-all} or a positive "
                               "integer k, got 'often'"),
    (["--arch", "llama", "--kv-heads", "3"], "heads (4) must be divisible by kv_heads (3)"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0, got 0.0"),
    (["--init-from", "/nonexistent"], "/nonexistent: no config.json (expected a Hugging Face model directory)"),
    (["--layers", "6", "--pp", "4"], "layers (6) must be divisible by the number of pipeline stages (pp * chunks) (4)"),
    (["--resume"], "resume needs checkpoint_dir"),
    (["--dtype", "float64"], "--dtype float64 is retired: use --precision fp32 (was float32), fp64 (was float64) or bf16"),
    (["--precision", "fp16"], "precision 'fp16' is not supported: fp16 needs loss scaling"),
    (["--zero", "2"], "zero must be one of {0, 1}, got 2"),
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
    code = main(["train", "--tp", "1", "--pp", "2", "--hidden", "32", "--seq-len", "16", "--steps", "4",
                 "--batch-size", "4", "--microbatches", "2", "--eval-every", "2", "--no-progress", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 4 and [s for s, _ in summary["val"]] == [2, 4]
    assert 0 < summary["bubble_measured"] < 1 and summary["bubble_ideal"] == pytest.approx(1 / 3)  # (p-1)/(m+p-1)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["event"], m["step"]) for m in metrics] == [("step", 1), ("step", 2), ("eval", 2), ("step", 3),
                                                          ("step", 4), ("eval", 4)]
    assert [m["loss"] for m in metrics if m["event"] == "step"] == summary["losses"]
    assert all(m["step_time"] > 0 and m["peak_memory_mb"] > 0 and m["lr"] > 0 for m in metrics if m["event"] == "step")
    steps = [m for m in metrics if m["event"] == "step"]  # rank 0's accounting: fp32 AdamW is two moments, d = 1
    assert all(m["optimizer_state_bytes"] == summary["optimizer_state_bytes"] == 2 * m["gradient_bytes"] > 0
               and m["dp_bytes_sent"] == 0.0 for m in steps)
    assert [m["val_bpb"] for m in metrics if m["event"] == "eval"] == pytest.approx(
        [v / math.log(2) for _, v in summary["val"]])  # bytes: bits per byte = nats / ln 2
    assert "unigram baseline" in capsys.readouterr().out
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


@pytest.mark.parametrize("schedule", ["zb-v", "v-half", "v-min", "dualpipe-v", "looped-bfs"])
def test_two_chunk_schedules_default_to_v_2(schedule):
    args = build_parser().parse_args(["train", "--tp", "1", "--pp", "2", "--schedule", schedule, "--layers", "4"])
    cfg = build_config(args).check()
    assert (cfg.schedule, cfg.chunks) == (schedule, 2)
