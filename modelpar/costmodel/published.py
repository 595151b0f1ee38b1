"""Published measurements of large training runs, and the planner's prediction for each.

Each run pins what its paper states (t, p, d, recomputation, framework features) and leaves the
rest (micro-batch, v, what it does not state) to the search; the prediction is reported in the
convention the source uses: ``"tflops"`` counts executed FLOPs (recomputation included, Megatron's
convention), ``"mfu"`` model FLOPs over peak. ``compare`` is how ``DEFAULT`` was fitted and is
what ``docs/costmodel.md`` tabulates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelpar.costmodel.assumptions import Assumptions, assumptions_for
from modelpar.costmodel.presets import make_cluster, model_preset
from modelpar.costmodel.search import search
from modelpar.costmodel.specs import ModelSpec

__all__ = ["PUBLISHED", "PublishedRun", "compare", "predict"]


def _gpt(layers: int, hidden: int, heads: int, name: str) -> ModelSpec:
    return ModelSpec(layers, hidden, heads, 2048, 51200, name=name)


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: the model, the cluster, what the paper pinned and what it measured."""

    name: str
    source: str
    model: ModelSpec
    gpu: str
    gpus: int
    batch: int
    measured: float  # TFLOP/s per GPU, or MFU as a fraction
    convention: str = "tflops"  # "tflops" (executed FLOPs) or "mfu" (model FLOPs / peak)
    pins: dict = field(default_factory=dict)  # search(...) keyword arguments
    cluster: dict = field(default_factory=dict)  # make_cluster overrides (bandwidths)
    framework: dict = field(default_factory=dict)  # Assumptions fields the run's software sets


_MEGATRON = "Narayanan et al. 2021 (SC'21) Table 1"
_SC21 = [  # (params, layers, hidden, heads, t, p, gpus, batch, measured TFLOP/s)
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 30, 3072, 32, 2, 1, 64, 512, 138),
    ("7.5B", 36, 4096, 32, 4, 1, 128, 512, 142), ("18B", 40, 6144, 48, 8, 1, 256, 1024, 135),
    ("39B", 48, 8192, 64, 8, 2, 512, 1536, 138), ("76B", 60, 10240, 80, 8, 4, 1024, 1792, 140),
    ("145B", 80, 12288, 96, 8, 8, 1536, 2304, 148), ("310B", 96, 16384, 128, 8, 16, 1920, 2160, 155),
    ("530B", 105, 20480, 128, 8, 35, 2520, 2520, 163), ("1T", 128, 25600, 160, 8, 64, 3072, 3072, 163),
]
_KORTHIKANTI = [  # Korthikanti et al. 2022 Table 5, sequence parallel + selective recompute, d = 1: MFU
    ("22B", 48, 6144, 64, 8, 1, 4, 0.415), ("175B", 96, 12288, 96, 8, 8, 64, 0.514),
    ("530B", 105, 20480, 128, 8, 35, 280, 0.560), ("1T", 128, 25600, 160, 8, 64, 512, 0.563),
]

# DeepSpeed's pipeline engine (MT-NLG, BLOOM): ZeRO-1, each TP rank sends the whole activation (no
# scatter/gather), and a fixed cost per microbatch per stage, pp_engine_overhead_s = 30 ms, fitted once
# to MT-NLG's three runs (blocking send/recv and per-instruction dispatch; Megatron-LM has none) and
# checked on BLOOM, which was not used to fit it.
_DEEPSPEED = dict(distributed_optimizer=True, pp_scatter_gather=False, pp_engine_overhead_s=0.03)

PUBLISHED: list[PublishedRun] = [
    *(PublishedRun(f"Megatron {n}", _MEGATRON, _gpt(l, h, a, n), "a100-80gb", g, bs, tf,
                   pins=dict(t=t, p=p, recompute="full", sequence_parallel=False))
      for n, l, h, a, t, p, g, bs, tf in _SC21),
    PublishedRun("GPT-3 175B", "Narayanan et al. 2021 (SC'21) §5.1", model_preset("gpt3-175b"), "a100-80gb",
                 1024, 1536, 140, pins=dict(t=8, recompute="full", sequence_parallel=False)),
    *(PublishedRun(f"Korthikanti {n}", "Korthikanti et al. 2022 Table 5", _gpt(l, h, a, n), "a100-80gb",
                   t * p, bs, mfu, "mfu", pins=dict(t=t, p=p, recompute="selective", sequence_parallel=True))
      for n, l, h, a, t, p, bs, mfu in _KORTHIKANTI),
    *(PublishedRun(f"MT-NLG 530B, {g} GPUs", "Smith et al. 2022 §3.2", _gpt(105, 20480, 128, "mt-nlg-530b"),
                   "a100-80gb", g, 1920, tf,
                   pins=dict(t=8, p=35, micro_batch=1, v=1, recompute="full", sequence_parallel=False),
                   framework=_DEEPSPEED)
      for g, tf in ((2240, 126), (2800, 121), (3360, 113))),
    # BLOOM model card (BigScience 2022; Le Scao et al. 2022): 48 nodes of 8 A100-80GB, NVLink inside, 4 × 100 Gb/s
    # Omni-Path per node (6.25 GB/s per GPU); t = 4, p = 12, d = 8, micro-batch 2, batch 2048 × 2048 tokens,
    # full recomputation, no SP, 70 layers on 12 stages with the two embeddings counted as layers
    # (72 = 12·6: first and last stage hold 5); "about 150 TFLOP/s per GPU" (Megatron's count, with recompute).
    PublishedRun("BLOOM 176B, 384 GPUs", "BLOOM model card (BigScience 2022)", model_preset("bloom-176b"), "a100-80gb",
                 384, 2048, 150, pins=dict(t=4, p=12, micro_batch=2, v=1, recompute="full", sequence_parallel=False),
                 cluster=dict(inter_node_gbps=6.25), framework=dict(_DEEPSPEED, uneven_layers=True)),
    *(PublishedRun(f"Llama 3 405B, {g} GPUs", "Dubey et al. 2024 Table 4", model_preset("llama3-405b"), "h100-sxm",
                   g, 2048, mfu, "mfu", pins=dict(t=8, p=16),
                   # §3.3.2: one layer fewer on the first and last stage; FSDP shards the optimizer state and
                   # the FP32 gradients over d, the BF16 weights stay whole (2 + 16/d bytes per parameter)
                   framework=dict(uneven_layers=True, sharded_state_bytes=16.0))
      for g, mfu in ((8192, 0.43), (16384, 0.41))),
]


def predict(run: PublishedRun, assumptions: Assumptions | None = None) -> float:
    """The planner's best configuration for ``run``, in the run's convention (TFLOP/s or MFU).

    ``assumptions`` default to ``DEFAULT`` on A100 and ``MODERN`` on H100 (``assumptions_for``).
    """
    a = assumptions or assumptions_for(run.gpu)
    a = a.with_(**run.framework) if run.framework else a
    cluster = make_cluster(run.gpu, run.gpus, **run.cluster)
    best = search(run.model, cluster, run.batch, a, **run.pins).ranked
    if not best:
        raise ValueError(f"published run {run.name!r}: no configuration fits under these assumptions")
    return best[0].mfu if run.convention == "mfu" else best[0].tflops_per_gpu


def compare(assumptions: Assumptions | None = None) -> list[tuple[PublishedRun, float, float]]:
    """(run, predicted, predicted/measured − 1) for every published run."""
    rows = []
    for run in PUBLISHED:
        pred = predict(run, assumptions)
        rows.append((run, pred, pred / run.measured - 1))
    return rows
