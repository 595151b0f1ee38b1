"""The model inventory (``costmodel.inventory``) is what the trainer's modules hold: uneven and ``--stage-layers``
splits included (issue 38: the cost model priced ⌊L/p⌋ layers a stage), and the trainer refuses to start when
its modules and the inventory differ. One process, t = 1; the multi-rank layouts (t, cp, ep, ZeRO) run the same
check inside every ``train`` of test_prediction."""

import dataclasses
import re

import pytest
import torch

from modelpar.costmodel.inventory import bucket_groups, stage_layers, stage_tensors
from modelpar.model import ModelConfig, build_stage
from modelpar.training import TrainConfig
from modelpar.training.buckets import build_buckets
from modelpar.training.parts import check_inventory
from modelpar.training.prediction import local_run

GPT5 = ModelConfig(hidden=32, heads=4, layers=5, seq_len=16)
LLAMA5 = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=1, layers=5, seq_len=16, tie_embeddings=True)


def _cfg(model, pp, split=None, chunks=1):
    schedule = "interleaved" if chunks > 1 else "1f1b"
    return TrainConfig(model=model, pp=pp, tp=1, dp=1, chunks=chunks, schedule=schedule, stage_layers=split,
                       batch_size=8, microbatches=2, precision="fp64").check(pp)


def _held(cfg, stage):
    module = build_stage(cfg.model, stage, cfg.pp * cfg.chunks, split=cfg.layer_split, dtype=torch.float64)
    return module, [p.numel() for p in module.parameters()]


@pytest.mark.parametrize("model", [GPT5, LLAMA5], ids=["gpt", "llama-tied"])
@pytest.mark.parametrize("pp, split, chunks", [(2, None, 1), (2, (3, 2), 1), (2, (4, 1), 1), (3, (0, 5, 0), 1),
                                               (2, (1, 2, 1, 1), 2)])
def test_every_stage_holds_the_inventory(model, pp, split, chunks):
    cfg = _cfg(model, pp, split, chunks)
    run = local_run(cfg)
    total = 0
    for s in range(pp * chunks):
        module, held = _held(cfg, s)
        assert held == [x.numel for x in stage_tensors(run, s)], s
        assert len(stage_layers(run, s)) == cfg.layer_split[s] == len(module.layers)
        total += sum(held)
    assert sum(cfg.layer_split) == 5 and total > 0


def test_five_layers_over_two_stages_hand_checked():
    """GPT, h = 32: a layer holds 2·64 (norms) + 3·32·32 + 96 + 32·32 + 32 + 32·128 + 128 + 128·32 + 32 = 12,704;
    the first stage the embedding and positions besides, the last the final norm and the tied copy of the head."""
    vocab = GPT5.spec().vocab
    first, last = vocab * 32 + 16 * 32, 64 + vocab * 32
    for split, (a, b) in {None: (2, 3), (3, 2): (3, 2), (4, 1): (4, 1)}.items():
        run = local_run(_cfg(GPT5, 2, split))
        assert [sum(x.numel for x in stage_tensors(run, s)) for s in range(2)] == [first + a * 12_704, last + b * 12_704]
    # the old rule, ⌊5/2⌋ = 2 layers a stage, missed a layer: 12,704 elements of the trainer's 80,480


def test_the_trainer_refuses_a_model_that_is_not_the_inventory():
    cfg = _cfg(GPT5, 2, (3, 2))
    module, _ = _held(cfg, 0)
    buckets = build_buckets([(0, module)], 1 << 22)
    check_inventory(cfg, {0: module}, buckets)  # as built: the inventory's
    with pytest.raises(RuntimeError, match="stage 0: the model holds parameters .* inventory"):
        check_inventory(dataclasses.replace(cfg, stage_layers=(2, 3)), {0: module}, buckets)


def test_bucket_groups_is_the_trainers_grouping():
    assert bucket_groups([], 4) == []
    assert bucket_groups([3, 1, 2, 9, 1], 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (3, 1, 2, 9, 1)]
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    got = [b.numel for b in build_buckets([(0, module)], 4)]
    assert got == [1, 9, 3, 3]  # reversed 1, 9, 2, 1, 3: 1 | 9 | 2 + 1 | 3 (the 3 does not fit with 2 + 1)


