"""The multi-process pipeline runtime on real gloo processes, float64, against one process.

One c4 of 4 ranks for the module. Pipeline groups are carved out of it with
``dist.new_group``: K = 4 uses every rank; K = 2 runs two pipelines at once on the groups
[0, 2] and [1, 3] (group ranks are not global ranks); K = 1 runs one per rank.
"""

import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from modelpar.pipeline import (
    PipelineRunner,
    measured_durations,
    measured_timeline,
    message_bytes,
    simulate_measured,
    split_stages,
)
from modelpar.schedules import Schedule, get_schedule, lower
from modelpar.simulate import simulate
from modelpar.simulate.ascii import ascii_chart

TOL = 1e-12
ROWS = 10  # not a multiple of most M: the last microbatches are smaller
WIDTHS = [5, 7, 6, 4, 8, 5, 6, 7, 3]  # 8 Linear+Tanh units whose widths change at every boundary
CASES = {  # schedule -> (K, M, v) where the schedule allows it
    "gpipe": [(k, m, 1) for k in (1, 2, 4) for m in (1, 2, 4, 8)],
    "1f1b": [(k, m, 1) for k in (1, 2, 4) for m in (1, 2, 4, 8)],
    "interleaved": [(k, m, 2) for k in (1, 2, 4) for m in (1, 2, 4, 8) if m % k == 0],
    "zb-h1": [(k, m, 1) for k in (1, 2, 4) for m in (1, 2, 4, 8)],
    "looped-bfs": [(k, m, 2) for k in (1, 2, 4) for m in (1, 3, 8)],
    "zb-h2": [(k, m, 1) for k in (1, 2, 4) for m in (1, 3, 8)],
    **{v: [(k, m, 2) for k in (1, 2, 4) for m in (1, 3, 8)] for v in ("zb-v", "v-half", "v-min")},  # V placements
    "dualpipe-v": [(k, m, 2) for k in (1, 2, 4) for m in (2 * k, 2 * k + 1, 8) if m <= 8],
}
_GROUPS: dict = {}


# --- helpers that run on the ranks -------------------------------------------------------------
def _group(k: int):
    """This rank's pipeline group of size k (created once per process, by every rank)."""
    if not _GROUPS:
        _GROUPS[4] = dist.group.WORLD
        _GROUPS[2] = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _GROUPS[1] = [dist.new_group([r]) for r in range(4)]
    rank = dist.get_rank()
    return {4: _GROUPS[4], 2: _GROUPS[2][rank % 2], 1: _GROUPS[1][rank]}[k]


def _model(widths=WIDTHS, seed=0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers).double()


def _batch(rows=ROWS, width_in=WIDTHS[0], width_out=WIDTHS[-1]):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(rows, width_in, generator=gen, dtype=torch.float64),
            torch.randn(rows, width_out, generator=gen, dtype=torch.float64))


def _compare(model, ref) -> tuple[float, int]:
    """Largest |grad difference| over this rank's parameters, and how many had a gradient."""
    err, count = 0.0, 0
    for p, q in zip(model.parameters(), ref.parameters()):
        if p.grad is not None:
            err, count = max(err, (p.grad - q.grad).abs().max().item()), count + 1
    return err, count


