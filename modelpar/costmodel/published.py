"""Published measurements of large training runs, each a ``modelpar plan`` command line, and the accuracy table.

A run pins what its paper states (t, p, micro-batch, recomputation, sequence parallelism, engine,
ZeRO stage, link speeds) and leaves the rest to the search, exactly as a user would type it.
``validate`` runs every one through ``request.parse_plan_command`` and ``search`` — the code path of
``modelpar plan`` — and compares the best layout with the measurement in the source's convention:
``"tflops"`` executed FLOPs per GPU (recomputation included, Megatron's count), ``"mfu"`` model
FLOPs over peak, ``"step_s"`` seconds per iteration. The error is the step-time error, predicted /
measured − 1: positive when the model is slower than the run. ``fitted`` names what, if anything,
was fitted on a run; the others are held out.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar.costmodel.assumptions import Assumptions
from modelpar.costmodel.estimate import Estimate
from modelpar.costmodel.request import parse_plan_command

__all__ = ["PUBLISHED", "PublishedRun", "Validation", "mean_abs_error", "validate"]

GRID = "DEFAULT's GEMM curve and per-kernel latency (benchmarks/fit_costmodel.py)"
ENGINE = "deepspeed engine overhead (30 ms per microbatch per stage)"


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: where it comes from, the command line that states it, what it measured."""

    name: str
    source: str
    command: str  # the flags after `modelpar plan`
    measured: float  # TFLOP/s per GPU, MFU as a fraction, or seconds per step
    convention: str = "tflops"  # "tflops", "mfu" or "step_s"
    fitted: str = ""  # the parameter fitted on this run, "" if none (held out)
    unmodelled: str = ""  # what the run does that the model does not price ("" if nothing known); reported apart

    @property
    def split(self) -> str:
        """"fit" (a parameter was fitted on it) or "test" (held out: its error is the planner's accuracy)."""
        return "fit" if self.fitted else "test"


def _gpt(layers: int, hidden: int, heads: int) -> str:
    return f"--layers {layers} --hidden {hidden} --heads {heads} --seq-len 2048 --vocab 51200"


# Megatron-LM as the SC'21 and Korthikanti runs used it: no distributed optimizer (ZeRO-0).
_SC21 = "Narayanan et al. 2021 (SC'21) Table 1"
_SC21_RUNS = [  # (name, layers, hidden, heads, t, p, gpus, batch, measured TFLOP/s); full recomputation, no SP
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 30, 3072, 32, 2, 1, 64, 512, 138),
    ("7.5B", 36, 4096, 32, 4, 1, 128, 512, 142), ("18B", 40, 6144, 48, 8, 1, 256, 1024, 135),
    ("39B", 48, 8192, 64, 8, 2, 512, 1536, 138), ("76B", 60, 10240, 80, 8, 4, 1024, 1792, 140),
    ("145B", 80, 12288, 96, 8, 8, 1536, 2304, 148), ("310B", 96, 16384, 128, 8, 16, 1920, 2160, 155),
    ("530B", 105, 20480, 128, 8, 35, 2520, 2520, 163), ("1T", 128, 25600, 160, 8, 64, 3072, 3072, 163),
]
_PTDP = "Narayanan et al. 2021 (SC'21) Table 2, PTD-P"
_PTDP_RUNS = [  # (name, layers, hidden, heads, p, gpus, batch, TFLOP/s); t = 8, micro-batch 1, full recomputation
    ("175B", 96, 12288, 96, 12, 384, 1536, 153), ("175B", 96, 12288, 96, 12, 768, 1536, 149),
    ("175B", 96, 12288, 96, 12, 1536, 1536, 141), ("530B", 105, 20480, 128, 35, 560, 2240, 171),
    ("530B", 105, 20480, 128, 35, 1120, 2240, 167), ("530B", 105, 20480, 128, 35, 2240, 2240, 159),
]
_KORTHIKANTI = "Korthikanti et al. 2022 Tables 3, 5"
_KORTHIKANTI_RUNS = [  # (name, layers, hidden, heads, p, micro-batch, batch, full-recompute s/step, MFU with SP + selective)
    ("22B", 48, 6144, 64, 1, 4, 4, 1.42, 0.415), ("175B", 96, 12288, 96, 8, 1, 64, 18.13, 0.514),
    ("530B", 105, 20480, 128, 35, 1, 280, 49.05, 0.560), ("1T", 128, 25600, 160, 64, 1, 512, 94.42, 0.563),
]

