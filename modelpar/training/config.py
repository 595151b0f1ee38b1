"""What a training run is: the model, the (t, p, d) split, the schedule and the optimisation.

``TrainConfig.check(world_size)`` validates everything before any process group work starts, so
bad input is the same clear ValueError on every rank (every rank checks the same config).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from modelpar._validate import check_choice, check_divisible, check_int, check_number
from modelpar.distributed import ParallelDims
from modelpar.model import ModelConfig
from modelpar.recompute.plan import Strategy, parse_strategy, plan_recompute
from modelpar.schedules.generators import CHUNKED, SCHEDULES, V_SHAPED, check_chunks
from modelpar.text.config import DataConfig
from modelpar.training.precision import check_precision, param_dtype

__all__ = ["PREEMPT_SIGNALS", "SCHEDULE_CHOICES", "TrainConfig"]

SCHEDULE_CHOICES = tuple(n for n in SCHEDULES if n != "naive")  # naive (M = 1, 1/K use) is for the simulator
ZERO_CHOICES = (0, 1)  # ZeRO stages the trainer runs (the planner models 2 and 3 too)
_LEGACY_DTYPES = {"float32": "fp32", "float64": "fp64"}  # ``dtype`` of configs written before ``precision``
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults: the `modelpar train` demo (t = 2, p = 2, d = 1, a few minutes on 2 CPU cores)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the model to train (GPT or Llama style)
    data: DataConfig = field(default_factory=DataConfig)  # the text and its tokenizer (default: shipped, bytes)
    tp: int = 2  # t: tensor-parallel ranks (consecutive ranks, inside a machine)
    pp: int = 2  # p: pipeline stages
    dp: int = 1  # d: data-parallel replicas
    schedule: str = "1f1b"  # pipeline schedule: one of SCHEDULE_CHOICES
    chunks: int = 1  # v: model chunks per pipeline rank; >= 2 with interleaved / looped-bfs, 2 with V shapes, else 1
    microbatches: int = 4  # m: micro-batches per replica per step
    batch_size: int = 16  # global batch (sequences per optimizer step, all replicas together)
    recompute: str = "none"  # modelpar.recompute.RECOMPUTE_NAMES (none, selective, full, sqrt, ...) or k
    sequence_parallel: bool = False  # shard LayerNorm/residual activations along the sequence (§5.6)
    pipeline_gloo: bool = False  # under NCCL: pipeline messages over gloo, staged through host memory
    steps: int = 300  # optimizer steps
    lr: float = 3e-3  # peak AdamW learning rate (linear warm-up, cosine decay to lr/10)
    warmup: int = 20  # warm-up steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay, matrices only
    clip: float = 1.0  # gradient clipping: max global L2 norm over all shards (0 = off)
    seed: int = 0  # one seed: initial weights and batches (identical for every split)
    precision: str = "fp32"  # fp32, bf16 (autocast, fp32 master weights) or fp64 (the tests); see docs/numerics.md
    zero: int = 0  # 1: ZeRO-1, AdamW state sharded over the d replicas (reduce-scatter, shard update, all-gather)
    overlap_grad_reduce: bool = True  # start each gradient bucket's dp reduction during the backward
    bucket_mb: float = 25.0  # MiB of gradients per data-parallel collective
    eval_every: int = 50  # validation loss every this many steps (0 = only at the end)
    eval_batches: int = 4  # validation batches per evaluation
    checkpoint_dir: str | None = None  # where checkpoints go (None: no checkpoints)
    checkpoint_every: int = 0  # save every this many steps (0: only at the end, if a dir is set)
    keep: int = 2  # complete checkpoints kept on disk
    resume: bool = False  # continue from the latest complete checkpoint in checkpoint_dir
    exit_after: int = 0  # stop after this many steps of this run, with a checkpoint (0: run to the end);
    #                      for jobs with a time limit, as Megatron's --exit-interval
    timeout: float = 300.0  # seconds a collective or pipeline receive may wait before the run fails
    preempt_signal: str = "SIGTERM"  # asks for a checkpoint at the next step, then an exit (docs/stopping.md)
    preempt_grace: float = 30.0  # seconds from that signal within which the checkpoint must be written (0: no limit)
    skip_nonfinite: int = 0  # skip the update of up to this many non-finite steps (0: stop at the first)
    init_from: str | None = None  # a Hugging Face Llama directory whose weights the run starts from

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(pp=self.pp, dp=self.dp, tp=self.tp)

    @property
    def recompute_arg(self) -> Strategy:
        """The model's ``recompute=`` argument: a name of ``RECOMPUTE_NAMES`` or k."""
        return parse_strategy(self.recompute)

    @property
    def param_dtype(self) -> torch.dtype:
        """torch dtype of parameters, gradients and AdamW state."""
        return param_dtype(self.precision)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    def check(self, world_size: int | None = None) -> TrainConfig:
        """Raise ValueError naming the first bad setting; return self."""
        dims = self.dims
        if world_size is not None:
            dims.check_world(world_size)
        check_choice("schedule", self.schedule, SCHEDULE_CHOICES)
        check_precision(self.precision)
        check_choice("zero", self.zero, ZERO_CHOICES)
        check_number("bucket_mb", self.bucket_mb, 0.0, strict=True)
        if self.schedule in CHUNKED:
            check_int("chunks", self.chunks, minimum=2)
        elif self.schedule in V_SHAPED:
            check_chunks(self.schedule, self.chunks)
        elif self.chunks != 1:
            raise ValueError(f"chunks must be 1 unless the schedule is one of {', '.join(CHUNKED + V_SHAPED)}, got "
                             f"{self.chunks!r} with schedule {self.schedule!r}")
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
        check_number("preempt_grace", self.preempt_grace)
        recompute = parse_strategy(self.recompute)
        if isinstance(recompute, int):
            check_int("recompute", recompute, minimum=1, maximum=self.model.layers // (self.pp * v))
        elif recompute != "selective":
            plan_recompute(max(1, self.model.layers // (self.pp * v)), recompute)
        check_divisible("batch_size", self.batch_size, "dp", self.dp)
        check_divisible("batch_size per replica", self.batch_size // self.dp, "microbatches", self.microbatches)
        if self.schedule == "interleaved":
            check_divisible("microbatches", self.microbatches, "pp", self.pp)
        if self.schedule == "dualpipe-v":
            check_int("microbatches", self.microbatches, minimum=2 * self.pp)
        self.model.check(tp=self.tp, stages=self.pp * v, sequence_parallel=self.sequence_parallel)
        self.data.check()
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir (where to find the checkpoint), got None")
        if self.init_from is not None:
            from modelpar.hf import check_init_from

            check_init_from(self.model, self.init_from)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        if "precision" not in d and d.get("dtype") in _LEGACY_DTYPES:
            values["precision"] = _LEGACY_DTYPES[d["dtype"]]
        if isinstance(values.get("model"), dict):
            values["model"] = ModelConfig.from_dict(values["model"])
        if isinstance(values.get("data"), dict):
            values["data"] = DataConfig(**{**values["data"], "paths": tuple(values["data"].get("paths", ()))})
        return cls(**values)
