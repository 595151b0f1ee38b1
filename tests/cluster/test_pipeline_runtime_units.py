"""The runtime's pieces in one process: split backward, stages, microbatch sizes, the one-process
runner (group None) and its hooks, prediction, CLI."""

import json
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from modelpar.cli import main
from modelpar.pipeline import LocalStage, PipelineRunner, measured_durations, simulate_measured, split_stages
from modelpar.pipeline.measure import measured_timeline, message_delays
from modelpar.pipeline.shapes import microbatch_sizes
from modelpar.pipeline.split_backward import backward_input
from modelpar.schedules import Action, Kind, get_schedule, on_one_rank
from modelpar.simulate import Costs, Event, Timeline, pipeline_speedup, simulate

pytestmark = pytest.mark.numerics  # float64 against one process at 1e-15


def _mlp(widths, seed, tie=False):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    model = nn.Sequential(*layers).double()
    if tie:  # one weight used by two layers: its gradient must not be counted twice
        model[2].weight = model[0].weight
    return model


def _split_vs_full(model, x_needs_grad, rows=5, seed=0):
    """Gradients from I then W vs one full backward: (max error, whether W ran after I)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, model[0].in_features, generator=gen, dtype=torch.float64, requires_grad=x_needs_grad)
    out = model(x)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    params = list(model.parameters())
    ref = torch.autograd.grad(out, ([x] if x_needs_grad else []) + params, g)
    out = model(x)
    gx, weight = backward_input(out, g, x if x_needs_grad else None)
    untouched = all(p.grad is None for p in params)  # I computed no weight gradient
    weight()
    got = ([gx] if x_needs_grad else []) + [p.grad for p in params]
    return max((a - b).abs().max().item() for a, b in zip(ref, got)), untouched


@settings(max_examples=25, deadline=None)
@given(widths=st.lists(st.integers(1, 6), min_size=2, max_size=5), x_needs_grad=st.booleans(),
       seed=st.integers(0, 10))
def test_split_backward_equals_full_backward(widths, x_needs_grad, seed):
    err, untouched = _split_vs_full(_mlp(widths, seed), x_needs_grad, seed=seed)
    assert err == 0.0  # the same products in the same order: bitwise equal
    assert untouched


def test_split_backward_tied_weight_counted_once():
    err, _ = _split_vs_full(_mlp([4, 4, 4, 3], 0, tie=True), True)
    assert err < 1e-15


def test_split_backward_defers_the_weight_products():
    """I runs the input-gradient products only; the weight gradient appears only after W."""
    model = _mlp([3, 4, 2], 0)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    out = model(x)
    gx, weight = backward_input(out, torch.ones_like(out), x)
    assert gx.shape == x.shape and model[0].weight.grad is None and x.grad is None
    weight()
    assert model[0].weight.grad is not None and model[2].bias.grad is not None


def test_stage_forward_backward_scales_the_loss_and_holds_microbatches():
    torch.manual_seed(0)
    module = nn.Linear(3, 1).double()
    stage = LocalStage(1, module, num_stages=2, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    x, t = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)
    loss = stage.forward(0, x, t, scale=0.25)
    assert stage.held == 1 and not loss.requires_grad
    gx = stage.backward(0, None)
    assert stage.held == 0
    ref = nn.Linear(3, 1).double()
    ref.load_state_dict(module.state_dict())
    xr = x.clone().requires_grad_()
    (((ref(xr) - t) ** 2).mean() * 0.25).backward()
    assert torch.equal(module.weight.grad, ref.weight.grad) and torch.equal(gx, xr.grad)


@given(rows=st.integers(1, 200), m=st.integers(1, 50))
def test_microbatch_sizes_match_tensor_split(rows, m):
    if m > rows:
        return
    sizes = microbatch_sizes(rows, m)
    assert sizes == [len(c) for c in torch.tensor_split(torch.empty(rows), m)]
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_one_process_runner_equals_the_plain_model(name):
    """group None: a schedule's work on one device, in the simulator's order, through the real runtime."""
    schedule = on_one_rank(get_schedule(name, ranks=2, microbatches=4, chunks=2 if name == "interleaved" else 1))
    model, ref = _mlp([3, 5, 4, 6, 2], 0), _mlp([3, 5, 4, 6, 2], 0)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, 3, generator=gen, dtype=torch.float64), torch.randn(7, 2, generator=gen, dtype=torch.float64)
    runner = PipelineRunner(schedule, split_stages(model, schedule, 0), torch.nn.functional.mse_loss, None)
    seen = []

    @contextmanager
    def hook(action, last_backward):
        seen.append((str(action), last_backward, "before"))
        yield
        seen.append((str(action), last_backward, "after"))

    handle = runner.register_action_hook(hook)
    losses = runner.step(x, y)
    ref_loss = torch.nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    assert len(losses) == 4 and abs(runner.last_loss.item() - ref_loss.item()) < 1e-15
    assert max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) < 1e-15
    actions = [str(a) for a in schedule.actions[0]]
    assert [a for a, _, when in seen if when == "before"] == actions == [a for a, _, when in seen if when == "after"]
    weight = "W" if name == "zb-h1" else "B"
    finals = [a for a, last, when in seen if last and when == "after"]
    assert finals == [a for i, a in enumerate(actions)  # each stage's last weight-gradient action, once
                      if a[1:-1] == weight and not any(b[1:-1] == weight and b[0] == a[0] for b in actions[i + 1:])]
    assert len(finals) == schedule.num_stages
    handle.remove()
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(ref(x), y).item()
    assert abs(runner.evaluate(x, y).item() - expected) < 1e-15 and len(seen) == 2 * len(actions)


def test_one_process_runner_needs_a_one_device_schedule():
    schedule = get_schedule("1f1b", ranks=2, microbatches=2)
    with pytest.raises(ValueError, match=r"group None runs a one-device schedule in this process, but schedule "
                                         r"'1f1b' has 2 devices: pass the pipeline process group"):
        PipelineRunner(schedule, {0: nn.Linear(2, 2)}, torch.nn.functional.mse_loss, None)


def test_split_stages_even_and_interleaved_placement():
    model = _mlp([2] * 9, 0)  # 16 layers
    schedule = get_schedule("interleaved", ranks=2, microbatches=4, chunks=2)
    stages = split_stages(model, schedule, 1)
    assert sorted(stages) == [1, 3] and all(len(m) == 4 for m in stages.values())
    assert stages[1][0] is model[4] and stages[3][0] is model[12]
    uneven = split_stages(_mlp([2] * 6, 0), schedule, 0)  # 10 layers: the planner's 2, 3, 3, 2
    assert [len(m) for m in uneven.values()] == [2, 3]
    with pytest.raises(ValueError, match=r"balance must give a layer count for each of the 4 stages"):
        split_stages(model, schedule, 0, balance=[8, 8])
    with pytest.raises(ValueError, match=r"balance must add up to the number of layers \(16\)"):
        split_stages(model, schedule, 0, balance=[4, 4, 4, 5])
    with pytest.raises(ValueError, match=r"model must be an nn.Sequential.*got Linear"):
        split_stages(nn.Linear(2, 2), schedule, 0)


def test_prediction_from_measured_costs_reproduces_the_simulator():
    """Fed the durations of a simulated 1F1B run (F = 1, B = 2), simulate_measured redraws the reference's 33 units."""
    schedule = get_schedule("1f1b", ranks=4, microbatches=8)
    sim = simulate(schedule, Costs())
    measured = Timeline.from_events(sim.events, 4, schedule)
    durations = measured_durations([measured])
    assert durations[Kind.F] == [1.0] * 4 and durations[Kind.B] == [2.0] * 4
    predicted = simulate_measured(schedule, durations)
    assert predicted.step_time == 33 and round(predicted.bubble, 3) == 0.273  # §4.1: 33 units, 27.3 %
    gpipe = get_schedule("gpipe", ranks=4, microbatches=8)
    with_transfer = simulate_measured(gpipe, durations, [0.0, 0.5, 0.5, 0.5])  # one message: 0.5 units
    assert with_transfer.step_time == 36 == 3 * 4 * 8 / pipeline_speedup(stages=4, microbatches=8, comm=0.5)
    shifted = Timeline.from_events([Event(e.rank, e.action, e.start + 7.5, e.end + 7.5) for e in sim.events], 4, schedule)
    assert shifted.step_time == 33  # measured clocks start anywhere


