"""Predicted vs measured: every rank's parameter, gradient and AdamW bytes (ZeRO 0–3; context parallelism, ring
and all-gather, with t and p) and its data-parallel bytes sent under ZeRO are the cost model's exactly, its held
activations exactly (fp64, fp32 and bf16; t > 1 and cp: 0.1%, MoE: 10%), uneven and ``--stage-layers`` splits too,
and the summary and metrics.jsonl carry both.

One LocalCluster of 4 gloo ranks for the module; the runs are one or two steps of a tiny model.
"""

import dataclasses
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from modelpar.costmodel.allocator import optimizer_tensors
from modelpar.costmodel.local import dp_bytes_step, predict_local, tp_collectives, tp_grad_sync
from modelpar.costmodel.local_memory import activation_bytes, state_bytes
from modelpar.costmodel.presets import CPU_DEFAULT
from modelpar.model import ModelConfig
from modelpar.schedules import get_schedule
from modelpar.tensor_parallel.accounting import comm_log
from modelpar.training import TrainConfig, train
from modelpar.training.prediction import compare, held_parameter_bytes, local_run, predict_run

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
LLAMA = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=1, layers=4, seq_len=16)
MOE = dataclasses.replace(LLAMA, experts=4, shared_experts=1, moe_every=2)  # layers 1 and 3
BASE = TrainConfig(model=TINY, steps=1, batch_size=8, microbatches=2, precision="fp64", warmup=1, eval_every=0,
                   eval_batches=1, tp=1, pp=1, dp=1)

CASES = [
    dict(tp=2, pp=2),
    dict(pp=4, schedule="gpipe"),
    dict(pp=2, dp=2, zero=1, model=dataclasses.replace(TINY, tie_embeddings=True)),
    dict(dp=4, zero=1, bucket_mb=0.01),  # several buckets, each padded to a multiple of d
    dict(tp=4, sequence_parallel=True, recompute="selective"),
    dict(tp=2, dp=2, model=LLAMA, recompute="full"),  # one key/value head, replicated on both tp ranks
    dict(pp=2, schedule="interleaved", chunks=2, dp=2, microbatches=2),
    dict(pp=2, schedule="zb-h1", tp=2, precision="fp32"),
    dict(pp=2, dp=2, zero=2, bucket_mb=0.04),  # ZeRO-2: gradient ranges, several buckets
    dict(dp=4, zero=3, bucket_mb=0.02, steps=2),  # ZeRO-3: parameter ranges too (step 1 also gathers for the
    dict(tp=2, dp=2, zero=3, precision="bf16", reshard_after_forward=False, steps=2),  # activation count); bf16
    dict(cp=2, dp=2, zero=1, bucket_mb=0.02),  # cp: gradients reduced and ZeRO-1 sharded over d·cp = 4
    dict(cp=2, pp=2, cp_comm="allgather"),  # keeps the gathered keys and values
    dict(cp=2, tp=2, sequence_parallel=True),  # the ring; s/cp tokens split over t
    dict(cp=2, tp=2, model=LLAMA, cp_comm="allgather"),  # one key/value head, replicated, gathered
    dict(pp=2, dp=2, ep=2, model=MOE),  # experts split over ep (own buckets), router and shared expert per stage
    dict(tp=2, dp=2, ep=2, model=MOE),  # router and routed experts whole on both tp ranks, the shared one split
    dict(dp=4, ep=2, zero=1, model=MOE),  # ZeRO over d, the experts' ranges over the d/ep replicas holding them
    dict(tp=2, pp=2, loss_chunk_mb=0),  # the head in the model, the logits whole: their softmax is kept
    dict(tp=2, dp=2, sequence_parallel=True, model=LLAMA, loss_chunk_mb=0.01),  # the loss over 10-token chunks
    # uneven splits (issue 38: priced ⌊L/p⌋ layers a stage before the model inventory)
    dict(pp=2, dp=2, model=dataclasses.replace(TINY, layers=5)),  # the default split: 2, 3
    dict(pp=2, tp=2, stage_layers=(3, 1), bucket_mb=0.01),  # --stage-layers, several buckets
    dict(pp=2, dp=2, zero=2, stage_layers=(1, 3), bucket_mb=0.04, model=LLAMA),
    dict(pp=2, dp=2, ep=2, stage_layers=(3, 1), model=MOE),  # MoE layer 1 on stage 0, layer 3 on stage 1
    dict(pp=2, schedule="interleaved", chunks=2, dp=2, stage_layers=(0, 2, 1, 1)),  # an empty first chunk
    # bf16 autocast: the products' outputs in bf16, the residual stream, norms and log-sum-exps in fp32, autocast's
    # weight copies kept per microbatch (Llama's attention norm cast twice: q, and k|v)
    dict(pp=2, dp=2, precision="bf16", model=LLAMA),
    dict(tp=2, pp=2, precision="bf16", sequence_parallel=True, loss_chunk_mb=0),
    dict(pp=2, dp=2, precision="bf16", recompute="full", model=dataclasses.replace(TINY, tie_embeddings=True)),
    dict(pp=2, dp=2, precision="bf16", offload_activations="1", model=LLAMA),
    dict(dp=4, zero=3, precision="bf16", model=LLAMA, steps=2),  # ZeRO-3 gathers the weights in bf16: no copies
]