def _transparency(name, cases):
    """Every case: two SGD steps pipelined vs on one process; errors, losses, peaks per case."""
    out = []
    x, y = _batch()
    for k, m, v in cases:
        schedule = get_schedule(name, ranks=k, microbatches=m, chunks=v)
        group = _group(k)
        model, ref = _model(), _model()
        stages = split_stages(model, schedule, dist.get_rank(group), balance=[2 * 8 // (k * v)] * (k * v))
        runner = PipelineRunner(schedule, stages, F.mse_loss, group, timeout=30)
        opt = torch.optim.SGD(runner.parameters(), lr=0.5)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        case = {"case": (name, k, m, v), "grad_err": 0.0, "loss_err": 0.0, "owned": 0, "peak": [], "eval_err": 0.0}
        for _ in range(2):
            losses = runner.step(x, y)
            ref_loss = F.mse_loss(ref(x), y)
            ref_loss.backward()
            err, owned = _compare(model, ref)
            case["grad_err"] = max(case["grad_err"], err)
            case["owned"] = owned
            if losses:
                case["loss_err"] = max(case["loss_err"], abs(runner.last_loss.item() - ref_loss.item()))
                case["microbatch_losses"] = len(losses)
            case["peak"].append(runner.record.peak_held)
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
            val = runner.evaluate(x, y)  # the forward-only schedule, after the update
            if val is not None:
                with torch.no_grad():
                    case["eval_err"] = max(case["eval_err"], abs(val.item() - F.mse_loss(ref(x), y).item()))
            case["grads_untouched"] = all(p.grad is None or not p.grad.any() for p in runner.parameters())
        mine = {id(p) for p in runner.parameters()}
        case["param_err"] = max((p - q).abs().max().item()
                                for p, q in zip(model.parameters(), ref.parameters()) if id(p) in mine)
        case["device"] = dist.get_rank(group)
        out.append(case)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_transparency_two_steps_every_k_and_m(c4, name):
    per_rank = c4.run(_transparency, name, CASES[name])
    for rank, cases in enumerate(per_rank):
        for c in cases:
            _, k, m, v = c["case"]
            assert c["grad_err"] <= TOL, c
            assert c["loss_err"] <= TOL, c
            assert c["param_err"] <= TOL, c  # two optimizer steps later, still the same model
            assert c["eval_err"] <= TOL and c["grads_untouched"], c  # evaluation: same loss, no gradient
            assert c["owned"] == 2 * 8 // k  # every parameter this rank holds got a gradient
            schedule = get_schedule(name, ranks=k, microbatches=m, chunks=v)
            if schedule.rank_of(schedule.num_stages - 1) == c["device"]:
                assert c["microbatch_losses"] == m
            # held activations (F until B, or I when split), counted per chunk: the simulator's peak
            expected = simulate(schedule).peak_held[c["device"]] * schedule.chunks
            assert c["peak"] == [round(expected)] * 2, (rank, c)


def test_reference_peaks_one_f_one_b_and_gpipe(c4):
    """§4.1: 1F1B (K = 4, M = 8) holds [4, 3, 2, 1] microbatches per device; GPipe holds all 8."""
    per_rank = c4.run(_transparency, "1f1b", [(4, 8, 1)])
    assert [r[0]["peak"][0] for r in per_rank] == [4, 3, 2, 1]
    per_rank = c4.run(_transparency, "gpipe", [(4, 8, 1)])
    assert [r[0]["peak"][0] for r in per_rank] == [8, 8, 8, 8]


class _Embed(nn.Module):
    """Token ids -> vectors, flattening the sequence: (N, T) int64 -> (N, T·d) float64."""

    def __init__(self, vocab, d, seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, d).double()
        self.out = seq * d

    def forward(self, ids):
        return self.emb(ids).reshape(ids.shape[0], self.out)


def _token_model(seed=0):
    torch.manual_seed(seed)
    layers = [_Embed(11, 3, 4), nn.Linear(12, 9), nn.Tanh(), nn.Linear(9, 9), nn.GELU(),
              nn.Linear(9, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 5),
              nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 11), nn.LogSoftmax(dim=-1)]
    return nn.Sequential(*layers).double()


def _uneven_tokens(name, balance, recompute, microbatches=6):
    """Uneven stages, integer token ids in, NLL loss out; returns errors, peak, and the timeline."""
    schedule = get_schedule(name, ranks=4, microbatches=microbatches)
    model, ref = _token_model(), _token_model()
    stages = split_stages(model, schedule, dist.get_rank(), balance=balance, recompute=recompute)
    runner = PipelineRunner(schedule, stages, F.nll_loss, dist.group.WORLD, timeout=30)
    gen = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, 11, (9, 4), generator=gen), torch.randint(0, 11, (9,), generator=gen)
    runner.step(ids, targets)
    ref_loss = F.nll_loss(ref(ids), targets)
    ref_loss.backward()
    err, owned = _compare(model, ref)
    timeline = measured_timeline(runner)
    loss_err = abs(runner.last_loss.item() - ref_loss.item()) if runner.last_loss is not None else 0.0
    return {"err": err, "owned": owned, "loss_err": loss_err, "timeline": timeline, "bytes": message_bytes(runner)}


