"""A planning request read from a ``modelpar plan`` command line: model, cluster, batch, engine and pins.

The command (``modelpar.commands.plan``) and the published runs (``published.py``) both build their
requests here, so every published run is a command line a user can type, and ``--validate`` runs
it through the same code as ``modelpar plan``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any

from modelpar._validate import check_choice, check_int, check_number
from modelpar.costmodel.assumptions import Assumptions, assumptions_for, measured_assumptions
from modelpar.costmodel.engines import ENGINES, engine_assumptions
from modelpar.costmodel.moe import MoESpec
from modelpar.costmodel.presets import GPUS, NodePreset, gpu_preset, make_cluster, model_preset, profile_node
from modelpar.costmodel.profiles import load_profile
from modelpar.costmodel.search import SearchResult, search
from modelpar.costmodel.specs import CP_COMMS, PLANNED_RECOMPUTE, ClusterSpec, ModelSpec, check_context_split
from modelpar.costmodel.stages import check_split
from modelpar.costmodel.zero_bytes import ZERO_STAGES
from modelpar.layer_split import parse_split

__all__ = ["PlanRequest", "add_plan_arguments", "default_assumptions", "parse_plan_command", "request_from_args"]

_MODEL_FLAGS = (("layers", "layers"), ("hidden", "hidden"), ("heads", "heads"), ("seq_len", "seq"),
                ("vocab", "vocab"), ("ffn", "ffn"))
_MOE_FLAGS = (("experts", "experts"), ("top_k", "top_k"), ("shared_experts", "shared"), ("expert_ffn", "ffn"),
              ("moe_every", "every"), ("dense_layers", "first_dense"), ("capacity_factor", "capacity_factor"))


@dataclass(frozen=True)
class PlanRequest:
    """Everything ``search`` needs, as the command line gave it."""

    model: ModelSpec
    cluster: ClusterSpec
    batch: int
    assumptions: Assumptions
    pins: dict[str, Any]  # search() keyword arguments

    def search(self) -> SearchResult:
        return search(self.model, self.cluster, self.batch, self.assumptions, **self.pins)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The model, cluster, batch, engine and pin flags of ``modelpar plan``."""
    m = p.add_argument_group("model (a preset, or the numbers; numbers override a preset)")
    m.add_argument("--model", help="preset name, e.g. gpt3-175b, megatron-1t, bloom-176b, llama3-70b")
    for flag, _ in _MODEL_FLAGS:
        m.add_argument(f"--{flag.replace('_', '-')}", type=int)
    e = p.add_argument_group("mixture of experts (docs/moe.md; numbers override a preset's)")
    for flag, _ in _MOE_FLAGS:
        e.add_argument(f"--{flag.replace('_', '-')}", type=float if flag == "capacity_factor" else int)
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", help="GPU node preset (default a100-80gb): a100-80gb, a100-40gb, h100-sxm, h200")
    c.add_argument("--hardware", metavar="PROFILE",
                   help="a hardware profile JSON (modelpar calibrate) in place of --gpu")
    c.add_argument("--peak-tflops", type=float, help="dense 16-bit peak, TFLOP/s per GPU")
    c.add_argument("--gpu-mem-gb", type=float, help="memory per GPU, GB")
    c.add_argument("--gpus", type=int, help="number of GPUs (required)")
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--intra-node-gbps", type=float, help="NVLink bandwidth, GB/s per GPU (default 300 on A100)")
    c.add_argument("--inter-node-gbps", type=float, help="network bandwidth, GB/s per GPU (default 25 on A100)")
    p.add_argument("--batch", type=int, help="global batch, sequences (required)")
    p.add_argument("--engine", default="megatron", help=f"training engine: {', '.join(ENGINES)} (default megatron)")
    pin = p.add_argument_group("pins (any subset; the search covers the rest)")
    pin.add_argument("--tp", type=int)
    pin.add_argument("--pp", type=int, help="pipeline stages; need not divide the layers (the middle stages get more)")
    pin.add_argument("--dp", type=int)
    pin.add_argument("--cp", type=int, help="context-parallel ranks (each sequence split across them; 2·cp divides s)")
    pin.add_argument("--cp-comm", help="ring (default; overlapped with attention) or allgather")
    pin.add_argument("--micro-batch", type=int)
    pin.add_argument("--chunks", type=int, help="interleaving v, model chunks per device")
    pin.add_argument("--recompute", help="none, selective or full")
    pin.add_argument("--sequence-parallel", nargs="?", const="on", help="on (default when given) or off")
    pin.add_argument("--zero", type=int, help="ZeRO stage over the data-parallel group: 0, 1, 2 or 3 (FSDP)")
    pin.add_argument("--ep", type=int, help="expert-parallel ranks, folded into d (divides d and the experts)")
    pin.add_argument("--stage-layers", metavar="N,N,...",
                     help="layers of each pipeline stage (p·v chunks, first to last), e.g. 5,6,6,6,6,6,6,6,6,6,6,5")