PUBLISHED: list[PublishedRun] = [
    *(PublishedRun(f"SC'21 {n}", _SC21, f"{_gpt(l, h, a)} --gpus {g} --batch {bs} --tp {t} --pp {p} "
                   "--recompute full --sequence-parallel off --zero 0 --engine megatron-2021", tf, fitted=GRID)
      for n, l, h, a, t, p, g, bs, tf in _SC21_RUNS),
    PublishedRun("SC'21 GPT-3 175B, 1024 GPUs", "Narayanan et al. 2021 (SC'21) §5.1, Training Time Estimates",
                 "--model gpt3-175b --gpus 1024 --batch 1536 --tp 8 --recompute full --sequence-parallel off --zero 0 "
                 "--engine megatron-2021",
                 140,
                 fitted=GRID),
    *(PublishedRun(f"SC'21 PTD-P {n}, {g} GPUs", _PTDP, f"{_gpt(l, h, a)} --gpus {g} --batch {bs} --tp 8 --pp {p} "
                   "--micro-batch 1 --recompute full --sequence-parallel off --zero 0 --engine megatron-2021", tf)
      for n, l, h, a, p, g, bs, tf in _PTDP_RUNS),
    *(PublishedRun(f"Korthikanti {n}, full recompute", _KORTHIKANTI,
                   f"{_gpt(l, h, a)} --gpus {8 * p} --batch {bs} --tp 8 --pp {p} --micro-batch {b} "
                   "--recompute full --sequence-parallel off", sec, "step_s")
      for n, l, h, a, p, b, bs, sec, _ in _KORTHIKANTI_RUNS),
    *(PublishedRun(f"Korthikanti {n}, SP + selective", _KORTHIKANTI,
                   f"{_gpt(l, h, a)} --gpus {8 * p} --batch {bs} --tp 8 --pp {p} --micro-batch {b} "
                   "--recompute selective --sequence-parallel on", mfu, "mfu", fitted=GRID)
      for n, l, h, a, p, b, bs, _, mfu in _KORTHIKANTI_RUNS),
    # Smith et al. 2022 §3.2 (the layout): DeepSpeed's pipeline engine with Megatron's tensor parallelism and ZeRO-1;
    # t = 8, p = 35, micro-batch 1, batch 1920, full recomputation. §2.4 gives the throughput figures.
    *(PublishedRun(f"MT-NLG 530B, {g} GPUs", "Smith et al. 2022 §2.4 (throughput), §3.2 (layout)",
                   f"{_gpt(105, 20480, 128)} --gpus {g} --batch 1920 --tp 8 --pp 35 --micro-batch 1 "
                   "--recompute full --sequence-parallel off --engine deepspeed --zero 1", tf, fitted=ENGINE)
      for g, tf in ((2240, 126), (2800, 121), (3360, 113))),
    # BLOOM model card (BigScience 2022; Le Scao et al. 2022): 48 nodes of 8 A100-80GB, 4 × 100 Gb/s Omni-Path per
    # node (6.25 GB/s per GPU); t = 4, p = 12, d = 8, micro-batch 2, batch 2048, full recomputation, no SP,
    # DeepSpeed with ZeRO-1; 70 layers as 5, 6, …, 6, 5; "about 150 TFLOP/s per GPU" (Megatron's count).
    PublishedRun("BLOOM 176B, 384 GPUs", "BLOOM model card (BigScience 2022)",
                 "--model bloom-176b --gpus 384 --batch 2048 --tp 4 --pp 12 --micro-batch 2 --recompute full "
                 "--sequence-parallel off --engine deepspeed --zero 1 --inter-node-gbps 6.25", 150),
    # Dubey et al. 2024 Table 4 and §3.3.2: t = 8, p = 16, FSDP sharding the optimizer state and the FP32
    # gradients with the BF16 weights kept whole after the forward (ZeRO-2), one layer fewer on the first and last stage.
    *(PublishedRun(f"Llama 3 405B, {g} GPUs", "Dubey et al. 2024 Table 4",
                   f"--model llama3-405b --gpu h100-sxm --gpus {g} --batch 2048 --tp 8 --pp 16 --zero 2 --engine pytorch",
                   mfu, "mfu")
      for g, mfu in ((8192, 0.43), (16384, 0.41))),
    # DeepSeek-AI 2024 (arXiv:2412.19437) §3.2, §4.2, Table 1 — figures entered from memory, not re-read: 2048 H800s,
    # 16-way pipeline (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor
    # parallelism; batch 15360 sequences of 4096 tokens after the ramp-up; 180K H800 GPU-hours per trillion tokens,
    # i.e. 1e12 / (180e3 · 3600) = 1543 tokens/s per GPU and 15360 · 4096 / (2048 · 1543) = 19.9 s per step.
    PublishedRun("DeepSeek-V3 671B, 2048 H800s", "DeepSeek-AI 2024 (arXiv:2412.19437) §3.2, §4.2 (from memory)",
                 "--model deepseek-v3 --gpu h800 --gpus 2048 --batch 15360 --tp 1 --pp 16 --ep 64 --zero 1", 19.9,
                 "step_s", unmodelled="MLA attention, FP8 GEMMs and activations, multi-token prediction, DualPipe's "
                                      "overlap of the all-to-alls, node-limited routing"),
]


@dataclass(frozen=True)
class Validation:
    """One row of the accuracy table."""

    run: PublishedRun
    best: Estimate  # the layout the planner picks for the run's command line
    predicted: float  # in the run's convention

    @property
    def error(self) -> float:
        """Step-time error, predicted / measured − 1 (+: the model is slower than the run)."""
        if self.run.convention == "step_s":
            return self.predicted / self.run.measured - 1
        return self.run.measured / self.predicted - 1


def validate(runs: list[PublishedRun] | None = None, base: Assumptions | None = None) -> list[Validation]:
    """Every published run through the ``modelpar plan`` code path, in order.

    ``base`` replaces the GPU's default assumptions (``benchmarks/fit_costmodel.py`` varies them).
    """
    rows = []
    for run in PUBLISHED if runs is None else runs:
        result = parse_plan_command(run.command, base).search()
        if not result.ranked:
            raise ValueError(f"published run {run.name!r}: no layout fits `modelpar plan {run.command}`")
        best = result.ranked[0]
        value = {"tflops": best.tflops_per_gpu, "mfu": best.mfu, "step_s": best.step_time_s}[run.convention]
        rows.append(Validation(run, best, value))
    return rows


def mean_abs_error(rows: list[Validation]) -> float:
    """Mean of |step-time error| over ``rows``."""
    return sum(abs(r.error) for r in rows) / len(rows)
