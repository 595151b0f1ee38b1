"""``modelpar train``: train a small GPT or Llama with tensor × pipeline × data parallelism (§6).

With no flags: t = 2, p = 2, d = 1 on 4 local processes (gloo), a few minutes on a 2-core CPU.
Under ``torchrun`` the same command runs in the launcher's processes (NCCL on GPUs). Settings
left out keep ``TrainConfig`` / ``ModelConfig``'s defaults (imported only when the command runs,
so other commands start without torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_MODEL = "model (defaults: GPT, h=128, L=4, a=4, s=64, byte vocabulary 256)"
# Flags by help group: (name, int | float | str, or bool for a switch, help). A flag sets the
# ModelConfig field of its name in the model group and the TrainConfig field of its name elsewhere.
_FLAGS: dict[str, list[tuple[str, type, str]]] = {
    _MODEL: [
        ("arch", str, "gpt (LayerNorm, learned positions, GeLU, biases) or llama (RMSNorm, rotary, SwiGLU, GQA)"),
        ("hidden", int, "model width h"),
        ("layers", int, "transformer layers L (divisible by p·v)"),
        ("heads", int, "attention heads a (divisible by t)"),
        ("kv_heads", int, "key/value heads of grouped-query attention (llama; default: one per head)"),
        ("seq_len", int, "context length s"),
        ("ffn", int, "MLP width (default 4h for gpt, 8h/3 rounded up to 64 for llama)"),
        ("tie_embeddings", bool, "share the input embedding with the output layer (summed across stages)"),
        ("norm_eps", float, "epsilon of LayerNorm / RMSNorm (default 1e-5)"),
        ("rope_theta", float, "rotary embedding base (llama, default 10000)"),
    ],
    "parallelism (default t=2, p=2, d=1, 1f1b, 4 micro-batches)": [
        ("tp", int, "tensor-parallel size t"),
        ("pp", int, "pipeline stages p"),
        ("dp", int, "data-parallel replicas d"),
        ("schedule", str, "gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zb-h2, zb-v, v-half, v-min or dualpipe-v"),
        ("chunks", int, "model chunks v per rank: >= 2 with interleaved / looped-bfs (default 2), 2 with the V "
                        "shapes zb-v, v-half, v-min, dualpipe-v, else 1"),
        ("microbatches", int, "micro-batches m per replica"),
        ("recompute", str, "activation recomputation: none, selective (attention core), full (stage input), "
                           "k (every k layers), sqrt"),
        ("sequence_parallel", bool, "shard LayerNorm and residual activations along the sequence"),
        ("pipeline_gloo", bool, "under NCCL: send pipeline activations over gloo through host memory "
                                "(default: NCCL, tensors stay on the GPU)"),
    ],
    "optimisation (defaults: 300 steps, batch 16, AdamW lr 3e-3, clip 1.0)": [
        ("steps", int, "optimizer steps"),
        ("batch_size", int, "global batch in sequences"),
        ("lr", float, "peak learning rate (warm-up, cosine decay to lr/10)"),
        ("warmup", int, "warm-up steps"),
        ("weight_decay", float, "AdamW weight decay on matrices"),
        ("clip", float, "max global gradient norm (0: off)"),
        ("seed", int, "seed of the initial weights and the batches"),
    ],
    "numerics and data parallelism (docs/numerics.md)": [
        ("precision", str, "fp32 (default), bf16 (bfloat16 compute, fp32 master weights and AdamW) or fp64"),
        ("zero", int, "1: ZeRO-1, AdamW state sharded over the d replicas (reduce-scatter, update, all-gather); "
                      "0 (default): every replica holds all of it"),
        ("no_overlap_grad_reduce", bool, "reduce the gradients over d after the pipeline step (default: each "
                                         "bucket during the backward, as soon as its gradients are final)"),
        ("bucket_mb", float, "MiB of gradients per data-parallel collective (default 25)"),
    ],
    "evaluation, checkpoints, output": [
        ("eval_every", int, "validation loss every this many steps (0: at the end)"),
        ("eval_batches", int, "validation batches per evaluation"),
        ("checkpoint_dir", str, "write sharded checkpoints here (torch.distributed.checkpoint)"),
        ("checkpoint_every", int, "checkpoint every this many steps (0: at the end)"),
        ("keep", int, "complete checkpoints kept (default 2)"),
        ("resume", bool, "continue from the latest complete checkpoint in --checkpoint-dir, at any split; "
                         "the model, data and optimisation settings left out come from the checkpoint"),
        ("init_from", str, "start from a Hugging Face Llama directory's weights (config.json + model.safetensors; "
                           "the model shape comes from it)"),
        ("exit_after", int, "stop after this many steps with a checkpoint (time-limited jobs)"),
        ("timeout", float, "seconds a collective or pipeline receive may wait before the run fails "
                           "(default 300: a hung rank ends the run with an error)"),
    ],
    "stopping and preemption (docs/stopping.md)": [
        ("preempt_signal", str, "signal that asks for a checkpoint at the next step and an exit with code 75: "
                                "SIGTERM (default), SIGUSR1 or SIGUSR2"),
        ("preempt_grace", float, "seconds from that signal within which the checkpoint must be written, "
                                 "else none is (default 30; 0: no limit)"),
        ("skip_nonfinite", int, "skip the update of up to N steps with a non-finite loss or gradient norm "
                                "(default 0: stop at the first, exit code 65)"),
    ],
}
_DATA = "data (default: the shipped corpus, byte tokens; see docs/data.md)"
# Flags that set DataConfig fields: (flag name, type, help); --data may be given many times.
_DATA_FLAGS: list[tuple[str, type, str]] = [
    ("data", str, "a text, JSONL, Parquet or Arrow file, or a folder of them (repeat for more)"),
    ("data_glob", str, "file names taken from --data folders, recursively (default '*', hidden skipped)"),
    ("text_field", str, "the JSONL / table field holding the text (default 'text')"),
    ("val_fraction", float, "share of documents held out for validation (default 0.01, at least one)"),
    ("tokenizer", str, "bytes (default), bpe (trained on the training split) or a tokenizer.json file"),
    ("vocab_size", int, "the vocabulary to train with --tokenizer bpe (257 ... 65,535 with uint16)"),
    ("token_dtype", str, "token cache dtype: auto (default), uint16 or uint32"),
    ("cache_dir", str, "token cache folder (default: modelpar-cache beside --checkpoint-dir, or ./modelpar-cache)"),
]
_DATA_FIELDS = {"data": "paths", "data_glob": "glob"}  # flag name -> DataConfig field where they differ


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a GPT or Llama with 3D parallelism (local processes or torchrun)",
                              description="Train a small GPT- or Llama-style model with tensor x pipeline x data "
                                          "parallelism (reference §6).")
    for title, flags in _FLAGS.items():
        group = p.add_argument_group(title)
        for name, kind, text in flags:
            flag = "--" + name.replace("_", "-")
            if kind is bool:
                group.add_argument(flag, action="store_true", default=None, help=text)
            else:
                group.add_argument(flag, type=kind, help=text)
    d = p.add_argument_group(_DATA)
    for name, kind, text in _DATA_FLAGS:
        d.add_argument("--" + name.replace("_", "-"), type=kind, help=text, action="append" if name == "data" else None)
    r = p.add_argument_group("run")
    r.add_argument("--out", default="modelpar-train",
                   help="folder for metrics.jsonl, loss.png and summary.json (default %(default)s)")
    r.add_argument("--tensorboard", action="store_true",
                   help="also write the metrics as TensorBoard event files in OUT/tensorboard (the tensorboard extra)")
    r.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="under torchrun: process-group backend (auto: nccl with GPUs, else gloo)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI)")
    r.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per device for the MFU (default: known GPUs by name; on CPUs no MFU)")
    p.add_argument("--dtype", help=argparse.SUPPRESS)  # retired: a one-line error pointing to --precision
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> Any:
    """The TrainConfig the flags describe (flags left out keep the defaults)."""
    from dataclasses import replace

    from modelpar.text import DataConfig
    from modelpar.training import TrainConfig

    if getattr(args, "dtype", None) is not None:
        raise ValueError(f"--dtype {args.dtype} is retired: use --precision fp32 (was float32), fp64 (was float64) "
                         "or bf16")
    cfg = TrainConfig()
    data = {_DATA_FIELDS.get(name, name): getattr(args, name) for name, _, _ in _DATA_FLAGS
            if getattr(args, name, None) is not None}
    if "paths" in data:
        data["paths"] = tuple(data["paths"])
    given = {name: group for group, flags in _FLAGS.items() for name, _, _ in flags
             if getattr(args, name, None) is not None}
    model = {name: getattr(args, name) for name, group in given.items() if group == _MODEL}
    run = {name: getattr(args, name) for name, group in given.items() if group != _MODEL}
    if "recompute" in run:
        run["recompute"] = str(run["recompute"]).lower()
    if "preempt_signal" in run:  # TERM, term, SIGTERM
        name = str(run["preempt_signal"]).upper()
        run["preempt_signal"] = name if name.startswith("SIG") else "SIG" + name
    if run.pop("no_overlap_grad_reduce", False):
        run["overlap_grad_reduce"] = False
    if run.get("schedule") in ("interleaved", "looped-bfs", "zb-v", "v-half", "v-min", "dualpipe-v") \
            and "chunks" not in run:
        run["chunks"] = 2
    base = cfg.model
    if "init_from" in run:  # the shape is the directory's; flags may only repeat it (or shorten seq_len)
        from modelpar.hf import read_hf_config

        base = read_hf_config(run["init_from"], seq_len=model.pop("seq_len", None))
    cfg = replace(cfg, model=replace(base, **model), data=DataConfig(**data), **run)
    if cfg.resume and cfg.checkpoint_dir:
        cfg = _continued(cfg, set(given) | ({"data"} if data else set()))
    return cfg


def _continued(cfg: Any, given: set[str]) -> Any:
    """With --resume: the model, data and optimisation settings not on the command line come from the checkpoint."""
    from modelpar.checkpoint import latest_checkpoint, read_meta
    from modelpar.training.state import resumed_config

    path = latest_checkpoint(cfg.checkpoint_dir)
    return cfg if path is None else resumed_config(cfg, read_meta(path), given)


def run(args: argparse.Namespace) -> int:
    """Train; exit code 0, or the stop's (docs/stopping.md): 130 Ctrl-C, 75 preempted, 65 non-finite."""
    import os

    from rich.console import Console

    from modelpar.distributed import is_torchrun
    from modelpar.text import prepare_data
    from modelpar.training.launch import run_in_process, run_local
    from modelpar.training.metrics import MetricsLog, Reporters
    from modelpar.training.report import Display
    from modelpar.training.resume import check_directory, check_resume

    cfg = build_config(args)
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    console = Console(stderr=True)
    metrics = MetricsLog(args.out, tensorboard=args.tensorboard)
    display = Display(console, title=f"t={cfg.tp} p={cfg.pp} d={cfg.dp} {cfg.schedule}", progress=not args.no_progress)
    report = Reporters(display, metrics)
    if is_torchrun():
        result = run_in_process(cfg, report, backend=None if args.backend == "auto" else args.backend)
        first = os.environ["RANK"] == "0"  # global rank 0 speaks for the run
    else:
        check_directory(cfg.check())  # locked by a live run: exit before writing anything or starting ranks
        cfg = prepare_data(cfg, console, progress=not args.no_progress).check()
        check_resume(cfg)  # a checkpoint of another model, data or optimisation: exit before starting ranks
        console.print(f"modelpar train: {cfg.dims.world_size} local processes (t={cfg.tp}, p={cfg.pp}, "
                      f"d={cfg.dp}), {cfg.model.num_parameters():,} parameters, {cfg.steps} steps",
                      highlight=False, soft_wrap=True)  # one line, whatever the terminal's width
        result, first = run_local(cfg, report), True
    if result.stop is not None:
        report.close()
        if first:
            print(f"modelpar train: {result.stop.message}", file=sys.stderr, flush=True)
        return result.stop.exit_code
    if first:
        _summary(cfg, result, Path(args.out), args.peak_tflops)
    return 0


