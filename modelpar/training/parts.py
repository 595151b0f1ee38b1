"""The trainer assembled from parts: one function per dimension, each applied to this rank's stages.

torchtitan applies each parallelism as a function over the model; these are modelpar's, in the order
``loop._Run`` applies them:

    build_stages        the model: t (and sequence parallelism), cp and ep live in its layers (build_stage)
    apply_offload       --offload-activations: the chosen layers' saved activations to host memory
    apply_float8        --precision fp8: torchao's float8 products in the linear layers
    apply_compile       --compile: each transformer block's forward (or each stage's) compiled
    stage_loss          the last stage's loss (the head and cross entropy in chunks of tokens)
    apply_pipeline      p: the schedule's runner over the stages (bf16: each stage under autocast)
    apply_data_parallel d × cp: the gradient buckets, their reduction, ZeRO 0-3, clipping; then
                        check_inventory: what the rank holds is the model inventory the cost model prices
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelpar._compat import CompileClock
from modelpar.model import LMLoss, Transformer, build_stage
from modelpar.offload_plan import parse_offload
from modelpar.pipeline.runner import PipelineRunner
from modelpar.recompute.offload import HostOffload
from modelpar.recompute.offload import apply_offload as offload_stage
from modelpar.schedules import Schedule
from modelpar.tensor_parallel.context_parallel import ContextParallel
from modelpar.training.buckets import Bucket, BufferMeter
from modelpar.training.clipping import GradClip
from modelpar.training.compile import check_compile_scope, compile_blocks, compile_stages
from modelpar.training.config import TrainConfig
from modelpar.training.dp_comm import DataParallelComm
from modelpar.training.float8 import check_float8_device, float8_linears
from modelpar.training.grads import GradSync, finish_order
from modelpar.training.precision import compute_dtype, wrap_stage
from modelpar.training.setup import RankSetup
from modelpar.training.zero_grads import ShardedGradSync, check_bucket_size
from modelpar.training.zero_params import ParamGather

__all__ = ["DataParallel", "apply_compile", "apply_data_parallel", "apply_float8", "apply_offload", "apply_pipeline",
           "build_stages", "check_inventory", "stage_loss"]


def build_stages(cfg: TrainConfig, rs: RankSetup, schedule: Schedule, context: ContextParallel) -> dict[int, Transformer]:
    """This rank's (virtual) stages of the model, their tensor-, context- and expert-parallel shards included."""
    return {s: build_stage(cfg.model, s, schedule.num_stages, seed=cfg.seed, group=rs.tp_group,
                           sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute_arg, dtype=cfg.param_dtype,
                           device=rs.device, split=cfg.layer_split, context=context, ep_group=rs.ep_group,
                           head_in_loss=cfg.loss_chunk > 0)
            for s in schedule.stages_on(rs.pp_rank)}


def apply_offload(cfg: TrainConfig, modules: Mapping[int, Transformer]) -> HostOffload | None:
    """``--offload-activations``: the chosen layers of every stage here save into one host store (None: off)."""
    if cfg.offload_activations == "none":
        return None
    store = HostOffload()
    for module in modules.values():
        offload_stage(module, cfg.offload_activations, store)
    return store


def apply_float8(cfg: TrainConfig, modules: Mapping[int, nn.Module], device: torch.device) -> None:
    """``--precision fp8``: float8 products in the linear layers (refused in one line without float8 units)."""
    if cfg.precision == "fp8":
        check_float8_device(device)
        float8_linears(modules)


def apply_compile(cfg: TrainConfig, modules: Mapping[int, nn.Module], schedule: Schedule) -> CompileClock | None:
    """``--compile``: every block's (``--compile-scope stage``: every stage's) forward compiled; the clock of the
    time spent compiling (None: not compiled)."""
    if not cfg.compile:
        return None
    if cfg.compile_scope == "stage":  # the schedule is known only now under --schedule auto
        check_compile_scope("stage", zero=cfg.zero, split_backward=schedule.split_backward, recompute=cfg.recompute,
                            offload=parse_offload(cfg.offload_activations))
        return compile_stages(modules, cfg.compile_backend)
    return compile_blocks(modules, cfg.compile_backend, schedule.split_backward)


def stage_loss(cfg: TrainConfig, rs: RankSetup, modules: Mapping[int, Transformer]) -> LMLoss:
    """The last stage's loss: with ``loss_chunk_mb`` the head and cross entropy in chunks of tokens."""
    head = next((m.head for m in modules.values() if m.head is not None), None) if cfg.loss_chunk else None
    return LMLoss(cfg.model.vocab_size, rs.tp_group, head=head, chunk=cfg.loss_chunk,
                  compute_dtype=compute_dtype(cfg.precision))