def _model(args: argparse.Namespace) -> ModelSpec:
    given = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS if getattr(args, flag) is not None}
    for flag, field in _MODEL_FLAGS:
        if field in given:
            check_int(f"--{flag.replace('_', '-')}", given[field], minimum=0 if field == "ffn" else 1)
    if args.model:
        model = dataclasses.replace(model_preset(args.model), **given)
    else:
        missing = [f"--{f.replace('_', '-')}" for f, field in _MODEL_FLAGS[:5] if field not in given]
        if missing:
            raise ValueError(f"--model not given, so {', '.join(missing)} are required")
        model = ModelSpec(name="custom", **given)
    return _experts(args, model)


def _experts(args: argparse.Namespace, model: ModelSpec) -> ModelSpec:
    """``model`` with the mixture of experts the MoE flags give (over a preset's); a SwiGLU model (experts are)."""
    given = {field: getattr(args, flag) for flag, field in _MOE_FLAGS if getattr(args, flag, None) is not None}
    if not given:
        return model
    if model.moe is None and "experts" not in given:
        raise ValueError(f"--{next(iter(f for f, x in _MOE_FLAGS if x in given)).replace('_', '-')} needs --experts "
                         f"(the model {model.name} is dense)")
    for flag, field in _MOE_FLAGS:
        if field in given and field != "capacity_factor":
            minimum = 0 if field in ("shared", "first_dense", "ffn") else 1
            check_int(f"--{flag.replace('_', '-')}", given[field], minimum=minimum)
    if "capacity_factor" in given:
        check_number("--capacity-factor", given["capacity_factor"], strict=True)
    base = model.moe or MoESpec(given["experts"], model.ffn_size)
    if given.get("ffn") == 0:
        given["ffn"] = model.ffn_size
    experts = given.get("experts", base.experts)
    if not 1 <= given.get("top_k", base.top_k) <= experts:
        raise ValueError(f"--top-k must be from 1 to --experts ({experts}), got {given.get('top_k', base.top_k)}")
    return dataclasses.replace(model, gated_mlp=True, moe=dataclasses.replace(base, **given))


def _cluster(args: argparse.Namespace) -> ClusterSpec:
    if args.gpus is None:
        raise ValueError("--gpus is required")
    n = check_int("--gpus", args.gpus, minimum=1)
    node = _node(args)
    if args.peak_tflops is not None or args.gpu_mem_gb is not None:
        peak = node.gpu.peak_tflops if args.peak_tflops is None else check_number("--peak-tflops", args.peak_tflops, strict=True)
        mem = node.gpu.memory_gb if args.gpu_mem_gb is None else check_number("--gpu-mem-gb", args.gpu_mem_gb, strict=True)
        name = args.gpu or "custom-gpu"
        node = NodePreset(dataclasses.replace(node.gpu, name=name, peak_tflops=peak, memory_gb=mem),
                          node.gpus_per_node, node.intra_node_gbps, node.inter_node_gbps)
    def given(flag: str) -> float | None:
        value = getattr(args, flag)
        return None if value is None else check_number(f"--{flag.replace('_', '-')}", value, strict=True)

    per_node = None if args.gpus_per_node is None else check_int("--gpus-per-node", args.gpus_per_node, minimum=1)
    return make_cluster(node, n, per_node, given("intra_node_gbps"), given("inter_node_gbps"))


def _node(args: argparse.Namespace) -> NodePreset:
    """The node ``--hardware`` (a profile file) or ``--gpu`` (a named one, default a100-80gb) describes."""
    hardware = getattr(args, "hardware", None)
    if hardware is not None:
        if args.gpu is not None:
            raise ValueError(f"--hardware {hardware} and --gpu {args.gpu} both describe the GPU: give one")
        return profile_node(load_profile(hardware))
    return gpu_preset(args.gpu) if args.gpu else GPUS["a100-80gb"]