def _summary(cfg: Any, result: Any, out: Path, peak_tflops: float | None) -> None:
    from rich.console import Console

    from modelpar.training.report import peak_tflops_of, plot_losses, summary_table

    peak = peak_tflops or peak_tflops_of(result.device_name)
    mfu = result.flops_per_token * result.tokens_per_s / (cfg.dims.world_size * peak * 1e12) if peak else None

    final_val = result.val[-1][1] if result.val else float("nan")
    bpb = result.bits_per_byte
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rows = [
        ("split (t, p, d)", f"({cfg.tp}, {cfg.pp}, {cfg.dp}), {cfg.schedule}, m={cfg.microbatches}"),
        ("parameters", f"{result.num_parameters:,}"),
        ("steps", f"{len(result.losses)} (this run from step {result.start_step})"
                  + (f", {result.skipped_steps} updates skipped (non-finite)" if result.skipped_steps else "")),
        ("final training loss", f"{result.losses[-1]:.4f}" if result.losses else "-"),
        ("data", _describe_data(cfg)),
        ("final validation loss", f"{final_val:.4f} nats/token, {bpb(final_val):.4f} bits/byte"),
        ("unigram baseline", f"{result.unigram_baseline:.4f} nats/token, {bpb(result.unigram_baseline):.4f} bits/byte"),
        ("throughput", f"{result.tokens_per_s:,.0f} tokens/s (median step)"),
        ("model FLOPs per token", f"{result.flops_per_token:,.0f} (forward + backward)"),
        ("MFU", f"{100 * mfu:.2f}% of {peak:g} TFLOP/s x {cfg.dims.world_size}" if mfu is not None
         else "- (pass --peak-tflops)"),
        ("precision", _PRECISION[cfg.precision]),
        ("data parallel", f"ZeRO-{cfg.zero}, {result.buckets} bucket{'s' if result.buckets != 1 else ''}, "
                          + ("overlapped" if cfg.overlap_grad_reduce and cfg.dp > 1 else "after the step")),
        ("rank 0: AdamW state, grads", f"{_mib(result.optimizer_state_bytes)}, {_mib(result.gradient_bytes)}"),
        ("rank 0: dp sent, exposed", f"{_mib(result.dp_bytes_sent)}/step, " + (
            "-" if result.exposed_reduction is None else f"{1e3 * result.exposed_reduction:.1f} ms")),
        ("pipeline message", ", ".join(f"{b / 1024:,.1f} KiB" for b in (result.message_bytes or []) if b) or "-"),
        ("pipeline bubble, measured", pct(result.bubble_measured)),
        ("  simulated with measured costs", pct(result.bubble_simulated)),
        ("  simulated, equal stages F=1 B=2", pct(result.bubble_ideal)),
    ]
    png = plot_losses(out / "loss.png", result.losses, result.val, result.unigram_baseline,
                      f"{cfg.model.arch} {result.num_parameters:,} params, t={cfg.tp} p={cfg.pp} d={cfg.dp} {cfg.schedule}")
    summary = {"config": cfg.to_dict(), "losses": result.losses, "val": result.val,
               "tokens_per_s": result.tokens_per_s, "unigram_baseline": result.unigram_baseline,
               "bubble_measured": result.bubble_measured, "bubble_simulated": result.bubble_simulated,
               "bubble_ideal": result.bubble_ideal, "start_step": result.start_step,
               "tokens_per_byte": result.tokens_per_byte, "val_bits_per_byte": bpb(final_val),
               "unigram_bits_per_byte": bpb(result.unigram_baseline),
               "num_parameters": result.num_parameters, "flops_per_token": result.flops_per_token,
               "device": result.device_name, "peak_tflops": peak, "mfu": mfu, "skipped_steps": result.skipped_steps,
               "optimizer_state_bytes": result.optimizer_state_bytes, "gradient_bytes": result.gradient_bytes,
               "dp_bytes_sent": result.dp_bytes_sent, "exposed_reduction": result.exposed_reduction,
               "message_bytes": result.message_bytes}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    rows.append(("loss curve", str(png)))
    rows.append(("metrics", str(out / "metrics.jsonl")))
    Console().print(summary_table(rows))  # the summary on stdout, the progress on stderr


_PRECISION = {"fp32": "fp32", "bf16": "bf16 (fp32 master weights)", "fp64": "fp64"}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


def _describe_data(cfg: Any) -> str:
    data = cfg.data
    more = f" and {len(data.paths) - 1} more" if len(data.paths) > 1 else ""
    source = data.paths[0] + more if data.paths else "shipped corpus"
    tokenizer = data.tokenizer + (f" {data.vocab_size}" if data.vocab_size else "")
    return f"{source}; {tokenizer} (vocabulary {cfg.model.vocab_size:,})"
