"""``modelpar plan``: rank every (t, p, d, micro-batch, v, recomputation, SP) layout for a model on a cluster.

Pure Python (the cost model imports no torch); matplotlib is imported only for ``--plot``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from modelpar._validate import check_choice, check_int, check_number, check_output_path

_MODEL_FLAGS = (("layers", "layers"), ("hidden", "hidden"), ("heads", "heads"), ("seq_len", "seq"),
                ("vocab", "vocab"), ("ffn", "ffn"))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="pick (t, p, d) for a model on a cluster with a cost model",
                              description=__doc__.splitlines()[0])
    m = p.add_argument_group("model (a preset, or the numbers; numbers override a preset)")
    m.add_argument("--model", help="preset name, e.g. gpt3-175b, megatron-1t, llama3-70b")
    for flag, _ in _MODEL_FLAGS:
        m.add_argument(f"--{flag.replace('_', '-')}", type=int)
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", help="GPU node preset (default a100-80gb): a100-80gb, a100-40gb, h100-sxm, h200")
    c.add_argument("--peak-tflops", type=float, help="dense 16-bit peak, TFLOP/s per GPU")
    c.add_argument("--gpu-mem-gb", type=float, help="memory per GPU, GB")
    c.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--intra-node-gbps", type=float, help="NVLink bandwidth, GB/s per GPU (default 300 on A100)")
    c.add_argument("--inter-node-gbps", type=float, help="network bandwidth, GB/s per GPU (default 25 on A100)")
    p.add_argument("--batch", type=int, required=True, help="global batch, sequences")
    pin = p.add_argument_group("pins (any subset; the search covers the rest)")
    pin.add_argument("--tp", type=int)
    pin.add_argument("--pp", type=int)
    pin.add_argument("--dp", type=int)
    pin.add_argument("--micro-batch", type=int)
    pin.add_argument("--chunks", type=int, help="interleaving v, model chunks per device")
    pin.add_argument("--recompute", help="none, selective or full")
    pin.add_argument("--sequence-parallel", nargs="?", const="on", help="on (default when given) or off")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=5, help="rows to print (default 5)")
    out.add_argument("--plot", metavar="FILE", help="draw step time and memory over (t, p) to a PNG or SVG")
    out.add_argument("--json", action="store_true", help="print the ranked list as JSON")
    p.set_defaults(func=run)


def _model(args: argparse.Namespace):
    from modelpar.costmodel import ModelSpec, model_preset

    given = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS if getattr(args, flag) is not None}
    for flag, field in _MODEL_FLAGS:
        if field in given:
            check_int(f"--{flag.replace('_', '-')}", given[field], minimum=0 if field == "ffn" else 1)
    if args.model:
        return dataclasses.replace(model_preset(args.model), **given)
    missing = [f"--{f.replace('_', '-')}" for f, field in _MODEL_FLAGS[:5] if field not in given]
    if missing:
        raise ValueError(f"--model not given, so {', '.join(missing)} are required")
    return ModelSpec(name="custom", **given)


def _cluster(args: argparse.Namespace):
    from modelpar.costmodel import GPUS, NodePreset, gpu_preset, make_cluster

    n = check_int("--gpus", args.gpus, minimum=1)
    node = gpu_preset(args.gpu) if args.gpu else GPUS["a100-80gb"]
    if args.peak_tflops is not None or args.gpu_mem_gb is not None:
        peak = node.gpu.peak_tflops if args.peak_tflops is None else check_number("--peak-tflops", args.peak_tflops, strict=True)
        mem = node.gpu.memory_gb if args.gpu_mem_gb is None else check_number("--gpu-mem-gb", args.gpu_mem_gb, strict=True)
        name = args.gpu or "custom-gpu"
        node = NodePreset(dataclasses.replace(node.gpu, name=name, peak_tflops=peak, memory_gb=mem),
                          node.gpus_per_node, node.intra_node_gbps, node.inter_node_gbps)
    over = {}
    if args.gpus_per_node is not None:
        over["gpus_per_node"] = check_int("--gpus-per-node", args.gpus_per_node, minimum=1)
    for flag in ("intra_node_gbps", "inter_node_gbps"):
        if getattr(args, flag) is not None:
            over[flag] = check_number(f"--{flag.replace('_', '-')}", getattr(args, flag), strict=True)
    return make_cluster(node, n, **over)


def _pins(args: argparse.Namespace) -> dict:
    pins = {}
    for flag, key in (("tp", "t"), ("pp", "p"), ("dp", "d"), ("micro_batch", "micro_batch"), ("chunks", "v")):
        if getattr(args, flag) is not None:
            pins[key] = check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), minimum=1)
    if args.recompute is not None:
        pins["recompute"] = check_choice("--recompute", args.recompute, ("none", "selective", "full"))
    if args.sequence_parallel is not None:
        pins["sequence_parallel"] = check_choice("--sequence-parallel", args.sequence_parallel, ("on", "off")) == "on"
    return pins


def run(args: argparse.Namespace) -> int:
    from modelpar.costmodel import assumptions_for, plan
    from modelpar.costmodel.report import explain, format_table, no_fit_error

    model, cluster = _model(args), _cluster(args)
    batch = check_int("--batch", args.batch, minimum=1)
    top = check_int("--top", args.top, minimum=1)
    pins = _pins(args)
    if args.plot:  # fail before the search, in one line, not deep inside matplotlib
        check_output_path("--plot", args.plot, (".png", ".svg"))
    assumptions = assumptions_for(cluster.gpu.name)
    result = plan(model, cluster, batch, assumptions, **pins)
    if not result.ranked:
        raise no_fit_error(model, cluster, batch, assumptions, result, pinned=bool(pins))
    if args.plot:
        from modelpar.costmodel.plot import plot_tp_grid

        plot_tp_grid(result, args.plot, f"{model.name} on {cluster.gpus} x {cluster.gpu.name}, batch {batch}",
                     cluster.gpu.memory_gb)
    if args.json:
        print(json.dumps([e.as_dict() for e in result.ranked[:top]], indent=1))
        return 0
    print(f"{model.name}: {model.params / 1e9:.1f}B parameters, {cluster.gpus} x {cluster.gpu.name} "
          f"({cluster.gpus_per_node} per node, {cluster.intra_node_gbps:g} / {cluster.inter_node_gbps:g} GB/s per GPU "
          f"inside / across nodes), batch {batch} x {model.seq} tokens; {len(result.ranked)} layouts fit.")
    print(format_table(result.ranked[:top]))
    print()
    print(explain(result, cluster))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0

