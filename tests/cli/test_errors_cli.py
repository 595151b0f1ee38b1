"""One line instead of a traceback, for what a user can get wrong before a run or around it.

Paths that cannot be written (a file, a read-only file system, a read-only working directory for
the token cache), a model that cannot fit in memory, ``generate`` on non-finite weights or a
missing GPU, export metadata that is not JSON, a schedule file with an absurd index, a malformed
JSONL line. Each: exit code 2, one line naming the cause, no rank started, nothing written.
"""

import json
import os
import re

import pytest
import torch

from modelpar.cli import main
from modelpar.commands import preflight
from modelpar.model import ModelConfig, build_stage
from modelpar.training import TrainConfig
from tests.tmpfs import tmpfs

TINY = ["--tp", "1", "--pp", "1", "--hidden", "32", "--heads", "2", "--layers", "2", "--seq-len", "16",
        "--batch-size", "4", "--microbatches", "2", "--steps", "2", "--no-progress"]


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if a run starts a rank: every refusal here comes first."""
    import modelpar.training.start as launch_module

    monkeypatch.setattr(launch_module, "LocalCluster", lambda *a, **k: pytest.fail("a rank was started"))


def one_line(capsys, command, args):
    code = main([command, *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith(f"modelpar {command}: error: "), (code, err)
    return err[len(f"modelpar {command}: error: "):]


# --- paths ------------------------------------------------------------------------------------------------
def test_paths_that_cannot_be_written_are_one_line_before_any_rank(capsys, tmp_path, monkeypatch, no_ranks):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("not a folder")
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert one_line(capsys, "train", [*TINY, *cache, "--out", "file"]) == "--out 'file' is a file: give a folder to write in"
    assert one_line(capsys, "train", [*TINY, *cache, "--checkpoint-dir", "file/sub"]) == (
        f"--checkpoint-dir 'file/sub' cannot be created: {str(tmp_path / 'file')!r} is a file")
    with tmpfs(tmp_path / "ro", read_only=True) as ro:
        assert one_line(capsys, "train", [*TINY, *cache, "--out", str(ro / "out")]) == (
            f"--out {str(ro / 'out')!r} cannot be created: {str(ro)!r} is not writable (a read-only file system)")
        assert one_line(capsys, "train", [*TINY, *cache, "--checkpoint-dir", str(ro)]) == (
            f"--checkpoint-dir {str(ro)!r} is not writable (a read-only file system)")
        monkeypatch.chdir(ro)  # the default token cache is ./modelpar-cache
        assert one_line(capsys, "train", [*TINY, "--out", str(tmp_path / "out")]) == (
            f"the token cache (--cache-dir) 'modelpar-cache' cannot be created: {str(ro)!r} is not writable "
            "(a read-only file system)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "ro"]  # nothing written


# --- memory -----------------------------------------------------------------------------------------------
def test_a_model_that_cannot_fit_is_refused_with_the_figure(capsys, monkeypatch, tmp_path, no_ranks):
    monkeypatch.setattr(preflight, "_host_memory", lambda: 24 * 10**9)  # the 23 GB machine, give or take
    monkeypatch.chdir(tmp_path)
    # 51.6 G parameters; fp32: weights 4 + gradients 4 + AdamW 8 bytes each; t = 2, p = 2: half the layers
    # and the embedding with the positions (the first stage), split two ways, on the busiest rank
    err = one_line(capsys, "train", ["--hidden", "8192", "--layers", "64", "--no-progress"])
    assert err == ("the model does not fit: 4 ranks here need at least 824.9 GB for their weights, gradients and "
                   "AdamW state (206.2 GB each; 51,551,158,272 parameters, fp32, t=2 p=2 d=1), this machine has "
                   "24.0 GB; use a smaller model or more machines")
    model = ModelConfig(hidden=8192, layers=64)
    per_layer = 12 * 8192**2 + 13 * 8192  # Megatron's count with biases and two LayerNorms
    busiest = (32 * per_layer + (model.padded_vocab_size + model.seq_len) * 8192) / 2 * 16
    assert f"({busiest / 1e9:,.1f} GB each" in err
    assert one_line(capsys, "train", ["--hidden", "1048576", "--no-progress"]).startswith(
        "the model does not fit: 4 ranks here need at least 844,439.1 GB")
    preflight.check_memory(TrainConfig(), 4)  # the default model fits
    with pytest.raises(ValueError, match=r"each rank needs at least 206.2 GB .* a GPU here has 80.0 GB"):
        preflight.check_memory(TrainConfig(model=model), 1, device_bytes=80 * 10**9)
    assert list(tmp_path.iterdir()) == []


# --- generate and export ------------------------------------------------------------------------------------
def _export(path, poison=None, config=None):
    from safetensors.torch import save_file

    cfg = ModelConfig(seq_len=16, hidden=32, heads=4, layers=2, init_std=0.3)
    tensors = {k: v.contiguous() for k, v in build_stage(cfg, seed=1).state_dict().items()}
    if poison is not None:
        tensors["layers.1.mlp.fc1.weight"][0, 0] = poison
    meta = json.dumps(cfg.to_dict()) if config is None else config
    save_file(tensors, str(path), metadata={"format": "modelpar", "config": meta})
    return path


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", ["1", "0"])
def test_generate_on_non_finite_weights_says_so(capsys, tmp_path, poison, temperature):
    path = _export(tmp_path / "model.safetensors", poison)
    err = one_line(capsys, "generate", [str(path), "--prompt", "Hi", "--temperature", temperature, "--device", "cpu"])
    assert err == f"{str(path)!r} holds non-finite weights (NaN or inf): its logits are not finite"
    assert capsys.readouterr().out == ""  # no NUL bytes printed


def test_export_metadata_that_is_not_json_names_the_file_and_the_field(capsys, tmp_path):
    for config, why in (("{not json", r"Expecting property name enclosed in double quotes"),
                        ("[1, 2]", r"a JSON list, not an object"),
                        ('{"hidden": 32, "colour": 1}', r"model config: unknown key 'colour'; allowed: vocab_size, ")):
        path = _export(tmp_path / "model.safetensors", config=config)
        err = one_line(capsys, "generate", [str(path), "--prompt", "Hi", "--device", "cpu"])
        assert re.fullmatch(rf"{re.escape(repr(str(path)))}: its safetensors metadata field 'config' is not a model "
                            rf"config as JSON \({why}.*\)", err), err


def test_generate_on_a_device_this_machine_lacks(capsys, tmp_path):
    path = _export(tmp_path / "model.safetensors")
    assert one_line(capsys, "generate", [str(path), "--prompt", "Hi", "--device", "tpu9"]) == (
        "--device must be auto, cpu, cuda or cuda:N, got 'tpu9'")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert one_line(capsys, "generate", [str(path), "--prompt", "Hi", "--device", f"cuda:{count}"]).startswith(
            f"--device cuda:{count}: this machine has {count} CUDA device")
    else:
        assert one_line(capsys, "generate", [str(path), "--prompt", "Hi", "--device", "cuda"]) == (
            "--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use --device cpu")


# --- simulate and data --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, actions", [("0F0 0F99999999999999999999", 2), ("0F0 99999999999999999999F0", 2),
                                           ("device 99999999999999999999: 0F0", 1)])
def test_simulate_from_a_schedule_with_an_absurd_index(capsys, tmp_path, text, actions):
    path = tmp_path / "s.txt"
    path.write_text(text + "\n")
    assert one_line(capsys, "simulate", ["--from", str(path)]) == (
        f"--from {str(path)!r}: index 99999999999999999999 is larger than a schedule of {actions} "
        "actions can use (stages and microbatches are numbered 0, 1, ..., each one present)")


def test_a_malformed_jsonl_line_is_one_whole_sentence(capsys, tmp_path, monkeypatch, no_ranks):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n{"text": "unterminated\n')
    err = one_line(capsys, "train", [*TINY, "--data", str(data), "--cache-dir", str(tmp_path / "cache")])
    assert err == f"data file {str(data)!r} line 2 is not JSON (Invalid control character at column 23)"
    data.write_text('{"text": "hello"}\n{"text": 1,,}\n')
    err = one_line(capsys, "train", [*TINY, "--data", str(data), "--cache-dir", str(tmp_path / "cache")])
    assert err == f"data file {str(data)!r} line 2 is not JSON (Expecting property name enclosed in double quotes at column 12)"


# --- context parallelism ----------------------------------------------------------------------------------
def test_bad_context_parallel_settings_are_one_line_before_any_rank(capsys, monkeypatch, no_ranks):
    assert one_line(capsys, "train", [*TINY, "--cp", "3"]) == (
        "seq_len (16) must be divisible by 2 * cp (6): context parallelism splits every sequence into 2·cp equal "
        "chunks (no padding)")
    assert one_line(capsys, "train", [*TINY, "--cp", "2", "--cp-comm", "ulysses"]) == (
        "cp_comm must be one of {ring, allgather}, got 'ulysses'")
    assert one_line(capsys, "train", [*TINY, "--cp", "0"]) == "cp must be >= 1, got 0"
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)  # under torchrun: cp must divide the world, refused before joining it
    assert one_line(capsys, "train", [*TINY, "--cp", "2"]) == (
        "tp * cp * pp * dp = 1 * 2 * 1 * 1 = 2 must equal the number of processes (world size 3)")


# --- messages that name what is wrong (issue 35 #13, and the small ones) -------------------------------------
def test_config_files_that_are_not_utf8_or_hold_nan_name_the_file(capsys, tmp_path, monkeypatch, no_ranks):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.toml").write_bytes("[optimisation]\n# Grüße\nlr = 0.01\n".encode("latin-1"))
    (tmp_path / "nan.toml").write_text("[optimisation]\nlr = nan\n")
    (tmp_path / "inf.json").write_text('{"run": {"peak_tflops": Infinity}}')
    assert one_line(capsys, "train", [*TINY, "--config", "latin1.toml"]) == (
        "--config 'latin1.toml' is not UTF-8 text (byte 0xfc at offset 19): TOML and JSON files are UTF-8")
    assert one_line(capsys, "train", [*TINY, "--config", "nan.toml"]) == (
        "nan.toml: [optimisation] lr must be a finite number, got nan")
    assert one_line(capsys, "train", [*TINY, "--config", "inf.json"]) == (
        "inf.json: [run] peak_tflops must be a finite number, got inf")
    assert one_line(capsys, "train", [*TINY, "--timeout", "nan"]) == "--timeout must be a finite number, got nan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inf.json", "latin1.toml", "nan.toml"]


def test_small_flags_name_themselves_and_what_is_allowed(capsys, tmp_path, monkeypatch, no_ranks):
    monkeypatch.chdir(tmp_path)
    for flags in (["--stage-layers", "-1,5"], ["--stage-layers=-1,5"]):  # not an argparse usage dump
        assert one_line(capsys, "train", [*TINY, "--pp", "2", *flags]) == (
            "stage_layers -1,5: entries must be whole numbers >= 0")
    # checked before the planner runs (it said "no layout the trainer runs splits this model on 1 ranks")
    assert one_line(capsys, "train", [*TINY, "--plan", "auto", "--memory-limit-gb", "-1"]) == (
        "memory_limit_gb must be >= 0.0, got -1.0")
    assert one_line(capsys, "simulate", ["--backward-ratio", "0"]) == "--backward-ratio must be > 0.0, got 0.0"
    assert list(tmp_path.iterdir()) == []


def test_a_long_one_line_text_file_is_named_as_such(capsys, tmp_path, monkeypatch, no_ranks):
    monkeypatch.chdir(tmp_path)
    text = tmp_path / "one-line.txt"
    text.write_text("lorem ipsum " * 50_000)  # 600,000 characters, no line break: one document
    err = one_line(capsys, "train", [*TINY, "--data", str(text), "--cache-dir", str(tmp_path / "cache")])
    assert err == (f"data {text!s} (1 file(s), 0.6 MB) has 1 document(s): too few to hold out 1 for validation and "
                   "train on the rest (documents are whole files, JSONL lines or table rows; text files are cut at line "
                   f"breaks every 64 k characters; {str(text)!r} (600,000 characters) has no line break to cut at: add "
                   "line breaks, or give the text as more files or as JSONL)")
    assert list(tmp_path.iterdir()) == [text]


def test_a_leftover_of_a_removal_is_not_called_an_unfinished_save(capsys, tmp_path):
    ckpt = tmp_path / "ck"
    (ckpt / ".step_00000004.old-0badf00d").mkdir(parents=True)  # a pruned checkpoint whose rmtree was cut short
    code = main(["train", *TINY, "--steps", "1", "--checkpoint-dir", str(ckpt), "--out", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache")])
    notes = [line for line in capsys.readouterr().err.splitlines() if "removed" in line]
    assert code == 0 and notes == [f"modelpar train: removed {str(ckpt / '.step_00000004.old-0badf00d')!r}, a "
                                   "checkpoint whose removal never completed (replaced or pruned)"]


def test_a_full_disk_under_out_is_one_line_and_leaves_no_empty_lock_or_summary(capsys, tmp_path, monkeypatch):
    """Issue 35: --out on a full file system, at the lock, at a metrics write (during the run) and at
    summary.json (after it). Each: one line naming the file, exit 2, no 0-byte lock or summary, no torn
    line, no rank left."""
    from modelpar.training import prediction
    from tests._ranks import rank_processes

    run = [*TINY, "--eval-batches", "1", "--precision", "fp64", "--cache-dir", str(tmp_path / "cache")]
    with tmpfs(tmp_path / "disk", size="1m") as disk:
        out, filler = disk / "out", disk / "filler"

        def fill(free_pages=0):
            filler.write_bytes(b"")
            filler.write_bytes(bytes(os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - free_pages * 4096))

        fill()
        assert one_line(capsys, "train", [*run, "--out", str(out)]) == (
            f"cannot write the lock {str(out / preflight.OUT_LOCK)!r}: no space left on device")
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]

        def last_line(*flags):  # a run that started: its banner, then the error
            code = main(["train", *run, "--out", str(out), *flags])
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 2 and err[0].startswith("modelpar train: 1 local processes"), err
            return err[-1]

        fill(free_pages=2)  # a page for the lock, one for metrics.jsonl: full after about 10 of 12 steps
        assert last_line("--steps", "12") == (
            f"modelpar train: error: cannot write metrics {str(out / 'metrics.jsonl')!r}: no space left on device")
        metrics = (out / "metrics.jsonl").read_text()
        assert metrics.endswith("\n") and 5 < len([json.loads(line) for line in metrics.splitlines()]) < 16
        assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"] and rank_processes() == []

        real = prediction.summary_rows
        monkeypatch.setattr(prediction, "summary_rows", lambda *a: (real(*a), fill())[0])  # full just before it
        filler.write_bytes(b"")
        assert last_line() == (f"modelpar train: error: cannot write the run summary {str(out / 'summary.json')!r}: "
                               "no space left on device")
        assert sorted(p.name for p in out.iterdir()) == ["loss.png", "metrics.jsonl"] and rank_processes() == []
