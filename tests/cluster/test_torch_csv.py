"""torch's schedule CSV both ways: the text, bad input, and real runs on gloo (float64).

Our schedules (a synthesised one too), written as CSV, loaded by torch's ``_PipelineScheduleRuntime._load_csv`` and run
by torch give the gradients our runtime gives; torch's own ZB-V and DualPipe-V, dumped by
torch's ``_dump_csv`` and read back, validate and run in ``modelpar`` with the single process's
gradients. (``_PipelineScheduleRuntime``, ``_Action``, ``_load_csv``, ``_dump_csv`` are private
torch names: used here only, there is no ``modelpar/_compat.py`` in this branch.)
"""

import csv
import io
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import schedules as torch_schedules

from modelpar.bench.pipeline import torch_schedule_step
from modelpar.pipeline import PipelineRunner, split_stages
from modelpar.schedules import DeadlockError, get_schedule, schedule_names
from modelpar.schedules.registry import schedule_entry
from modelpar.schedules.torch_csv import from_csv, to_csv
from modelpar.simulate.synthesis import StageCosts, synthesize

TOL = 1e-12
WIDTHS = [5, 7, 6, 4, 8, 5, 6, 7, 3]


def _all(k, m):
    return [get_schedule(n, ranks=k, microbatches=m, chunks=schedule_entry(n).default_chunks)
            for n in schedule_names() if schedule_entry(n).microbatches.allows(m, k, schedule_entry(n).default_chunks)]


@pytest.mark.parametrize("k, m", [(1, 3), (2, 4), (3, 6), (4, 8)])
def test_round_trip_and_torch_parses_every_cell(k, m):
    for s in _all(k, m):
        text = to_csv(s)
        back = from_csv(text)
        assert back.actions == s.actions and back.stage_to_rank == s.stage_to_rank
        comm = to_csv(s, comm=True)
        assert from_csv(comm).actions == s.actions  # sends and receives are dropped, then derived again
        seen: list = []
        for row in csv.reader(io.StringIO(comm)):
            assert sum(cell.endswith("REDUCE_GRAD") for cell in row) == len(s.stages_on(len(seen)))
            seen.append(row)
            for cell in row:
                assert str(torch_schedules._Action.from_str(cell)) == cell


def test_reads_what_torchs_dualpipe_v_writes():
    """Overlapped pairs, full backwards among split ones, idle cells: as torch's class writes them."""
    from types import SimpleNamespace

    fake = SimpleNamespace(pp_group_size=2, num_stages=4, _num_stages=4, _n_microbatches=5, _stages=[None, None])
    out = io.StringIO()
    writer = csv.writer(out)
    for rank in range(2):
        writer.writerow([None] + torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(fake, rank) + [None])
    text = out.getvalue()
    assert "OVERLAP_F_B" in text and text.startswith(",")
    ours = get_schedule("dualpipe-v", ranks=2, microbatches=5)
    assert from_csv(text).actions == ours.actions
    assert from_csv(text).overlapped == ours.overlapped  # the pairs where torch writes OVERLAP_F_B
    assert from_csv(to_csv(ours), "dualpipe-v") == ours
    assert to_csv(ours).count("OVERLAP_F_B") == text.count("OVERLAP_F_B")


@pytest.mark.parametrize("text, error, match", [
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", ValueError, r"action 0B1 is missing \(rank 0\)"),
    ("0F0,0B0\n0F1,1F0,1B0\n", ValueError, r"stage 0 appears on rank 0 and rank 1 \(action 0F1\)"),
    ("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n", DeadlockError, r"deadlock: rank 0 waits at 0B0 \(position 1\)"),
    ("0F0,0Z0\n", ValueError, r"CSV row 0 \(rank 0\), column 1: '0Z0' is not an action"),
    ("0F0,0B\n", ValueError, r"column 1: '0B' is not an action"),
])
def test_bad_csv_is_refused_naming_the_first_bad_action(text, error, match):
    with pytest.raises(error, match=match) as info:
        from_csv(text, name="bad").validate()
    assert "\n" not in str(info.value)


# --- real runs, 2 gloo ranks -------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers).double()


def _batch(rows=8):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(rows, WIDTHS[0], generator=gen, dtype=torch.float64),
            torch.randn(rows, WIDTHS[-1], generator=gen, dtype=torch.float64))


