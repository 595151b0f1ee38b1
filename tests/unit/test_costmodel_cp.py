"""The cost model's context parallelism: bytes by hand, activations ÷ cp, the search and `modelpar plan --cp`."""

import dataclasses

import pytest

from modelpar.cli import main
from modelpar.costmodel import DEFAULT
from modelpar.costmodel.context import cp_block_bytes, cp_bytes_per_layer, cp_layer_time
from modelpar.costmodel.estimate import check_config, estimate
from modelpar.costmodel.memory import memory_breakdown
from modelpar.costmodel.presets import gpu_preset, model_preset
from modelpar.costmodel.search import search
from modelpar.costmodel.specs import ClusterSpec, ModelSpec, ParallelConfig, check_trainer_context

LLAMA8 = ModelSpec(32, 4096, 32, 8192, 128256, ffn=14336, kv_heads=8, gated_mlp=False, name="gqa")
BF16 = DEFAULT.with_(param_bytes=2)


def test_bytes_per_layer_by_hand():
    # one rank's K and V: 2 · b · s/cp · h · g/a / t values of 2 bytes = 2 · 1 · 2048 · 4096 · 1/4 · 2 = 8 MiB
    cfg = ParallelConfig(1, 1, 1, recompute="none", cp=4)
    assert cp_block_bytes(LLAMA8, cfg, BF16) == 8 * 2**20
    # ring: 3 hops forward, 3 of K/V and 4 of their gradient backward; all-gather: 3 blocks each way
    assert cp_bytes_per_layer(LLAMA8, cfg, BF16) == 10 * 8 * 2**20
    assert cp_bytes_per_layer(LLAMA8, dataclasses.replace(cfg, cp_comm="allgather"), BF16) == 6 * 8 * 2**20
    assert cp_bytes_per_layer(LLAMA8, dataclasses.replace(cfg, recompute="full"), BF16) == 13 * 8 * 2**20
    assert cp_bytes_per_layer(LLAMA8, ParallelConfig(1, 1, 1), BF16) == 0.0


def test_activations_divide_by_cp_and_the_state_shards_over_d_cp():
    base = ParallelConfig(2, 1, 1, recompute="none", zero=1)
    one, two = (memory_breakdown(LLAMA8, dataclasses.replace(base, cp=c), 1, BF16) for c in (1, 2))
    assert two["activations"] == pytest.approx(one["activations"] / 2, rel=1e-12)
    four_replicas = memory_breakdown(LLAMA8, dataclasses.replace(base, d=4), 1, BF16)
    assert memory_breakdown(LLAMA8, dataclasses.replace(base, d=2, cp=2), 1, BF16)["state"] == four_replicas["state"]


def test_the_ring_hides_behind_attention_and_the_all_gather_does_not():
    cluster = ClusterSpec(gpu_preset("a100-80gb").gpu, 8)
    ring = ParallelConfig(1, 1, 1, recompute="none", cp=8)
    ring_time = cp_layer_time(LLAMA8, cluster, ring, DEFAULT, 0.5)
    gather_time = cp_layer_time(LLAMA8, cluster, dataclasses.replace(ring, cp_comm="allgather"), DEFAULT, 0.5)
    assert 0 < ring_time < gather_time  # only the last gradient hop (and any hop longer than its block) shows
    e = estimate(LLAMA8, cluster, ring, 8)
    assert e.time["cp"] > 0 and e.links["cp"] == "nvlink"
    assert sum(e.time.values()) == pytest.approx(e.step_time_s)


def test_a_sequence_not_split_in_2cp_chunks_is_not_a_layout():
    cluster = ClusterSpec(gpu_preset("a100-80gb").gpu, 6)
    reason = check_config(LLAMA8, cluster, ParallelConfig(1, 1, 2, cp=3), 4)
    assert reason == ("seq_len (8192) must be divisible by 2 * cp (6): context parallelism splits every sequence "
                      "into 2·cp equal chunks (no padding)")


def test_search_turns_to_cp_only_when_nothing_fits_without_it():
    long = dataclasses.replace(model_preset("llama3-8b"), seq=262144)
    cluster = ClusterSpec(gpu_preset("a100-80gb").gpu, 64)
    res = search(long, cluster, 8, recompute="selective")
    assert res.ranked and all(e.config.cp > 1 for e in res.ranked)
    short = search(model_preset("llama3-8b"), cluster, 64, recompute="selective")
    assert all(e.config.cp == 1 for e in short.ranked)
    pinned = search(model_preset("llama3-8b"), cluster, 64, recompute="selective", cp=2, t=8)
    assert pinned.ranked and all(e.config.cp == 2 and e.config.t == 8 for e in pinned.ranked)


def test_plan_cp_pinned_and_the_llama3_long_context_row(capsys):
    # Dubey et al. 2024, Table 4, the 131,072-token stage: 16,384 H100, TP 8, CP 16, PP 16 (DP 8 makes the GPUs)
    assert main(["plan", "--model", "llama3-405b", "--seq-len", "131072", "--gpu", "h100-sxm", "--gpus", "16384",
                 "--batch", "128", "--tp", "8", "--cp", "16", "--pp", "16", "--zero", "2", "--engine", "pytorch"]) == 0
    out = capsys.readouterr().out
    assert "Best: t = 8, cp = 16 (ring), p = 16, d = 8," in out


@pytest.mark.parametrize("args, message", [
    (["--cp", "3"], "seq_len (2048) must be divisible by 2 * cp (6)"),
    (["--cp", "2", "--cp-comm", "ulysses"], "--cp-comm must be one of {ring, allgather}, got 'ulysses'"),
])
def test_bad_cp_in_plan_is_one_line(capsys, args, message):
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "64", "--batch", "64", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


@pytest.mark.parametrize("args, message", [((18, 2, 0, 1, False), r"seq_len \(18\) must be divisible by 2 \* cp \(4\)"),
                                           ((16, 2, 2, 1, False), r"zero 2 with cp 2 is not supported"),
                                           ((24, 2, 0, 8, True), r"seq_len / cp \(sequence parallel\)")])
def test_the_trainers_cp_rules_in_one_place(args, message):
    """``TrainConfig.check`` and ``--plan auto`` both ask ``check_trainer_context``; ZeRO-1 and cp = 1 pass."""
    with pytest.raises(ValueError, match=message):
        check_trainer_context(*args)
    check_trainer_context(16, 2, 1, 2, True)
    check_trainer_context(18, 1, 3, 8, True)