def test_message_delays_are_read_off_waiting_receivers_only():
    """GPipe K = 2, M = 2 by hand: device 1 waits 0.25 for each activation, device 0 waits 0.5 for
    the first gradient; the second gradient arrives while device 0 is busy, so it says nothing."""
    schedule = get_schedule("gpipe", ranks=2, microbatches=2)
    F0, F1, B0, B1 = (Action(s, k, m) for s, k, m in ((0, Kind.F, 0), (0, Kind.F, 1), (0, Kind.B, 0), (0, Kind.B, 1)))
    events = [Event(0, F0, 0, 1), Event(0, F1, 1, 2),  # device 0: F0 F1 ... B1 B0
              Event(0, B1, 5.5, 7.5), Event(0, B0, 7.5, 9.5),
              Event(1, Action(1, Kind.F, 0), 1.25, 2.25), Event(1, Action(1, Kind.F, 1), 2.25, 3.25),
              Event(1, Action(1, Kind.B, 1), 3.25, 5.0), Event(1, Action(1, Kind.B, 0), 5.0, 7.0)]
    tl = Timeline.from_events(events, 2, schedule, unit="s")
    # activations into stage 1: 1.25 - 1 (waited) and 2.25 - 2 (busy with F0 until 2.25: not counted);
    # gradients into stage 0: 5.5 - 5.0 (waited), B0's 7.0 arrived while B1 ran (not counted)
    assert message_delays([tl]) == [0.0, (0.25 + 0.5) / 2]