@pytest.mark.parametrize("name,recompute", [("1f1b", None), ("zb-h1", None), ("1f1b", "full"), ("zb-h1", "sqrt")])
def test_uneven_stages_token_ids_and_recompute(c4, name, recompute):
    balance = [1, 2, 5, 8]  # layers per stage; 9 rows in 6 microbatches: sizes 2, 2, 2, 1, 1, 1
    per_rank = c4.run(_uneven_tokens, name, balance, recompute)
    owned = [sum(1 for layer in list(_token_model())[sum(balance[:d]):sum(balance[:d + 1])]
                 for _ in layer.parameters()) for d in range(4)]
    for d, r in enumerate(per_rank):
        assert r["err"] <= TOL and r["loss_err"] <= TOL, (d, r["err"], r["loss_err"])
        assert r["owned"] == owned[d]
    # the gathered timeline: every device ran exactly its actions, in the schedule's order, one at a time
    tl, schedule = per_rank[0]["timeline"], get_schedule(name, ranks=4, microbatches=6)
    assert tl.actions == [list(a) for a in schedule.actions]
    for starts, ends in zip(tl.starts, tl.ends):
        assert all(s <= e for s, e in zip(starts, ends))
        assert all(e <= s2 for e, s2 in zip(ends, starts[1:]))
    # causality across devices: an action starts only after what it needs has ended
    end = {a: e for d in range(4) for a, e in zip(tl.actions[d], tl.ends[d])}
    start = {a: s for d in range(4) for a, s in zip(tl.actions[d], tl.starts[d])}
    late = [(str(dep), str(a), end[dep] - start[a]) for a in start for dep in schedule.dependencies(a)
            if end[dep] > start[a]]
    assert not late
    predicted = simulate_measured(schedule, measured_durations([tl]))
    assert predicted.actions == tl.actions and 0 < predicted.step_time <= tl.step_time * (1 + 1e-9)
    # one message into stage s: stage s - 1's output (widths 12, 9, 8), float64, 9 rows in 6 microbatches
    assert per_rank[0]["bytes"] == [0.0, 12 * 8 * 1.5, 9 * 8 * 1.5, 8 * 8 * 1.5]
    assert len(ascii_chart(tl, unit=tl.step_time / 50).splitlines()) == 4


@pytest.mark.parametrize("name,recompute,m", [("zb-v", "full", 6), ("v-half", "sqrt", 5), ("v-min", None, 7),
                                               ("dualpipe-v", "full", 8), ("zb-h2", "sqrt", 6)])
def test_v_shapes_uneven_stages_and_recompute(c4, name, recompute, m):
    """V placements (both ends of the model on device 0), uneven layer counts, 9 rows in m microbatches."""
    schedule = get_schedule(name, ranks=4, microbatches=m)
    balance = [1, 1, 2, 2, 2, 2, 3, 3] if schedule.num_stages == 8 else [1, 2, 5, 8]
    per_rank = c4.run(_uneven_tokens, name, balance, recompute, m)
    model = list(_token_model())
    for d, r in enumerate(per_rank):
        assert r["err"] <= TOL and r["loss_err"] <= TOL, (d, r["err"], r["loss_err"])
        bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
        owned = sum(1 for s in schedule.stages_on(d) for layer in model[bounds[s]:bounds[s + 1]]
                    for _ in layer.parameters())
        assert r["owned"] == owned
    assert per_rank[0]["timeline"].actions == [list(a) for a in schedule.actions]


V_SCHEDULE = """
device 0: 0F0 0F1 0F2 3F0 3F1 3B0 3F2 3B1 0B0 3B2 0B1 0B2
device 1: 1F0 1F1 2F0 1F2 2F1 2B0 2F2 1B0 2B1 1B1 2B2 1B2
"""  # hand-written, V placement: device 0 holds stages 0 and 3, device 1 holds 1 and 2


def _hand_written_v(schedule_text):
    """Both ends of the model on device 0, a same-device hand-over (1 -> 2) on device 1."""
    schedule = Schedule.from_text(schedule_text, name="v")
    group = _group(2)
    model, ref = _model(), _model()
    stages = split_stages(model, schedule, dist.get_rank(group))
    runner = PipelineRunner(schedule, stages, F.mse_loss, group, timeout=30)
    x, y = _batch()
    losses = runner.step(x, y)
    F.mse_loss(ref(x), y).backward()
    return _compare(model, ref), len(losses), runner.record.peak_held


def test_hand_written_v_schedule(c4):
    schedule = Schedule.from_text(V_SCHEDULE).validate()
    assert schedule.stage_to_rank == (0, 1, 1, 0)
    per_rank = c4.run(_hand_written_v, V_SCHEDULE)
    for rank, ((err, owned), n_losses, peak) in enumerate(per_rank):
        device = rank // 2  # groups [0, 2] and [1, 3]
        assert err <= TOL and owned == 8
        assert n_losses == (3 if device == 0 else 0)  # the last stage lives on device 0
        assert peak == simulate(schedule).peak_held[device] * schedule.chunks