def default_assumptions(cluster: ClusterSpec) -> Assumptions:
    """``assumptions_for`` a named GPU; on a measured profile ``measured_assumptions`` in its dtype."""
    profile = cluster.measured
    if profile is None:
        return assumptions_for(cluster.gpu.name)
    return measured_assumptions(profile.dtype, profile.op_latency(cluster.ranks_per_node))


def _stage_layers(text: str, layers: int, pins: dict[str, Any]) -> tuple[int, ...]:
    """``--stage-layers`` as a tuple, checked against the model's layers and the pinned p and v (pinning them)."""
    split = parse_split(text)
    v = pins.setdefault("v", 1)
    if "p" in pins and len(split) != pins["p"] * v:
        raise ValueError(f"--stage-layers has {len(split)} entries, expected p·v = {pins['p']}·{v} = {pins['p'] * v}")
    if len(split) % v:
        raise ValueError(f"--stage-layers has {len(split)} entries, not a multiple of --chunks {v}")
    if min(split) < 0:
        raise ValueError(f"--stage-layers entries must be >= 0, got {text!r}")
    if sum(split) != layers:
        raise ValueError(f"--stage-layers sums to {sum(split)}, but the model has {layers} layers")
    reason = check_split(layers, len(split) // v, v, split)
    if reason:
        raise ValueError(f"--stage-layers {text}: {reason}")
    pins["p"] = len(split) // v
    return split


def _pins(args: argparse.Namespace, model: ModelSpec) -> dict[str, Any]:
    pins: dict[str, Any] = {}
    for flag, key in (("tp", "t"), ("pp", "p"), ("dp", "d"), ("cp", "cp"), ("micro_batch", "micro_batch"),
                      ("chunks", "v"), ("ep", "ep")):
        if getattr(args, flag) is not None:
            pins[key] = check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), minimum=1)
    if "cp" in pins:
        check_context_split(model.seq, pins["cp"])
    if pins.get("ep", 1) > 1 and (model.moe is None or model.moe.experts % pins["ep"]):
        raise ValueError(f"--ep {pins['ep']} needs experts divisible by it (the model has "
                         f"{model.moe.experts if model.moe else 'no'} experts)")
    if args.cp_comm is not None:
        pins["cp_comm"] = check_choice("--cp-comm", args.cp_comm, CP_COMMS)
    if args.recompute is not None:
        pins["recompute"] = check_choice("--recompute", args.recompute, PLANNED_RECOMPUTE)
    if args.sequence_parallel is not None:
        pins["sequence_parallel"] = check_choice("--sequence-parallel", args.sequence_parallel, ("on", "off")) == "on"
    if args.zero is not None:
        pins["zero"] = check_choice("--zero", args.zero, ZERO_STAGES)
    if args.stage_layers is not None:
        pins["stage_layers"] = _stage_layers(args.stage_layers, model.layers, pins)
    return pins


def request_from_args(args: argparse.Namespace, base: Assumptions | None = None) -> PlanRequest:
    """Check the parsed flags (one-line ``ValueError`` naming the flag) and build the request.

    The assumptions are ``base`` (default: ``assumptions_for`` the GPU) with the engine's fields set.
    """
    model, cluster = _model(args), _cluster(args)
    if args.batch is None:
        raise ValueError("--batch is required")
    batch = check_int("--batch", args.batch, minimum=1)
    assumptions = engine_assumptions(base or default_assumptions(cluster), args.engine)
    return PlanRequest(model, cluster, batch, assumptions, _pins(args, model))


def parse_plan_command(command: str, base: Assumptions | None = None) -> PlanRequest:
    """The request a ``modelpar plan`` command line (the flags after ``plan``) makes; ``base`` as in ``request_from_args``."""
    parser = argparse.ArgumentParser(prog="modelpar plan", exit_on_error=False)
    add_plan_arguments(parser)
    args, unknown = parser.parse_known_args(shlex.split(command))
    if unknown:
        raise ValueError(f"unknown modelpar plan flags {unknown} in {command!r}")
    return request_from_args(args, base)