def _measured(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    assert len(r.step_end_times) == len(r.step_times) and all(0 < e < t for e, t in zip(r.step_end_times, r.step_times))
    return (dist.get_rank(), held_parameter_bytes(cfg, r), r.gradient_bytes, r.optimizer_state_bytes, r.saved_bytes,
            r.peak_held, r.activation_bytes, r.dp_bytes_sent, r.optimizer_tensors)


def _case_id(case):
    return "-".join(f"{k}{v if not isinstance(v, ModelConfig) else v.arch}" for k, v in case.items())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_rank_holds_the_predicted_bytes(c4, case):
    cfg = dataclasses.replace(BASE, **case)
    if cfg.schedule == "interleaved":
        cfg = dataclasses.replace(cfg, batch_size=8)
    run = local_run(cfg.check(4))
    schedule = get_schedule(cfg.schedule, ranks=cfg.pp, microbatches=cfg.microbatches, chunks=cfg.chunks)
    for rank, params, grads, state, saved, held, act, sent, tensors in c4.run(_measured, cfg):
        where = cfg.dims.coordinates(rank)
        stages = schedule.stages_on(where["pp"])
        want = state_bytes(run, stages, where["dp"] * cfg.cp + where["cp"])  # its index in the d·cp group
        assert (params, grads, state) == (want["parameters"], want["gradients"], want["optimizer"]), rank
        assert tensors == optimizer_tensors(run, stages, where["dp"] * cfg.cp + where["cp"]), rank  # the step end's
        #                                                                       tensors (calibrate's optimizer fit)
        if cfg.zero:  # the data-parallel bytes the cost model prices are the ones this rank sent
            assert sent == dp_bytes_step(run, stages), rank
        assert sorted(saved) == stages
        # what autograd keeps per microbatch, counted: exactly, but for t > 1 and cp (all exact but the t > 1
        # embedding's mask, a few bytes) and MoE (the routing's distance from uniform)
        tol = 0.1 if cfg.model.experts else 1e-3 if cfg.cp > 1 or cfg.tp > 1 else 1e-12
        for s in stages:
            assert saved[s] == pytest.approx(activation_bytes(run, s), rel=tol)
        if rank == 0:
            pred = predict_local(run, CPU_DEFAULT)
            assert pred.peak_held == held
            assert pred.memory["activations"] == pytest.approx(act, rel=tol)
            assert {k: pred.memory[k] for k in ("parameters", "gradients", "optimizer")} == want


def _collectives(cfg):
    torch.set_num_threads(1)
    with comm_log() as log:
        train(cfg)
    return dist.get_rank(), Counter((r.kind, r.phase, r.nbytes) for r in log.records if r.kind != "shape_check")


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_collectives_are_the_priced_ones(c4, sp):
    """One step's tensor-parallel collectives on each rank (two runs, 2 steps minus 1) are what the cost model
    prices: per layer, the embedding's and the head's, the cross entropy's."""
    cfg = dataclasses.replace(BASE, tp=2, pp=2, precision="fp32", sequence_parallel=sp, microbatches=2)
    one, two = (dict(c4.run(_collectives, dataclasses.replace(cfg, steps=n))) for n in (1, 2))
    run = local_run(cfg.check(4))
    for rank in range(4):
        stage = cfg.dims.coordinates(rank)["pp"]
        per_layer, ends = tp_collectives(run, stage)
        want = Counter({k: n * cfg.microbatches for k, n in Counter(per_layer * (TINY.layers // 2) + ends).items()})
        if tp_grad_sync(run, stage):  # the partial gradients' sum, once per step
            want[("all_reduce", "backward", tp_grad_sync(run, stage))] += 1
        assert two[rank] - one[rank] == want, rank


def test_prediction_arithmetic():
    """The step is the pipeline plus the exposed dp time plus the optimizer; the bubble is the simulator's."""
    cfg = dataclasses.replace(BASE, pp=2, dp=2, precision="fp32")
    pred = predict_run(cfg, CPU_DEFAULT)
    assert pred.step_time_s == pytest.approx(sum(pred.time.values()))
    assert 0 < pred.bubble < 1 and pred.peak_held == 2  # 1F1B: the first stage holds p = 2 microbatches
    rows = compare(pred, {"step_time_s": 2 * pred.step_time_s, "bubble": None, "parameters_bytes": pred.memory["parameters"]})
    assert rows["step_time_s"]["error"] == pytest.approx(-0.5) and rows["bubble"]["error"] is None
    points = compare(pred, {"bubble": 0.001})  # the bubble's error in points: a ratio to a bubble near 0 says nothing
    assert points["bubble"]["error"] == pytest.approx(pred.bubble - 0.001)
    assert rows["parameters_bytes"]["error"] == 0.0
    assert "activations" not in predict_run(dataclasses.replace(cfg, recompute="2"), CPU_DEFAULT).memory


ARGS = ["train", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--tp", "1", "--pp", "2", "--steps",
        "2", "--batch-size", "4", "--microbatches", "2", "--eval-every", "0", "--eval-batches", "1", "--no-progress"]


@pytest.mark.parametrize("source", ["cached", "none"])
def test_summary_and_metrics_carry_the_prediction(tmp_path, capsys, monkeypatch, source):
    """With this machine's profile in the cache the run is priced on it and says so; with none (the suite's
    MODELPAR_NO_CALIBRATE) memory is predicted and no step time is shown."""
    from modelpar.calibrate.cache import NO_CALIBRATE_ENV, cache_path
    from modelpar.cli import main
    from modelpar.costmodel.profiles import installed_torch, save_profile

    if source == "cached":  # as a first run's short calibration leaves it (its measuring: test_calibrate)
        cfg = TrainConfig(model=ModelConfig(layers=2, hidden=32, heads=2, seq_len=16), tp=1, pp=2, steps=2,
                          batch_size=4, microbatches=2).check()
        path = cache_path(cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_profile(dataclasses.replace(CPU_DEFAULT, name="this-machine", torch=installed_torch()), path)
        monkeypatch.delenv(NO_CALIBRATE_ENV)
    out = tmp_path / "run"
    assert main([*ARGS, "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "predicted / measured optimizer" in stdout
    assert ("predicted / measured step time" in stdout) == (source == "cached")
    summary = json.loads((out / "summary.json").read_text())["prediction"]
    assert ("(calibrated for this machine, cached)" in summary["source"]) == (source == "cached")
    assert summary["hardware"] == ("this-machine" if source == "cached" else None)
    for name in ("parameters_bytes", "gradients_bytes", "optimizer_bytes"):
        assert summary[name]["error"] == 0.0
    assert abs(summary["activations_bytes"]["error"]) <= 0.1
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "prediction" and last["step"] == 2 and last["optimizer_bytes_error"] == 0.0
    assert ("step_time_s_predicted" in last) == (source == "cached")
