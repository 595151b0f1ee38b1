"""``modelpar train``: train a small GPT with tensor × pipeline × data parallelism (§6).

With no flags: t = 2, p = 2, d = 1 on 4 local processes (gloo), a few minutes on a 2-core CPU.
Under ``torchrun`` the same command runs in the launcher's processes (NCCL on GPUs). Settings
left out keep ``TrainConfig`` / ``GPTConfig``'s defaults (imported only when the command runs,
so other commands start without torch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# flag -> (GPTConfig field); every other flag maps to the TrainConfig field of the same name.
_MODEL_FLAGS = {"hidden": "hidden", "layers": "layers", "heads": "heads", "seq_len": "seq_len",
                "ffn_mult": "ffn_mult", "tie_embeddings": "tie_embeddings"}
_RUN_FLAGS = ("tp", "pp", "dp", "schedule", "chunks", "microbatches", "batch_size", "recompute",
              "sequence_parallel", "steps", "lr", "warmup", "weight_decay", "clip", "seed", "dtype",
              "eval_every", "eval_batches", "checkpoint_dir", "checkpoint_every", "keep", "resume", "exit_after")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a GPT with 3D parallelism (local processes or torchrun)",
                              description=__doc__.splitlines()[0])
    m = p.add_argument_group("model (defaults: h=128, L=4, a=4, s=64, byte vocabulary 256)")
    m.add_argument("--hidden", type=int, help="model width h")
    m.add_argument("--layers", type=int, help="transformer layers L (divisible by p·v)")
    m.add_argument("--heads", type=int, help="attention heads a (divisible by t)")
    m.add_argument("--seq-len", type=int, help="context length s")
    m.add_argument("--ffn-mult", type=int, help="MLP width as a multiple of h (default 4)")
    m.add_argument("--tie-embeddings", action="store_true", default=None,
                   help="share the input embedding with the output layer (summed across stages)")
    s = p.add_argument_group("parallelism (default t=2, p=2, d=1, 1f1b, 4 micro-batches)")
    s.add_argument("--tp", type=int, help="tensor-parallel size t")
    s.add_argument("--pp", type=int, help="pipeline stages p")
    s.add_argument("--dp", type=int, help="data-parallel replicas d")
    s.add_argument("--schedule", help="gpipe, 1f1b, interleaved or zb-h1")
    s.add_argument("--chunks", type=int, help="model chunks v per rank for --schedule interleaved (default 2)")
    s.add_argument("--microbatches", type=int, help="micro-batches m per replica")
    s.add_argument("--recompute", help="activation recomputation per stage: none, full or k (every k layers)")
    s.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="shard LayerNorm and residual activations along the sequence")
    o = p.add_argument_group("optimisation (defaults: 300 steps, batch 16, AdamW lr 3e-3, clip 1.0)")
    o.add_argument("--steps", type=int, help="optimizer steps")
    o.add_argument("--batch-size", type=int, help="global batch in sequences")
    o.add_argument("--lr", type=float, help="peak learning rate (warm-up, cosine decay to lr/10)")
    o.add_argument("--warmup", type=int, help="warm-up steps")
    o.add_argument("--weight-decay", type=float, help="AdamW weight decay on matrices")
    o.add_argument("--clip", type=float, help="max global gradient norm (0: off)")
    o.add_argument("--seed", type=int, help="seed of the initial weights and the batches")
    o.add_argument("--dtype", help="float32 or float64")
    r = p.add_argument_group("evaluation, checkpoints, output")
    r.add_argument("--eval-every", type=int, help="validation loss every this many steps (0: at the end)")
    r.add_argument("--eval-batches", type=int, help="validation batches per evaluation")
    r.add_argument("--checkpoint-dir", help="write sharded checkpoints here (torch.distributed.checkpoint)")
    r.add_argument("--checkpoint-every", type=int, help="checkpoint every this many steps (0: at the end)")
    r.add_argument("--keep", type=int, help="complete checkpoints kept (default 2)")
    r.add_argument("--resume", action="store_true", default=None,
                   help="continue from the latest complete checkpoint in --checkpoint-dir")
    r.add_argument("--exit-after", type=int, help="stop after this many steps with a checkpoint (time-limited jobs)")
    r.add_argument("--out", default="modelpar-train", help="folder for loss.png and summary.json (default %(default)s)")
    r.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="under torchrun: process-group backend (auto: nccl with GPUs, else gloo)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI)")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> Any:
    """The TrainConfig the flags describe (flags left out keep the defaults)."""
    from dataclasses import replace

    from modelpar.training import TrainConfig

    cfg = TrainConfig()
    model = {f: getattr(args, flag) for flag, f in _MODEL_FLAGS.items() if getattr(args, flag, None) is not None}
    run = {f: getattr(args, f) for f in _RUN_FLAGS if getattr(args, f, None) is not None}
    if "recompute" in run:
        run["recompute"] = str(run["recompute"]).lower()
    return replace(cfg, model=replace(cfg.model, **model), **run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from modelpar.distributed import is_torchrun
    from modelpar.training.launch import run_in_process, run_local
    from modelpar.training.report import Display

    cfg = build_config(args)
    console = Console(stderr=True)
    display = None if args.no_progress else Display(console, title=f"t={cfg.tp} p={cfg.pp} d={cfg.dp} {cfg.schedule}")
    if is_torchrun():
        result = run_in_process(cfg, display, backend=None if args.backend == "auto" else args.backend)
        if result is None:  # not global rank 0: rank 0 writes the summary
            return 0
    else:
        cfg.check()
        console.print(f"modelpar train: {cfg.dims.world_size} local processes (t={cfg.tp}, p={cfg.pp}, "
                      f"d={cfg.dp}), {cfg.model.num_parameters():,} parameters, {cfg.steps} steps")
        result = run_local(cfg, display)
    _summary(cfg, result, Path(args.out))
    return 0


def _summary(cfg: Any, result: Any, out: Path) -> None:
    from rich.console import Console

    from modelpar.training.report import plot_losses, summary_table

    final_val = result.val[-1][1] if result.val else float("nan")
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rows = [
        ("split (t, p, d)", f"({cfg.tp}, {cfg.pp}, {cfg.dp}), {cfg.schedule}, m={cfg.microbatches}"),
        ("parameters", f"{result.num_parameters:,}"),
        ("steps", f"{len(result.losses)} (this run from step {result.start_step})"),
        ("final training loss", f"{result.losses[-1]:.4f}" if result.losses else "-"),
        ("final validation loss", f"{final_val:.4f} nats/byte"),
        ("unigram baseline", f"{result.unigram_baseline:.4f} nats/byte"),
        ("throughput", f"{result.tokens_per_s:,.0f} tokens/s (median step)"),
        ("pipeline bubble, measured", pct(result.bubble_measured)),
        ("  simulated with measured costs", pct(result.bubble_simulated)),
        ("  simulated, equal stages F=1 B=2", pct(result.bubble_ideal)),
    ]
    png = plot_losses(out / "loss.png", result.losses, result.val, result.unigram_baseline,
                      f"GPT {result.num_parameters:,} params, t={cfg.tp} p={cfg.pp} d={cfg.dp} {cfg.schedule}")
    summary = {"config": cfg.to_dict(), "losses": result.losses, "val": result.val,
               "tokens_per_s": result.tokens_per_s, "unigram_baseline": result.unigram_baseline,
               "bubble_measured": result.bubble_measured, "bubble_simulated": result.bubble_simulated,
               "bubble_ideal": result.bubble_ideal, "start_step": result.start_step}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    rows.append(("loss curve", str(png)))
    Console().print(summary_table(rows))  # the summary on stdout, the progress on stderr