# --- bad input: the same clear error on every rank, before anything is sent -------------------
def _error_on_every_rank(case):
    try:
        schedule = get_schedule("1f1b", ranks=4, microbatches=4)
        model, x, y = _model(), *_batch()
        if case == "hang":  # valid on each device, but devices 0 and 1 wait on each other
            schedule = Schedule.from_text("0F0 0B0 0F1 0B1\n" + "\n".join(f"{d}F0 {d}F1 {d}B0 {d}B1" for d in (1, 2, 3)))
        if case == "stage count":
            schedule = get_schedule("1f1b", ranks=3, microbatches=4)
        if case == "split":
            model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        stages = split_stages(model, schedule, dist.get_rank() % schedule.num_ranks)
        if case == "shapes" and 1 in stages:
            stages[1] = nn.Sequential(nn.Linear(9, 4), nn.Tanh()).double()  # stage 0 sends width 6
        runner = PipelineRunner(schedule, stages, F.mse_loss, dist.group.WORLD, timeout=30)
        if case == "rows":
            x, y = x[:3], y[:3]
        if case == "no inputs":
            x = None
        runner.step(x, y)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("case,message", [
    ("hang", r"cannot lower schedule: it would hang: rank 0 waits at 0RECV_B0 \(the input of 0B0\), but rank 1 "
             r"never reaches 1SEND_B0; rank 1 waits at 1RECV_F1 \(the input of 1F1\), but rank 0 never reaches "
             r"0SEND_F1"),
    ("stage count", r"schedule 1f1b has 3 devices but the pipeline group has 4 processes"),
    ("split", r"model has 3 layers and cannot be split into 4 stages"),
    ("rows", r"inputs has 3 rows \(dim 0\) but the schedule has 4 microbatches"),
    ("no inputs", r"inputs must be a tensor on rank 0, which runs its stage, got None"),
    ("shapes", r"stage 1 \(rank 1\) cannot run on the output of stage 0 \(shape \(2, 6\), torch.float64\)"
               r".*mat1 and mat2 shapes cannot be multiplied"),
])
def test_bad_input_same_error_on_every_rank(c4, case, message):
    errors = c4.run(_error_on_every_rank, case)
    assert len(set(errors)) == 1, errors
    assert errors[0] != "no error"
    import re

    assert re.search(message, errors[0]), errors[0]


# --- messages checked, collectives bounded by the timeout --------------------------------------
LONG = 120.0  # seconds: the timeout of every wait that will be answered, however loaded the machine


def _warmed_up(runner: PipelineRunner, timeout: float | None) -> PipelineRunner:
    """``runner`` past its first-step exchanges (batch shapes, dry run, clock, first messages), all run under
    ``LONG`` by a forward-only pass; then, with ``timeout``, only the faulty step's own waits are bounded by it,
    so the wait that times out is the one that can never be answered, not one a slow peer was late for."""
    runner.evaluate(*_batch())
    if timeout is not None:
        runner.timeout = runner.p2p.timeout = timeout
    runner.recorder.done.clear()  # the operations the timeout names are the faulty step's
    return runner


