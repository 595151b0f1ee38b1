"""Activation offload (``--offload-activations``): which layers, the hooks' gradients and bytes on one stage in
this process, the cost model's figures and ``--plan auto`` choosing it. Runs of the trainer:
tests/cluster/test_offload_runs.py; the summary line: tests/cli/test_offload_cli.py.
"""

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from modelpar.costmodel.local import offload_seconds, predict_local
from modelpar.costmodel.local_memory import activation_bytes, offloaded_bytes
from modelpar.costmodel.local_search import Capabilities, plan_local
from modelpar.costmodel.presets import CPU_DEFAULT, PROFILES
from modelpar.model import ModelConfig, build_stage
from modelpar.offload_plan import offload_layers, parse_offload
from modelpar.pipeline.split_backward import backward_input
from modelpar.recompute.meter import ActivationMeter
from modelpar.recompute.offload import HostOffload, apply_offload
from modelpar.training import TrainConfig
from modelpar.training.autoplan import auto_plan
from modelpar.training.prediction import local_run

TINY = ModelConfig(hidden=32, heads=4, layers=4, seq_len=16)
LLAMA = ModelConfig(arch="llama", hidden=32, heads=4, kv_heads=2, layers=4, seq_len=16)
BASE = TrainConfig(model=TINY, steps=3, batch_size=8, microbatches=2, precision="fp64", warmup=1, lr=1e-2, clip=0.5,
                   eval_every=0, eval_batches=1, tp=1, pp=1, dp=1)


# --- which layers: hand-checked, and the vocabulary's one-line errors ---------------------------------------------

def test_which_layers_by_hand():
    assert offload_layers(4, "none") == ()
    assert offload_layers(4, "all") == (0, 1, 2, 3)
    assert offload_layers(4, "1") == (0,)  # the first: held longest
    assert offload_layers(3, "5") == (0, 1, 2)  # a count beyond a short stage is all of it
    assert offload_layers(5, "every-2") == (1, 3)
    assert offload_layers(0, "all") == ()
    assert parse_offload(" Every-02 ") == "every-2" and parse_offload(None) == "none" and parse_offload("03") == "3"


@pytest.mark.parametrize("bad", ["some", "0", "every-0", "every-", "-1", "1.5"])
def test_bad_choice_is_one_line_naming_the_values(bad):
    with pytest.raises(ValueError, match=r"offload_activations must be none, all, n .* or every-k"):
        parse_offload(bad)
    with pytest.raises(ValueError, match="offload_activations must be"):
        dataclasses.replace(BASE, offload_activations=bad).check(1)


def test_offload_with_compile_is_refused_in_one_line():
    with pytest.raises(ValueError, match="offload_activations all with compile"):
        dataclasses.replace(BASE, offload_activations="all", compile=True).check(1)


@given(st.integers(0, 40), st.sampled_from(["all", "1", "3", "every-1", "every-3", "every-7", "none"]))
def test_choice_is_sorted_distinct_and_in_range(n, choice):
    got = offload_layers(n, choice)
    assert list(got) == sorted(set(got)) and all(0 <= i < n for i in got)


# --- the hooks: bitwise gradients, and the held bytes fall by exactly what went to the host --------------------

def _stage(model, recompute, offload):
    torch.manual_seed(0)
    stage = build_stage(model, recompute=recompute, dtype=torch.float64)
    store = HostOffload()
    chosen = apply_offload(stage, offload, store) if offload != "none" else []
    return stage, store, chosen


def _run(stage, ids, split, store=None):
    with ActivationMeter() as meter, store.passing(meter._pack, meter._unpack) if store else contextlib.nullcontext():
        out = stage(ids)
    held = meter.peak.bytes
    loss = out.square().mean()
    if split:  # the zero-bubble split: I now (here: nothing, the input is token ids), W later, the graph kept
        _, weight = backward_input(loss, None, None)
        weight()
    else:
        loss.backward()
    return held, [p.grad.clone() for p in stage.parameters()]


