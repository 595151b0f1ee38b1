"""Issue 27's old names still work, each with one DeprecationWarning, and give what the new names give.

The old names are on purpose here: tools/rename_ranks.py skips this file.
"""

import json
import warnings

import pytest

from modelpar import _renamed
from modelpar.cli import main
from modelpar.schedules import SCHEDULES, get_schedule, on_one_device, on_one_rank
from modelpar.schedules.generators import _BUILD, CHUNKED
from modelpar.schedules.lower import lower, rendezvous
from modelpar.simulate import simulate
from modelpar.simulate.synthesis import StageCosts, synthesize
from modelpar.simulate.timeline import Event, Timeline


@pytest.fixture(autouse=True)
def fresh_warnings():
    _renamed._warned.clear()
    yield
    _renamed._warned.clear()


def _once(call, old):
    """``call()`` warns once that ``old`` is deprecated; a second call is silent. Returns the first result."""
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: use") as caught:
        result = call()
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call()
    return result


@pytest.mark.parametrize("name", SCHEDULES)
def test_get_schedule_and_every_generator_take_stages_as_the_old_name_of_ranks(name):
    chunks = 2 if name in CHUNKED else None
    new = get_schedule(name, ranks=2, microbatches=4, chunks=chunks)
    assert _once(lambda: get_schedule(name, stages=2, microbatches=4, chunks=chunks), r"get_schedule\(stages=...\)") == new
    extra = {"chunks": 2} if name in CHUNKED else {}
    gen = _BUILD[name]
    assert _once(lambda: gen(stages=2, microbatches=4, **extra), rf"{gen.__name__}\(stages=...\)") == new
    with pytest.raises(TypeError, match=r"got both stages= and ranks="):
        get_schedule(name, stages=2, ranks=2, microbatches=4, chunks=chunks)


def test_schedule_and_timeline_attributes_under_their_old_names():
    s = get_schedule("interleaved", ranks=2, microbatches=4, chunks=2)
    assert _once(lambda: s.num_devices, r"Schedule.num_devices") == s.num_ranks == 2
    assert _once(lambda: s.stage_to_device, r"Schedule.stage_to_device") == s.stage_to_rank == (0, 1, 0, 1)
    assert [_once(lambda: s.device_of(3), r"Schedule.device_of")] == [s.rank_of(3)] == [1]
    t = simulate(s)
    assert _once(lambda: t.num_devices, r"Timeline.num_devices") == t.num_ranks
    assert _once(lambda: t.stage_to_device, r"Timeline.stage_to_device") == t.stage_to_rank
    assert _once(lambda: t.bubble_per_device, r"Timeline.bubble_per_device") == t.bubble_per_rank
    e = t.events[-1]
    assert _once(lambda: e.device, r"Event.device") == e.rank == 1
    again = _once(lambda: Timeline.from_events(t.events, num_devices=2, schedule=s), r"from_events\(num_devices=...\)")
    assert again.starts == t.starts and again.ends == t.ends
    assert Event(*e) == e


def test_functions_and_keywords_under_their_old_names():
    s = get_schedule("1f1b", ranks=3, microbatches=3)
    assert _once(lambda: on_one_device(s), r"on_one_device") == on_one_rank(s)
    assert _once(lambda: rendezvous(lower(s), stage_to_device=s.stage_to_rank), r"rendezvous\(stage_to_device=...\)") is None
    costs = StageCosts.uniform(2)
    best, _ = _once(lambda: synthesize(stages=2, microbatches=4, costs=costs), r"synthesize\(stages=...\)")
    assert best == synthesize(ranks=2, microbatches=4, costs=costs)[0]


def test_simulate_takes_stages_as_the_old_flag_of_ranks_and_prints_both_keys(capsys):
    args = ["simulate", "--schedule", "1f1b", "--microbatches", "3", "--json"]
    assert main([*args, "--ranks", "2"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert _once(lambda: main([*args, "--stages", "2"]), r"--stages") == 0
    old = json.loads(capsys.readouterr().out.split("\n]\n")[0] + "\n]")
    assert old == new and new[0]["ranks"] == new[0]["stages"] == 2
    assert new[0]["bubble_per_rank"] == new[0]["bubble_per_device"]


def test_layers_per_rank_under_their_old_names():
    from modelpar import costmodel
    from modelpar.costmodel import ParallelConfig, estimate, make_cluster, model_preset
    from modelpar.costmodel.stages import device_loads, rank_loads
    from modelpar.layer_split import device_layers, rank_layers

    assert _once(lambda: device_layers((5, 6, 6, 5), 2), r"device_layers") == rank_layers((5, 6, 6, 5), 2) == (11, 11)
    assert costmodel.device_layers is device_layers  # the package's old export is the same alias
    cfg = ParallelConfig(8, 16, 8, 1, 2, "selective", True)
    assert _once(lambda: device_loads(96, cfg), r"device_loads") == rank_loads(96, cfg)
    e = estimate(model_preset("gpt3-175b"), make_cluster("a100-80gb", 1024), cfg, 1536)
    assert _once(lambda: e.device_layers, r"Estimate.device_layers") == e.rank_layers
    row = e.as_dict()
    assert row["device_layers"] == row["rank_layers"] == list(e.rank_layers)  # `modelpar plan --json`: both keys


def test_rendezvous_takes_device_as_the_old_channel_name_of_rank():
    s = get_schedule("zb-v", ranks=3, microbatches=6)
    programs = lower(s)
    assert _once(lambda: rendezvous(programs, s.stage_to_rank, channel="device"), r'rendezvous\(channel="device"\)') \
        is rendezvous(programs, s.stage_to_rank, channel="rank") is None


def test_the_tree_uses_only_the_new_names():
    """tools/rename_ranks.py --check: nothing left to rename (rerun the codemod after merging old-name code)."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "rename_ranks.py"
    run = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