def test_a_published_run_counts_the_inventory_hand_checked():
    """GPT-3 at t = 8, p = 16: a layer holds 12h²/t + 7h/t (qkv and fc biases split) + 6h (two LayerNorms and the
    two row biases, replicated); the first device adds the positions s·h and its V/t rows of the embedding, the
    last the final norm 2h and the tied copy of the head. Megatron's closed form, (12h² + 13h)/t a layer, divided
    the replicated 6h by t too (3e-4 of a middle device), and the positions (1.6% of the first device)."""
    from modelpar.costmodel import ParallelConfig, memory_breakdown
    from modelpar.costmodel.assumptions import DEFAULT
    from modelpar.costmodel.inventory import Holding, layer_elements, rank_elements
    from modelpar.costmodel.memory import device_params
    from modelpar.costmodel.presets import model_preset
    from modelpar.costmodel.zero_bytes import training_state_bytes

    gpt3, t, h = model_preset("gpt3-175b"), 8, 12288
    cfg = ParallelConfig(t, 16, 8)
    layer = 12 * h * h // t + 7 * h // t + 6 * h
    table = 51200 // t * h
    assert [device_params(gpt3, cfg, r) for r in (0, 1, 15)] == [2048 * h + table + 6 * layer, 6 * layer,
                                                                  6 * layer + 2 * h + table]
    assert layer_elements(Holding.of(gpt3, cfg)) == layer
    closed = 6 * (gpt3.layer_params / t)
    assert device_params(gpt3, cfg, 1) / closed - 1 == pytest.approx(6 * h * (1 - 1 / t) / (gpt3.layer_params / t))
    assert device_params(gpt3, cfg, 1) / closed - 1 < 3e-4
    assert rank_elements(Holding.of(gpt3, cfg), 1) == (6 * layer, 0)  # d and cp do not change what a rank holds
    assert rank_elements(Holding.of(gpt3, ParallelConfig(t, 16, 2, cp=4)), 1) == (6 * layer, 0)
    state = memory_breakdown(gpt3, cfg, 12, DEFAULT)["state"]
    assert state == training_state_bytes(2048 * h + table + 6 * layer, 8, 0, 2, 2)  # the first device, 16 B each


@pytest.mark.parametrize("v, ep, split", [(1, 1, None), (2, 1, None), (1, 2, (3, 5)), (2, 4, (1, 2, 3, 2))])
def test_published_and_local_pricers_read_one_inventory(v, ep, split):
    """``rank_elements`` of a published layout (``Holding``) is ``stage_tensors`` summed over the rank's stages of
    the same layout as a ``LocalLayout``: one rule for both pricers (MoE layers, experts ÷ ep, interleaving)."""
    from modelpar.costmodel import ModelSpec, ParallelConfig
    from modelpar.costmodel.inventory import Holding, rank_elements
    from modelpar.costmodel.local_memory import LocalLayout
    from modelpar.costmodel.moe import MoESpec

    moe = MoESpec(experts=8, ffn=16, shared=1, every=2, first_dense=1)
    model = ModelSpec(8, 32, 4, 16, 128, kv_heads=2, gated_mlp=True, tied_embeddings=False, learned_positions=False,
                      bias=False, moe=moe)
    cfg = ParallelConfig(2, 2, 4, v=v, ep=ep, sequence_parallel=True, stage_layers=split)
    local = LocalLayout(model, t=2, p=2, d=4, v=v, ep=ep, sequence_parallel=True, moe=moe, stage_layers=split)
    for rank in range(2):
        tensors = [x for s in range(rank, 2 * v, 2) for x in stage_tensors(local, s)]
        assert rank_elements(Holding.of(model, cfg), rank) == (sum(x.numel for x in tensors),
                                                               sum(x.numel for x in tensors if x.expert))
    if ep > 1:  # the routed experts of rank 0's MoE layers, E/ep of them: reduced over d/ep
        assert rank_elements(Holding.of(model, cfg), 0)[1] > 0


@pytest.mark.parametrize("fields, message", [
    ({"cp": 0}, "cp must be >= 1, got 0"),
    ({"ep": 0}, "ep must be >= 1, got 0"),
    ({"cp_comm": "tree"}, "cp_comm must be one of {ring, allgather}, got 'tree'"),
    ({"stage_layers": (2, 3, 0)}, "stage_layers has 3 entries, expected p·v = 2"),
])
def test_both_layout_records_share_the_dimensions_and_their_check(fields, message):
    """``ParallelConfig`` and ``LocalLayout`` declare cp, cp_comm, ep and stage_layers once (``Dimensions``): the
    same names, defaults and one-line errors; neither record's own positional fields move."""
    from modelpar.costmodel import ModelSpec, ParallelConfig
    from modelpar.costmodel.local_memory import LocalLayout
    from modelpar.costmodel.specs import Dimensions

    shared = {f.name for f in dataclasses.fields(Dimensions)}
    assert shared == {"cp", "cp_comm", "ep", "stage_layers"}
    for record in (ParallelConfig, LocalLayout):
        own = {f.name: f for f in dataclasses.fields(record)}
        assert all(own[name].kw_only and own[name].default == f.default
                   for name, f in ((f.name, f) for f in dataclasses.fields(Dimensions)))
    assert ParallelConfig(8, 16, 64, 1, 8, "none", True, 2) == ParallelConfig(
        t=8, p=16, d=64, micro_batch=1, v=8, recompute="none", sequence_parallel=True, zero=2)
    assert repr(ParallelConfig(1, 2, 1, cp=2)) == ("ParallelConfig(t=1, p=2, d=1, micro_batch=1, v=1, recompute='full', "
                                                   "sequence_parallel=False, zero=0, cp=2, cp_comm='ring', ep=1, "
                                                   "stage_layers=None)")  # as written: the record's own fields first
    model = ModelSpec(4, 32, 4, 16, 128)
    assert repr(LocalLayout(model)).startswith("LocalLayout(model=ModelSpec(")
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(1, 2, 1, **fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        LocalLayout(model, p=2, **fields)