def test_cli_bad_arguments_exit_2_before_starting_processes(capsys):
    assert main(["bench", "pipeline", "--schedule", "1f1b", "--chunks", "2"]) == 2
    assert "chunks must be 1 for schedule '1f1b'" in capsys.readouterr().err
    assert main(["bench", "pipeline", "--schedule", "bogus"]) == 2
    assert "schedule must be one of" in capsys.readouterr().err
    assert main(["bench", "pipeline", "--rows", "3", "--microbatches", "4"]) == 2
    assert "rows must be >= 4, got 3" in capsys.readouterr().err


def test_cli_json_runs_two_processes(capsys):
    args = ["bench", "pipeline", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4", "--steps", "2",
            "--width", "8", "--rows", "8", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_peak_held"] == out["simulated_peak_held"] == [2, 1]
    for kind in ("measured", "simulated"):  # two stages: each device idles while the other fills or drains
        assert out[f"{kind}_step_s"] > 0 and 0 < out[f"{kind}_bubble"] < 1
    assert 0 <= out["simulated_bubble"] < 1 and 0 <= out["measured_bubble"] < 1


@pytest.mark.parametrize("merge", [True, False])
def test_an_input_backward_right_before_its_weight_backward_runs_as_one(monkeypatch, merge):
    """torch's _merge_bw on the lowered program: I directly followed by its W is one full backward
    (one autograd call); an I whose W comes later stays split. Same gradients either way."""
    from modelpar.pipeline.stage import LocalStage
    from modelpar.schedules import Schedule

    calls = []
    for method in ("backward", "backward_input", "backward_weight"):
        original = getattr(LocalStage, method)

        def counted(self, *args, _original=original, _name=method):
            calls.append((_name, self.index, args[0]))
            return _original(self, *args)

        monkeypatch.setattr(LocalStage, method, counted)
    schedule = Schedule.from_text("0F0 1F0 1I0 1W0 0F1 1F1 1I1 0I0 0W0 1W1 0I1 0W1")  # one device, two stages
    model, ref = _mlp([3, 5, 4, 2], 0), _mlp([3, 5, 4, 2], 0)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = torch.randn(4, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    runner = PipelineRunner(schedule, split_stages(model, schedule, 0, balance=[2, 4]),
                            torch.nn.functional.mse_loss, None, merge_backward=merge)
    runner.step(x, y)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    assert max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) < 1e-15
    if merge:  # 1I0 1W0, 0I0 0W0, 0I1 0W1 adjacent; 1I1 waits for its W behind 0I0 0W0
        assert calls == [("backward", 1, 0), ("backward_input", 1, 1), ("backward", 0, 0),
                         ("backward_weight", 1, 1), ("backward", 0, 1)]
    else:
        assert calls == [("backward_input", 1, 0), ("backward_weight", 1, 0), ("backward_input", 1, 1),
                         ("backward_input", 0, 0), ("backward_weight", 0, 0), ("backward_weight", 1, 1),
                         ("backward_input", 0, 1), ("backward_weight", 0, 1)]
    tl = measured_timeline(runner)
    assert tl.actions == [list(schedule.actions[0])]  # the schedule's actions, merged or not
