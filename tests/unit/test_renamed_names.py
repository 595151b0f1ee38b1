"""Issue 27's old names are gone (issue 37: nothing was released with them), and the tree uses the new ones.

Each old name is refused as Python refuses any unknown name; the JSON keys scripts read (data, not names)
are still written beside the new ones. The old names are on purpose here: tools/rename_ranks.py skips this file.
"""

import json

import pytest

from modelpar.cli import main
from modelpar.schedules import get_schedule, schedule_entry, schedule_names
from modelpar.schedules.lower import lower, rendezvous
from modelpar.simulate import simulate
from modelpar.simulate.synthesis import StageCosts, synthesize


@pytest.mark.parametrize("name", schedule_names())
def test_get_schedule_and_every_generator_refuse_stages_for_ranks(name):
    entry = schedule_entry(name)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stages'"):
        get_schedule(name, stages=2, microbatches=4)
    extra = {"chunks": 2} if entry.chunks is None else {}
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stages'"):
        entry.build(stages=2, microbatches=4, **extra)


@pytest.mark.parametrize("old", ["num_devices", "stage_to_device", "device_of"])
def test_schedule_attributes_under_their_old_names_are_gone(old):
    with pytest.raises(AttributeError, match=old):
        getattr(get_schedule("interleaved", ranks=2, microbatches=4, chunks=2), old)


@pytest.mark.parametrize("old", ["num_devices", "stage_to_device", "bubble_per_device"])
def test_timeline_attributes_under_their_old_names_are_gone(old):
    with pytest.raises(AttributeError, match=old):
        getattr(simulate(get_schedule("1f1b", ranks=2, microbatches=4)), old)


def test_functions_and_keywords_under_their_old_names_are_gone():
    import modelpar.costmodel
    import modelpar.layer_split
    import modelpar.schedules

    for module, old in [(modelpar.schedules, "on_one_device"), (modelpar.layer_split, "device_layers"),
                        (modelpar.costmodel, "device_layers")]:
        assert not hasattr(module, old)
    s = get_schedule("1f1b", ranks=3, microbatches=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stage_to_device'"):
        rendezvous(lower(s), stage_to_device=s.stage_to_rank)
    with pytest.raises(ValueError, match=r"channel must be one of \{pair, rank\}, got 'device'"):
        rendezvous(lower(s), s.stage_to_rank, channel="device")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'stages'"):
        synthesize(stages=2, microbatches=4, costs=StageCosts.uniform(2))


def test_simulate_refuses_the_old_flag_and_still_writes_both_json_keys(capsys):
    args = ["simulate", "--schedule", "1f1b", "--microbatches", "3", "--json"]
    assert main([*args, "--ranks", "2"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert new[0]["ranks"] == new[0]["stages"] == 2
    assert new[0]["bubble_per_rank"] == new[0]["bubble_per_device"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--stages", "2"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --stages 2" in capsys.readouterr().err


def test_plan_json_still_writes_both_layer_keys():
    from modelpar.costmodel import ParallelConfig, estimate, make_cluster, model_preset

    e = estimate(model_preset("gpt3-175b"), make_cluster("a100-80gb", 1024), ParallelConfig(8, 16, 8, 1, 2, "selective", True),
                 1536)
    assert not hasattr(e, "device_layers")
    row = e.as_dict()
    assert row["device_layers"] == row["rank_layers"] == list(e.rank_layers)  # `modelpar plan --json`: both keys