@pytest.mark.parametrize("model", [TINY, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full", 2])
@pytest.mark.parametrize("offload,split", [("all", False), ("1", True), ("every-2", False)])
def test_gradients_are_bitwise_and_held_falls_by_the_offloaded_bytes(model, recompute, offload, split):
    ids = torch.randint(0, model.vocab_size, (4, model.seq_len), generator=torch.Generator().manual_seed(1))
    plain, _, _ = _stage(model, recompute, "none")
    moved, store, chosen = _stage(model, recompute, offload)
    held_plain, grads_plain = _run(plain, ids, split)
    held, grads = _run(moved, ids, split, store)
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads))
    assert chosen == [str(i) for i in offload_layers(model.layers, offload)]
    reading = store.reading
    assert held_plain - held == reading.peak_bytes  # off the device exactly what is on the host
    assert reading.bytes == 0 and reading.copied_in == reading.copied_out  # all back, all released
    if recompute in ("none", "selective", "full"):  # the cost model's figure (k: not modelled, as without offload)
        run = local_run(dataclasses.replace(BASE, model=model, batch_size=4, microbatches=1, recompute=recompute,
                                            offload_activations=offload))
        assert reading.peak_bytes == offloaded_bytes(run, 0)
    if recompute in ("full", 2):  # the layers save nothing in the forward: nothing to move
        assert reading.peak_bytes == 0


# --- the cost model: bytes off the held activations, copy time on the step --------------------------------------

def test_cost_model_moves_the_chosen_layers_bytes_and_prices_the_copies():
    run = local_run(dataclasses.replace(BASE, offload_activations="none"))
    layer = activation_bytes(run, 0) - activation_bytes(dataclasses.replace(run, offload="1"), 0)
    for choice, n in (("1", 1), ("every-2", 2), ("all", 4)):
        moved = dataclasses.replace(run, offload=choice)
        assert offloaded_bytes(moved, 0) == n * layer
        assert activation_bytes(run, 0) - activation_bytes(moved, 0) == n * layer
        pred, plain = predict_local(moved, CPU_DEFAULT), predict_local(run, CPU_DEFAULT)
        assert pred.host_bytes == pred.peak_held * n * layer
        copy = n * layer / CPU_DEFAULT.host_bytes_per_s()  # a CPU: memcpy on the step, out in F and back in B
        assert offload_seconds(moved, CPU_DEFAULT, 0) == pytest.approx(copy)
        assert pred.step_time_s - plain.step_time_s == pytest.approx(2 * run.microbatches * copy, rel=1e-6)
    assert offloaded_bytes(dataclasses.replace(run, offload="all", recompute="full"), 0) == 0
    gpu = dataclasses.replace(run, offload="all")  # a GPU overlaps the copies with compute: at most what outlasts it
    assert PROFILES["h100-sxm"].host_bytes_per_s() == 50e9
    slower = predict_local(gpu, PROFILES["h100-sxm"]).step_time_s - predict_local(run, PROFILES["h100-sxm"]).step_time_s
    assert 0 <= slower <= 2 * run.microbatches * offload_seconds(gpu, PROFILES["h100-sxm"], 0) + 1e-12


def test_plan_auto_picks_offload_when_nothing_else_fits():
    cfg = dataclasses.replace(BASE, batch_size=4, microbatches=0)
    caps = Capabilities(offload=False)
    without = plan_local(local_run(cfg), 1, CPU_DEFAULT, 0.0, caps).leanest  # nothing fits 0 bytes: the leanest
    assert without is not None
    limit = without[1].memory_bytes - 1  # a byte below the leanest layout without offload: none of them fits
    assert not plan_local(local_run(cfg), 1, CPU_DEFAULT, limit, caps).ranked
    planned, pred, line = auto_plan(dataclasses.replace(cfg, memory_limit_gb=limit / 1e9, plan="auto"), 1)
    assert planned.offload_activations != "none" and pred.memory_bytes <= limit
    assert f"offload activations {planned.offload_activations}" in line
    roomy, _, _ = auto_plan(dataclasses.replace(cfg, plan="auto"), 1)  # memory is not the limit: no copies
    assert roomy.offload_activations == "none"