def computed_stages(cfg: TrainConfig, modules: Mapping[int, nn.Module], schedule: Schedule) -> dict[int, nn.Module]:
    """The stages as the pipeline runs them: under autocast for bf16 and fp8 (``precision.wrap_stage``)."""
    return {s: wrap_stage(m, cfg.precision, last=s == schedule.num_stages - 1) for s, m in modules.items()}


def apply_pipeline(cfg: TrainConfig, rs: RankSetup, schedule: Schedule, modules: Mapping[int, nn.Module],
                   loss_fn: LMLoss) -> PipelineRunner:
    """p: the runner that executes ``schedule``'s actions on this rank's stages, messages over the pipeline group."""
    return PipelineRunner(schedule, computed_stages(cfg, modules, schedule), loss_fn, group=rs.pp_group,
                          timeout=rs.timeout)


@dataclass
class DataParallel:
    """d × cp for one rank: the collectives, the gradient buckets and their sync, ZeRO-3's gathers, clipping."""

    comm: DataParallelComm
    sync: GradSync
    gather: ParamGather | None
    meter: BufferMeter
    clipper: GradClip

    def after_update(self) -> None:
        """ZeRO-3: anything still gathered predates the optimizer step: free it."""
        if self.gather is not None:
            self.gather.release_all()

    def close(self) -> None:
        self.comm.close()
        self.sync.close()
        if self.gather is not None:
            self.gather.close()


def check_inventory(cfg: TrainConfig, modules: Mapping[int, nn.Module], buckets: Sequence[Bucket]) -> None:
    """The parameters and gradient buckets this rank holds are the model inventory's (``costmodel.inventory``, what
    the cost model prices), stage by stage: a RuntimeError naming the first stage that differs. Sizes only: cheap."""
    from modelpar.costmodel.inventory import stage_bucket_list, stage_tensors
    from modelpar.training.prediction import local_run

    run = local_run(cfg)
    for s, module in modules.items():
        held = ([p.numel() for p in module.parameters()], [(b.numel, b.ready) for b in buckets if b.stage == s])
        listed = ([x.numel for x in stage_tensors(run, s)], [(n, ready) for n, _, ready in stage_bucket_list(run, s)])
        if held != listed:
            raise RuntimeError(f"stage {s}: the model holds parameters {held[0]} in buckets {held[1]}, the model "
                               f"inventory (costmodel.inventory) lists {listed[0]} in {listed[1]}")


def apply_data_parallel(cfg: TrainConfig, rs: RankSetup, schedule: Schedule, modules: Mapping[int, nn.Module],
                        runner: PipelineRunner) -> DataParallel:
    """d × cp: the gradient buckets over the d·cp ranks (cp joins data parallelism for gradients: every cp rank's
    loss is the mean over its s/cp tokens of each sequence, so the global mean's gradient is the mean over them),
    reduced during the backward (``overlap``) or after, sharded by ZeRO 1-3, and clipped by the global norm."""
    comm = DataParallelComm(rs.grad_group, runner.timer, runner.recorder, rs.timeout)
    elements = max(1, int(cfg.bucket_mb * 2**20) // cfg.param_dtype.itemsize)
    meter = BufferMeter()
    args: dict[str, Any] = dict(modules=modules, finish_order=finish_order(schedule, rs.pp_rank), comm=comm, tp_group=rs.tp_group,
                embed_group=rs.embed_group, tp_rank=rs.tp_rank, dp_rank=rs.grad_rank,
                tied_split=cfg.model.tie_embeddings and schedule.num_stages > 1, zero=cfg.zero, bucket_elements=elements,
                overlap=cfg.overlap_grad_reduce and cfg.dp * cfg.cp > 1, ep=cfg.ep, edp_group=rs.edp_group)
    gather = None
    if cfg.zero >= 2:
        compute = torch.bfloat16 if cfg.zero == 3 and cfg.precision == "bf16" else None
        sync: GradSync = ShardedGradSync(**args, meter=meter, compute_dtype=compute)
        check_bucket_size(sync.buckets, elements, cfg.dp * cfg.cp, cfg.bucket_mb)
        if cfg.zero == 3:
            gather = ParamGather(modules, sync.buckets, comm, meter, cfg.reshard_after_forward, shard_of=sync.shard_of,
                                 compiled=cfg.compile)
            runner.register_action_hook(gather.action_hook)
    else:
        sync = GradSync(**args)
    if sync.overlap or cfg.zero >= 2:
        runner.register_action_hook(sync.action_hook)
    check_inventory(cfg, modules, sync.buckets)
    return DataParallel(comm, sync, gather, meter, GradClip(sync))
