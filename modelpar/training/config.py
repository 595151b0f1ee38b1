"""What a training run is: the model, the (t, cp, p, d) split, the schedule and the optimisation.

``TrainConfig.check(world_size)`` validates everything before any process group work starts, so
bad input is the same clear ValueError on every rank (every rank checks the same config).

Each field is declared once with its help and its section (``modelpar._options.option``; the
sections are ``SECTIONS``: model, data, parallelism, schedule, optimisation, checkpoint, run):
``modelpar train``'s flags and argument groups, its ``--config`` file's tables, ``summary.json``
and the settings tables of docs/training.md are generated from them. Code reads the fields flat
(``cfg.tp``, ``cfg.microbatches``); the sections are how users see them.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from modelpar._options import SECTIONS, about, construct, field_infos, option
from modelpar._validate import check_choice, check_divisible, check_int, check_number
from modelpar.costmodel.moe import check_trainer_experts
from modelpar.costmodel.specs import check_trainer_context
from modelpar.distributed import ParallelDims
from modelpar.formulas import bubble_over_ideal_compute
from modelpar.layer_split import parse_split, resolve_split
from modelpar.model import ModelConfig
from modelpar.offload_plan import parse_offload
from modelpar.recompute.strategies import Strategy, parse_strategy, plan_recompute
from modelpar.schedules.registry import check_chunks, schedule_entry, schedule_names
from modelpar.schedules.rules import ANY_MICROBATCHES
from modelpar.tensor_parallel.context_parallel import CP_COMMS
from modelpar.tensor_parallel.head_loss import chunk_tokens
from modelpar.text.config import DataConfig
from modelpar.training.compile import COMPILE_SCOPES, check_compile_backend, check_compile_scope
from modelpar.training.precision import check_precision, compute_dtype, param_dtype

__all__ = ["PREEMPT_SIGNALS", "SCHEDULE_CHOICES", "TrainConfig", "default_microbatches"]

SCHEDULE_CHOICES = schedule_names(trains=True)  # the built-in ones (naive, M = 1, is for the simulator)
ZERO_CHOICES = (0, 1, 2, 3)  # ZeRO stages (docs/numerics.md)
_LEGACY_DTYPES = {"float32": "fp32", "float64": "fp64"}  # ``dtype`` of configs written before ``precision``
_RETIRED = ("dtype",)  # keys of older configs that from_dict accepts and drops
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
PLAN_CHOICES = ("none", "auto")  # train --plan: none (the flags' layout) or auto (the planner's)
BUBBLE_TARGET = 0.25  # the default m keeps the bubble at most this share of the ideal compute (20% of the step)


def _signal_name(text: str) -> str:
    """TERM, term, SIGTERM -> SIGTERM."""
    name = str(text).upper()
    return name if name.startswith("SIG") else "SIG" + name


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults: the `modelpar train` demo (t = 2, p = 2, d = 1, a few minutes on 2 CPU cores)."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata=about(
        "the model to train (GPT or Llama style): ModelConfig", section="model"))
    data: DataConfig = field(default_factory=DataConfig, metadata=about(
        "the text and its tokenizer (default: the shipped corpus, bytes): DataConfig", section="data"))
    tp: int = option(2, section="parallelism", help="t: tensor-parallel ranks (consecutive ranks, inside a machine)")
    pp: int = option(2, section="parallelism", help="p: pipeline-parallel ranks (positions along the pipeline)")
    dp: int = option(1, section="parallelism", help="d: data-parallel replicas")
    cp: int = option(1, section="parallelism", help="cp: context-parallel ranks; each sequence is split across them "
                                                     "(load-balanced zig-zag chunks; docs/context_parallel.md)")
    cp_comm: str = option("ring", section="parallelism", help="how attention sees the whole sequence with cp > 1: "
                                                              "ring (key/value blocks pass around the cp ranks, "
                                                              "overlapped) or allgather (key/value all-gathered)")
    ep: int = option(1, section="parallelism", help="expert-parallel ranks: the MoE layers' experts split over ep of "
                                                    "the d replicas (ep divides d and experts; docs/moe.md)")
    schedule: str = option("1f1b", section="schedule", help=f"pipeline schedule: {', '.join(SCHEDULE_CHOICES)}, or "
                                                            "auto: the fastest the cost model's stage times give "
                                                            "within memory_limit (docs/schedules.md)")
    memory_limit: float = option(0.0, section="schedule", help="with schedule auto: the most activations a pipeline "
                                                               "rank may hold, in micro-batches' worth of one whole "
                                                               "stage, as modelpar simulate --memory-limit (0: no "
                                                               "limit)")
    chunks: int = option(1, section="schedule", help="v: model chunks per pipeline rank: >= 2 with interleaved and "
                                                      "looped-bfs, 2 with the V shapes zb-v, v-half, v-min and "
                                                      "dualpipe-v (on the command line these default to 2), else 1")
    stage_layers: tuple[int, ...] | None = option(
        None, section="schedule", parse=parse_split, metavar="N,N,...",
        help="layers of each of the p·v (virtual) stages in pipeline order, e.g. 5,6,6,5; none: L/(p·v) each, the "
             "extra layers to the middle stages (modelpar.layer_split, as modelpar plan)")
    microbatches: int = option(0, section="schedule", help="m: micro-batches per replica per step; 0: chosen for the "
                                                            "pipeline (1 at p = 1, else the smallest m >= p whose "
                                                            f"bubble is <= {BUBBLE_TARGET:.0%} of the ideal compute), "
                                                            "the summary says why")
    batch_size: int = option(16, section="optimisation", help="global batch: sequences per optimizer step, all "
                                                               "replicas together")
    recompute: str = option("none", section="schedule", parse=str.lower,
                            help="activation recomputation: none, selective (attention core), full (stage input), "
                                 "sqrt, recompute-all or k (every k layers)")
    offload_activations: str = option("none", section="schedule", parse=parse_offload,
                                      help="saved activations moved to host memory in the forward and back for the "
                                           "backward: none, all, n (the first n layers of each stage) or every-k "
                                           "(every k-th layer); docs/recompute.md")
    sequence_parallel: bool = option(False, section="parallelism", help="shard LayerNorm and residual activations "
                                                                         "along the sequence (§5.6)")
    pipeline_gloo: bool = option(False, section="parallelism", help="under NCCL: pipeline messages over gloo, "
                                                                     "staged through host memory")
    steps: int = option(300, section="optimisation", help="optimizer steps")
    lr: float = option(3e-3, section="optimisation", help="peak AdamW learning rate (linear warm-up, cosine decay "
                                                          "to lr/10)")
    warmup: int = option(20, section="optimisation", help="warm-up steps")
    weight_decay: float = option(0.1, section="optimisation", help="AdamW decoupled weight decay, matrices only")
    clip: float = option(1.0, section="optimisation", help="gradient clipping: max global L2 norm over all shards "
                                                            "(0: off)")
    seed: int = option(0, section="optimisation", help="one seed: initial weights and batches (identical for "
                                                       "every split)")
    precision: str = option("fp32", section="optimisation", help="fp32, bf16 (autocast, fp32 master weights and "
                                                                 "AdamW) or fp64 (the tests); docs/numerics.md")
    loss_chunk_mb: float = option(256.0, section="optimisation", help="MiB of fp32 logits the loss forms at once: "
                                                                       "the head and cross entropy run over chunks "
                                                                       "of tokens this size (0: all tokens at once, "
                                                                       "the logits whole; docs/performance.md)")
    compile: bool = option(False, section="optimisation", help="torch.compile each transformer block (torchtitan's "
                                                                 "granularity); the summary reports the compile "
                                                                 "time (docs/performance.md)")
    compile_backend: str = option("inductor", section="optimisation", help="torch.compile's backend with compile: "
                                                                          "inductor (generated kernels), aot_eager "
                                                                          "(traced and differentiated, no code "
                                                                          "generation: quick, for checking), or any "
                                                                          "backend torch lists")
    compile_scope: str = option("block", section="optimisation", help="with compile, what one graph covers: "
                                                                      f"{' or '.join(COMPILE_SCOPES)} (block: each "
                                                                      "transformer block, with every dimension; "
                                                                      "stage: a stage's whole forward, as a "
                                                                      "hand-written model compiles; not with zero 3, "
                                                                      "split-backward schedules, recomputation or "
                                                                      "offload)")
    zero: int = option(0, section="parallelism", help="ZeRO stage over the d replicas: 0 every replica holds "
                                                      "everything; 1 AdamW state sharded; 2 and the gradients; 3 and "
                                                      "the parameters (docs/numerics.md)")
    reshard_after_forward: bool = option(True, section="parallelism", help="ZeRO-3: free gathered parameters after "
                                                                           "every forward (--no-reshard-after-"
                                                                           "forward: keep a stage's gathered from its "
                                                                           "first forward to its last backward of a "
                                                                           "step)")
    overlap_grad_reduce: bool = option(True, section="parallelism", help="start each gradient bucket's dp "
                                                                         "reduction during the backward")
    bucket_mb: float = option(25.0, section="parallelism", help="MiB of gradients per data-parallel collective")
    eval_every: int = option(50, section="run", help="validation loss every this many steps (0: only at the end)")
    eval_batches: int = option(4, section="run", help="validation batches per evaluation")
    checkpoint_dir: str | None = option(None, section="checkpoint", help="where sharded checkpoints go "
                                                                         "(torch.distributed.checkpoint; none: no "
                                                                         "checkpoints)")
    checkpoint_every: int = option(0, section="checkpoint", help="save every this many steps (0: only at the end, "
                                                                 "if a directory is set)")
    keep: int = option(2, section="checkpoint", help="valid checkpoints kept on disk (damaged ones are never counted; "
                                                     "docs/checkpoints.md)")
    async_checkpoint: bool = option(False, section="checkpoint", help="write checkpoints while training goes on: a "
                                                                      "copy in host memory, written by DCP's async_save "
                                                                      "(docs/checkpoints.md)")
    resume: bool = option(False, section="checkpoint", help="continue from the latest complete checkpoint in "
                                                            "checkpoint_dir, at any split; the model, data and "
                                                            "optimisation settings left out come from it")
    overwrite: bool = option(False, section="checkpoint", help="a fresh run into a checkpoint_dir that holds "
                                                               "checkpoints: delete them first (without it such a "
                                                               "run is refused; only modelpar checkpoints are deleted)")
    exit_after: int = option(0, section="checkpoint", help="stop after this many steps of this run, with a "
                                                           "checkpoint (needs checkpoint_dir; 0: run to the end); for "
                                                           "jobs with a time limit, as Megatron's --exit-interval")
    timeout: float = option(300.0, section="run", help="seconds a collective or pipeline receive may wait before "
                                                       "the run fails")
    preempt_signal: str = option("SIGTERM", section="run", parse=_signal_name,
                                 help="signal that asks for a checkpoint at the next step and an exit with code 75: "
                                      f"{', '.join(PREEMPT_SIGNALS[:-1])} or {PREEMPT_SIGNALS[-1]} (docs/stopping.md)")
    preempt_grace: float = option(30.0, section="run", help="seconds from that signal within which the checkpoint "
                                                            "must be written, else none is (0: no limit)")
    skip_nonfinite: int = option(0, section="optimisation", help="skip the update of up to this many steps with a "
                                                                 "non-finite loss or gradient norm (0: stop at the "
                                                                 "first, exit code 65)")
    init_from: str | None = option(None, section="checkpoint", help="a Hugging Face Llama directory whose weights "
                                                                    "the run starts from (config.json + "
                                                                    "model.safetensors; the model shape comes from it)")
    hardware: str | None = option(None, section="planning", help="hardware profile from modelpar calibrate, or a GPU "
                                                                  "name (a100-80gb, h100-sxm, ...): the prediction "
                                                                  "(and --plan auto) price the run on it (none: on "
                                                                  "a GPU its preset, else this machine calibrated "
                                                                  "once, briefly, and cached; docs/calibrate.md)")
    calibrate: bool = option(True, section="planning", help="without --hardware, calibrate this machine briefly the "
                                                            "first time (cached after) for the run's prediction "
                                                            "(--no-calibrate: no step time predicted, memory still)")
    plan: str = option("none", section="planning", help="auto: the planner picks t, cp, p, d, schedule, chunks, "
                                                        "micro-batches, recomputation, SP, ZeRO and ep for "
                                                        "--plan-ranks ranks, keeping those of them given as flags "
                                                        "(pins), prints the plan and runs it; none: the flags' layout")
    plan_ranks: int = option(0, section="planning", help="with --plan auto: the ranks to plan for (0: tp x cp x pp x "
                                                         "dp of the flags and defaults; under torchrun its world size)")
    memory_limit_gb: float = option(0.0, section="planning", help="with --plan auto: predicted bytes per rank must "
                                                                  "fit this many GB (0: the device's memory)")

    def __post_init__(self) -> None:
        if self.microbatches == 0:  # chosen once here; dataclasses.replace keeps it (pass 0 to choose again)
            object.__setattr__(self, "microbatches", default_microbatches(self)[0])

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(pp=self.pp, dp=self.dp, tp=self.tp, cp=self.cp)

    @property
    def layer_split(self) -> tuple[int, ...]:
        """Layers of each of the p·v (virtual) stages in pipeline order: ``stage_layers`` or the default split."""
        return resolve_split(self.model.layers, self.pp, self.chunks, self.stage_layers)

    @property
    def recompute_arg(self) -> Strategy:
        """The model's ``recompute=`` argument: a name of ``RECOMPUTE_NAMES`` or k."""
        return parse_strategy(self.recompute)

    @property
    def param_dtype(self) -> torch.dtype:
        """torch dtype of parameters, gradients and AdamW state."""
        return param_dtype(self.precision)

    @property
    def loss_chunk(self) -> int:
        """Tokens per chunk of the head and loss (``loss_chunk_mb`` of fp32 logits); 0: all at once."""
        if not self.loss_chunk_mb:
            return 0
        return chunk_tokens(self.loss_chunk_mb * 2**20, self.model.padded_vocab_size // self.tp, compute_dtype(self.precision))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    def check(self, world_size: int | None = None) -> TrainConfig:
        """Raise ValueError naming the first bad setting; return self.

        The config is frozen, so a value that passed once passes again: the settings are checked
        once per value (a ``replace`` makes a new value; a pickled copy stays checked) and later
        calls only check ``world_size`` against the layout.
        """
        if world_size is not None:
            self.dims.check_world(world_size)
        if not self.__dict__.get("_checked", False):
            self._check_settings()
            object.__setattr__(self, "_checked", True)
        return self

    def _check_settings(self) -> None:
        _ = self.dims  # ParallelDims checks t, p and d first
        check_choice("schedule", self.schedule, schedule_names(trains=True) + ("auto",))
        check_number("memory_limit", self.memory_limit)
        if self.memory_limit and self.schedule != "auto":
            raise ValueError(f"memory_limit applies to schedule auto (it picks the schedule that fits), got "
                             f"{self.memory_limit:g} with schedule {self.schedule!r}")
        check_precision(self.precision)
        check_choice("zero", self.zero, ZERO_CHOICES)
        check_choice("cp_comm", self.cp_comm, CP_COMMS)
        check_trainer_context(self.model.seq_len, self.cp, self.zero, self.tp, self.sequence_parallel)
        if self.zero >= 2 and self.dp < 2:
            raise ValueError(f"zero {self.zero} shards over the data-parallel replicas and needs dp >= 2, got dp "
                             f"{self.dp}; use zero 0 on one replica")
        check_number("bucket_mb", self.bucket_mb, 0.0, strict=True)
        check_number("loss_chunk_mb", self.loss_chunk_mb)
        if self.compile:
            check_compile_backend(self.compile_backend)
            split = self.schedule != "auto" and schedule_entry(self.schedule).split_backward
            check_compile_scope(self.compile_scope, zero=self.zero, split_backward=split, recompute=self.recompute,
                                offload=parse_offload(self.offload_activations))
        self._check_experts()
        if self.schedule == "auto":  # the synthesised schedule's: 1 (one stage per rank) or 2 (V or loop)
            check_choice("chunks", self.chunks, (1, 2))
        elif schedule_entry(self.schedule).chunks is None:  # at v = 1 it is 1F1B or GPipe: run that by name
            check_int("chunks", self.chunks, minimum=2)
        else:
            check_chunks(self.schedule, self.chunks)
        v = self.chunks
        for name in ("microbatches", "batch_size", "steps"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("warmup", "eval_every", "checkpoint_every", "keep", "seed", "exit_after", "skip_nonfinite"):
            check_int(name, getattr(self, name), minimum=0)
        check_int("eval_batches", self.eval_batches, minimum=1)
        check_number("lr", self.lr, 0.0, strict=True)
        check_number("weight_decay", self.weight_decay)
        check_number("clip", self.clip)
        check_number("timeout", self.timeout, 0.0, strict=True)
        check_choice("preempt_signal", self.preempt_signal, PREEMPT_SIGNALS)
        self.check_planning()
        check_number("preempt_grace", self.preempt_grace)
        self.model.check(tp=self.tp, stages=self.pp * v, sequence_parallel=self.sequence_parallel)
        fewest = min([n for n in self.layer_split if n] or [1])  # the shortest chain a stage recomputes
        recompute = parse_strategy(self.recompute)
        if isinstance(recompute, int):
            check_int("recompute", recompute, minimum=1, maximum=fewest)
        elif recompute != "selective":
            plan_recompute(fewest, recompute)
        if parse_offload(self.offload_activations) != "none" and self.compile:
            raise ValueError(f"offload_activations {self.offload_activations} with compile: the offload hooks wrap "
                             "each layer's forward, which compile replaces; choose one")
        check_divisible("batch_size", self.batch_size, "dp", self.dp)
        check_divisible("batch_size per replica", self.batch_size // self.dp, "microbatches", self.microbatches)
        if self.schedule != "auto":
            schedule_entry(self.schedule).microbatches.check(self.schedule, self.microbatches, self.pp, v,
                                                             k_label="pp")
        self.data.check()
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir (where to find the checkpoint), got None")
        if self.overwrite and self.resume:
            raise ValueError("overwrite (delete the checkpoints and start over) and resume (continue from them) "
                             "exclude each other: choose one")
        if self.init_from is not None:
            from modelpar.hf import check_init_from

            check_init_from(self.model, self.init_from)

    def check_planning(self) -> TrainConfig:
        """The planner's own settings (``plan``, ``memory_limit_gb``, ``plan_ranks``): checked before ``--plan auto`` plans,
        which runs before the rest is checked (the plan sets the layout); return self."""
        check_choice("plan", self.plan, PLAN_CHOICES)
        check_number("memory_limit_gb", self.memory_limit_gb)
        check_int("plan_ranks", self.plan_ranks, minimum=0)
        if self.plan_ranks and self.plan != "auto":
            raise ValueError(f"plan_ranks {self.plan_ranks} applies to plan auto (the ranks it plans for), got plan "
                             f"{self.plan!r}")
        return self

    def _check_experts(self) -> None:
        """Expert parallelism folds into d (docs/moe.md); ``costmodel.moe.check_trainer_experts`` is the rule."""
        check_trainer_experts(self.model.experts, self.ep, self.dp, self.cp, self.sequence_parallel)

    def layout(self) -> str:
        """The split in words, for banners and summaries: ``t=2, p=2, d=1``, with cp and ep when used."""
        dims = [("t", self.tp), ("cp", self.cp), ("p", self.pp), ("d", self.dp), ("ep", self.ep)]
        return ", ".join(f"{name}={n}" for name, n in dims if n > 1 or name in ("t", "p", "d"))

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, the model and the data as nested dicts (what checkpoints store)."""
        return asdict(self)

    def to_sections(self) -> dict[str, dict[str, Any]]:
        """The settings by section (``SECTIONS``), as a ``--config`` file's tables hold them."""
        flat = self.to_dict()
        tables: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for info in field_infos(type(self)):
            if info.nested:
                tables[info.name] = flat[info.name]
            else:
                tables[info.section or "run"][info.name] = flat[info.name]
        return tables

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config a ``to_dict`` wrote (a checkpoint's); an unknown key is a ValueError naming it."""
        values = dict(d)
        if "precision" not in values and values.get("dtype") in _LEGACY_DTYPES:
            values["precision"] = _LEGACY_DTYPES[values["dtype"]]
        return construct(cls, values, "train config:", extra=_RETIRED)

def default_microbatches(cfg: TrainConfig) -> tuple[int, str]:
    """The micro-batch count m a run gets when it sets none, and why (the run summary prints it).

    p = 1: m = 1. There is no pipeline to fill, and more micro-batches only add per-micro-batch
    overhead (15% at (1, 1, 1) on the 25.5 M GPT, issue 21 §6); gradient accumulation to save
    activation memory is then a choice, ``--microbatches``. p > 1: the smallest m >= p (every
    stage busy at once; 2p for DualPipe-V) whose bubble, (p − 1)/(v·m) of the ideal compute (Megatron's, zb-h1 taken
    as 1F1B), is at most ``BUBBLE_TARGET``: m = 4(p − 1) without interleaving (4 at p = 2, the
    bubble 20% of the step), a multiple of p with it. m must divide the per-replica batch: the
    smallest divisor from there up, else the largest below (capped by the batch).
    """
    p, v, dp, batch = cfg.pp, cfg.chunks, cfg.dp, cfg.batch_size
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in (p, v, dp, batch)):
        return 1, "p, v, d or the batch is invalid (check() names it)"
    if p == 1:
        return 1, "p = 1: no pipeline to fill"
    rule = schedule_entry(cfg.schedule).microbatches if cfg.schedule in schedule_names() else ANY_MICROBATCHES
    step, least = rule.step(p, v), max(p, rule.least(p))  # interleaving: m divisible by p; DualPipe-V: m >= 2p
    want = next(m for m in itertools.count(least) if bubble_over_ideal_compute(p, m, v) <= BUBBLE_TARGET)
    rows = batch // dp
    fits = [m for m in range(step, rows + 1, step) if rows % m == 0]
    larger = [m for m in fits if m >= want]
    why = f"the smallest m >= p with a bubble <= {BUBBLE_TARGET:.0%} of the ideal compute, (p-1)/(v*m)"
    if larger:
        m = larger[0]
        return m, why + ("" if m == want else f", dividing the per-replica batch {rows}")
    if fits:
        return fits[-1], f"{why} would be {want}: capped by the per-replica batch {rows}"
    return want, why