def _swapped_receives_and_a_missing_rank():
    """Two faults, each on its own new group, each ending every rank within a 1 s timeout."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[dist.get_rank() // 2]
    schedule = get_schedule("1f1b", ranks=2, microbatches=2)
    runner = PipelineRunner(schedule, split_stages(_model(), schedule, dist.get_rank(group)), F.mse_loss, group,
                            timeout=LONG)
    # device 1 finds the fault in the message itself: its waits keep LONG; device 0's gradient never comes
    runner = _warmed_up(runner, 1 if dist.get_rank(group) == 0 else None)
    if dist.get_rank(group) == 1:  # post the first two receives in the wrong order (same shapes)
        program = list(runner.programs[1])
        assert [str(op) for op in program[:2]] == ["1RECV_F0", "1RECV_F1"]
        program[:2] = program[1::-1]
        runner.programs = (runner.programs[0], tuple(program))
    out = {}
    try:
        runner.step(*_batch())
    except (RuntimeError, TimeoutError) as err:
        out["swapped"] = f"{type(err).__name__}: {err}"
    group = dist.new_group([0, 1, 2, 3])
    if dist.get_rank() != 3:  # rank 3 never calls step: the others time out in the batch exchange, their first wait
        runner = PipelineRunner(get_schedule("gpipe", ranks=4, microbatches=2), split_stages(
            _model(), get_schedule("gpipe", ranks=4, microbatches=2), dist.get_rank(group)), F.mse_loss, group,
            timeout=1)
        start = time.monotonic()
        try:
            runner.step(*_batch())
        except TimeoutError as err:
            out["missing"] = (str(err), time.monotonic() - start)
    return out


def test_message_check_and_collective_timeout_name_the_fault(c4):
    results = c4.run(_swapped_receives_and_a_missing_rank)
    for rank in (1, 3):  # device 1 of each pair: the first receive it waits on holds the other microbatch
        assert results[rank]["swapped"] == (  # messages #0-#2: the first contact and the warm-up's two activations
            f"RuntimeError: rank {rank} (pipeline device 1) received message #3, the activation of microbatch 1 "
            f"from stage 0 from rank {rank - 1} (pipeline device 0) where it expected message #3, the activation of "
            f"microbatch 0 from stage 0 (1RECV_F0 (the activation of microbatch 0 from stage 0)): the two ends' "
            f"programs post this pair's messages in different orders")
    for rank in (0, 2):  # device 0 waits for a gradient that never comes
        assert results[rank]["swapped"].startswith(
            f"TimeoutError: rank {rank} (pipeline device 0) waited 1 s for 0RECV_B0 (the gradient of microbatch 0 "
            f"from stage 1) from rank {rank + 1}; the last operations it issued: 0F0, 0SEND_F0, 0F1, 0SEND_F1, "
            f"0RECV_B0, 0RECV_B1")
    for rank in (0, 1, 2):
        message, elapsed = results[rank]["missing"]
        assert message.startswith(f"rank {rank} (pipeline device {rank}) waited 1 s for the batch shapes (an "
                                  f"all-reduce over the pipeline group); the last operations it issued: nothing yet")
        assert 1 <= elapsed < LONG  # the timeout ended it: not before 1 s, and long before the c4's limit


# --- a stage that raises: every rank ends, the caller sees the original error ------------------
def _raise_on_rank_1(catch):
    schedule = get_schedule("1f1b", ranks=4, microbatches=4)
    stages = split_stages(_model(), schedule, dist.get_rank())
    if 1 in stages:
        stages[1] = _BoomLater(stages[1])
    runner = PipelineRunner(schedule, stages, F.mse_loss, dist.group.WORLD, timeout=LONG)
    # rank 1 raises, so it waits for nothing lost; uncaught, the caller gets the first error, so the others
    # keep LONG and rank 1's is the only one there can be
    runner = _warmed_up(runner, 2 if catch and dist.get_rank() != 1 else None)
    start = time.monotonic()
    try:
        runner.step(*_batch())
    except Exception as err:
        if not catch:
            raise
        failed = type(err).__name__, str(err), "\n".join(getattr(err, "__notes__", [])), time.monotonic() - start
    else:
        return "no error", "", "", time.monotonic() - start, "", ""
    try:  # the runner refuses another step: a message of the failed one could meet it
        runner.step(*_batch())
    except RuntimeError as err:
        again = str(err)
    return (*failed, again, "")


class _BoomLater(nn.Module):
    """Passes the dry run, then fails on the third real microbatch."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 3:
                raise KeyError("boom in stage 1")
        return self.inner(x)


def test_failing_stage_every_rank_ends_within_the_timeout(c4):
    results = c4.run(_raise_on_rank_1, True)
    c4.close()  # the timed-out receives broke the gloo pairs: the next run starts fresh ranks
    kind, message, notes, elapsed, _, _ = results[1]
    assert kind == "KeyError" and "boom in stage 1" in message
    assert "while running 1F2 on rank 1 (pipeline device 1)" in notes
    for rank in (0, 2, 3):
        kind, message, _, elapsed, _, _ = results[rank]
        assert kind == "TimeoutError", results[rank]
        assert f"rank {rank} (pipeline device {rank}) waited 2 s for " in message
        assert "the last operations it issued: " in message
        assert 2 <= elapsed < LONG
    # rank 2 names the receive it waited on — 2RECV_F2 normally; an earlier one if rank 1's last
    # sends were still in flight when it failed, or if rank 1 was slower than the timeout on a loaded
    # machine — and the last 8 operations of its program it had issued before that forward
    found = re.search(r"waited 2 s for 2RECV_F([0-2]) \(the activation of microbatch \1 from stage 1\) from rank 1; "
                      r"the last operations it issued: (.*)\. The peer", results[2][1])
    assert found, results[2][1]
    program = [str(op) for op in lower(get_schedule("1f1b", ranks=4, microbatches=4))[2]]
    before = program[:program.index(f"2F{found[1]}")]
    assert found[2] == ", ".join(before[-8:]), results[2][1]
    for rank, result in enumerate(results):
        assert result[4].startswith("a step of this PipelineRunner failed (") and "build a new process group" in result[4]


def test_failing_stage_reaches_the_caller_with_its_rank(c4):
    with pytest.raises(KeyError, match=r"\[rank 1\] 'boom in stage 1'") as info:
        c4.run(_raise_on_rank_1, False)
    assert info.value.rank == 1