def _torch_step(tsched, schedule, rank, x, y):
    torch_schedule_step(tsched, rank == schedule.rank_of(0), rank == schedule.rank_of(schedule.num_stages - 1), x, y)


def _grad_diff(a, b):
    """Largest |difference| over the parameters ``a`` holds gradients for (this rank's); each needs one."""
    mine = [(p, q) for p, q in zip(a.parameters(), b.parameters()) if p.grad is not None]
    assert mine and all(q.grad is not None for _, q in mine)
    return max((p.grad - q.grad).abs().max().item() for p, q in mine)


def _torch_runs_our_csv(text, fmt, m):
    """torch loads our CSV and runs it; ours runs the same schedule; both against one process."""
    rank = dist.get_rank()
    schedule = from_csv(text)
    x, y = _batch()
    ref = _model()
    F.mse_loss(ref(x), y).backward()
    ours_model, theirs_model = _model(), _model()
    runner = PipelineRunner(schedule, split_stages(ours_model, schedule, rank), F.mse_loss, dist.group.WORLD,
                            timeout=30)
    runner.step(x, y)
    modules = split_stages(theirs_model, schedule, rank)
    stages = [pipelining.PipelineStage(mod, s, schedule.num_stages, torch.device("cpu"))
              for s, mod in sorted(modules.items())]
    tsched = torch_schedules._PipelineScheduleRuntime(stages, m, loss_fn=F.mse_loss)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "schedule.csv")
        with open(path, "w") as f:
            f.write(text)
        tsched._load_csv(path, format=fmt)
    _torch_step(tsched, schedule, rank, x, y)
    owned = sum(p.grad is not None for p in ours_model.parameters())
    assert owned == sum(p.grad is not None for p in theirs_model.parameters()) == 8  # half of 16, per rank
    return _grad_diff(ours_model, theirs_model), _grad_diff(theirs_model, ref)


@pytest.mark.parametrize("name", ["auto", "zb-v", "v-min", "dualpipe-v", "zb-h2", "interleaved"])
@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_torch_runs_our_export_with_our_gradients(c2, name, fmt):
    m = 4
    if name == "auto":  # synthesised for I = 3 W, at most 1.5 microbatches held (until W): a V order of the list
        schedule, _ = synthesize(2, m, StageCosts.uniform(2, 1, 1.5, 0.5), 1.5)  # scheduler (at 2, ZB-V wins)
        assert schedule.name == "auto" and schedule.stage_to_rank == (0, 1, 1, 0)
    else:
        schedule = get_schedule(name, ranks=2, microbatches=m, chunks=schedule_entry(name).default_chunks)
    text = to_csv(schedule, comm=fmt == "compute_comms")
    for ours_vs_torch, torch_vs_one in c2.run(_torch_runs_our_csv, text, fmt, m):
        assert ours_vs_torch <= TOL and torch_vs_one <= TOL


def _we_run_torchs(cls_name, m):
    """torch builds its schedule and dumps the CSV; we read it, validate it and run it."""
    rank = dist.get_rank()
    placement = get_schedule("zb-v", ranks=2, microbatches=m)  # the V the torch classes use
    modules = split_stages(_model(), placement, rank)
    stages = [pipelining.PipelineStage(mod, s, 4, torch.device("cpu")) for s, mod in sorted(modules.items())]
    tsched = getattr(pipelining, cls_name)(stages, m, loss_fn=F.mse_loss)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "torch.csv")
        tsched._dump_csv(path, format="compute_only")
        with open(path) as f:
            text = f.read()
    schedule = from_csv(text, name=cls_name).validate()
    x, y = _batch()
    ref, model = _model(), _model()
    F.mse_loss(ref(x), y).backward()
    runner = PipelineRunner(schedule, split_stages(model, schedule, rank), F.mse_loss, dist.group.WORLD, timeout=30)
    runner.step(x, y)
    return _grad_diff(model, ref), text, schedule.stage_to_rank


@pytest.mark.parametrize("cls_name, ours", [("ScheduleZBVZeroBubble", "zb-v"), ("ScheduleDualPipeV", "dualpipe-v")])
def test_torchs_zbv_and_dualpipe_v_run_in_modelpar(c2, cls_name, ours):
    for err, text, placement in c2.run(_we_run_torchs, cls_name, 4):
        assert err <= TOL and placement == (0, 1, 1, 0)
        assert from_csv(text).actions == get_schedule(ours, ranks=2, microbatches=4).actions
