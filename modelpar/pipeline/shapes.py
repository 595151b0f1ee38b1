"""Learn every tensor shape a step will send before anything is sent, and fail together if any is wrong.

Only the first stage's rank sees the inputs and only the last stage's rank the targets, but every
rank must allocate receive buffers and every rank must raise the same error on bad input. So:

1. ``exchange_batch``: one all-reduce of a small integer vector; the owners fill in the shape
   and dtype of the inputs / targets (or an error code), everyone else zeros. Every rank then
   checks the batch (present, at least M rows, targets matching) and raises the same ValueError.
2. ``dry_run``: for each distinct microbatch size, stage by stage in model order, the owner runs
   its module once on zeros (eval mode, no grad, random state restored) and broadcasts the
   output's shape and dtype — or its error, which every rank then raises.

Both run once per batch shape (the first step), not every step, and wait at most the runner's
timeout. ``group=None`` is one process: the same checks, no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelpar._tensor_meta import DTYPES, MAX_DIMS, META_LEN, decode_meta, encode_meta
from modelpar.pipeline.bounded_comm import FlightRecorder, all_reduce_ints, broadcast_object

__all__ = ["BatchSpec", "TensorSpec", "dry_run", "exchange_batch", "microbatch_sizes"]

TensorSpec = tuple[tuple[int, ...], torch.dtype]
BatchSpec = tuple[TensorSpec, TensorSpec]  # (inputs, targets)

_FIELDS = 1 + META_LEN  # status, then the tensor's meta
_OK, _MISSING, _NOT_TENSOR, _BAD = 1, 2, 3, 4


def microbatch_sizes(rows: int, num_microbatches: int) -> list[int]:
    """Rows of each microbatch, as ``torch.tensor_split``: sizes differ by at most one, larger first."""
    q, r = divmod(rows, num_microbatches)
    return [q + 1] * r + [q] * (num_microbatches - r)


def _encode(value: Any) -> list[int]:
    if value is None:
        return [_MISSING] + [0] * META_LEN
    if not isinstance(value, torch.Tensor):
        return [_NOT_TENSOR] + [0] * META_LEN
    meta = encode_meta(value)
    ok = 0 < value.dim() <= MAX_DIMS and value.dtype in DTYPES
    return [_OK if ok else _BAD, *meta]


def _decode(name: str, field: list[int], owner: int) -> TensorSpec:
    status, ndim = field[0], field[1]
    where = f"on rank {owner}, which runs its stage"
    if status == _MISSING:
        raise ValueError(f"{name} must be a tensor {where}, got None")
    if status == _NOT_TENSOR:
        raise ValueError(f"{name} must be a torch.Tensor {where}, got another type")
    if status == _BAD:
        raise ValueError(
            f"{name} must have 1..{MAX_DIMS} dimensions (a batch dimension first) and a standard "
            f"dtype {where}, got {ndim} dimensions"
        )
    shape, dtype = decode_meta(field[1:])
    assert dtype is not None
    return shape, dtype


def exchange_batch(inputs: Any, targets: Any, owners: tuple[int, int], num_microbatches: int, group: Any,
                   timeout: float, recorder: FlightRecorder) -> BatchSpec:
    """All ranks learn the (shape, dtype) of inputs and targets; the same ValueError everywhere if bad.

    ``owners`` are the group ranks holding the first and the last stage.
    """
    me = dist.get_rank(group) if group is not None else 0
    vec = [0] * (2 * _FIELDS)
    if me == owners[0]:
        vec[:_FIELDS] = _encode(inputs)
    if me == owners[1]:
        vec[_FIELDS:] = _encode(targets)
    vec = all_reduce_ints(vec, group, timeout, "the batch shapes (an all-reduce over the pipeline group)", recorder)
    inp = _decode("inputs", vec[:_FIELDS], _global(group, owners[0]))
    tgt = _decode("targets", vec[_FIELDS:], _global(group, owners[1]))
    rows = inp[0][0]
    if rows < num_microbatches:
        raise ValueError(
            f"inputs has {rows} rows (dim 0) but the schedule has {num_microbatches} microbatches; "
            f"each microbatch needs at least one row, so the batch must have >= {num_microbatches} rows"
        )
    if tgt[0][0] != rows:
        raise ValueError(f"targets must have as many rows as inputs ({rows}), got shape {tgt[0]}")
    return inp, tgt


def _global(group: Any, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else 0


def dry_run(
    modules: dict[int, nn.Module],
    stage_to_rank: Sequence[int],
    batch: BatchSpec,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: Any,
    timeout: float,
    recorder: FlightRecorder,
) -> dict[tuple[int, int], TensorSpec]:
    """Return ``{(stage, rows): spec}``: the output of every stage but the last, per microbatch size.

    Every rank gets the same table. A stage that fails on its input raises ValueError on every
    rank, naming the stage, its rank and the input it was given.
    """
    me = dist.get_rank(group) if group is not None else 0
    (in_shape, in_dtype), (tg_shape, tg_dtype) = batch
    last = len(stage_to_rank) - 1
    specs: dict[tuple[int, int], TensorSpec] = {}
    for rows in sorted(set(microbatch_sizes(in_shape[0], num_microbatches))):
        spec: TensorSpec = ((rows, *in_shape[1:]), in_dtype)
        for s, rank in enumerate(stage_to_rank):
            result: Any = None
            if me == rank:
                target = ((rows, *tg_shape[1:]), tg_dtype) if s == last else None
                result = _try_stage(modules[s], spec, target, loss_fn)
            kind, value = broadcast_object(result, rank, group, timeout,
                                           f"the dry run's output shape of stage {s}", recorder)
            if kind == "error":
                source = "the inputs" if s == 0 else f"stage {s - 1}"
                raise ValueError(
                    f"stage {s} (rank {_global(group, rank)}) cannot run on the output of {source} "
                    f"(shape {tuple(spec[0])}, {spec[1]}): {value}"
                )
            if s < last:
                specs[s, rows] = spec = value
    return specs


def _try_stage(module: nn.Module, spec: TensorSpec, target: TensorSpec | None,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[str, Any]:
    """Run ``module`` once on zeros; ('ok', output spec) or ('error', message)."""
    modes = [(m, m.training) for m in module.modules()]
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            module.eval()
            out = module(torch.zeros(spec[0], dtype=spec[1], device=device))
            if not isinstance(out, torch.Tensor):
                return "error", f"a stage must return one tensor, got {type(out).__name__}"
            if target is None:
                if not out.is_floating_point():
                    return "error", f"activations between stages must be floating point, got {out.dtype}"
                return "ok", (tuple(out.shape), out.dtype)
            loss = loss_fn(out, torch.zeros(target[0], dtype=target[1], device=device))
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                return "error", "loss_fn must return a scalar tensor (the mean loss of a microbatch)"
            return "ok", None
    except Exception as err:
        return "error", f"{type(err).__name__}: {err}"
    finally:
        for m, training in modes:
            m.train(training)
