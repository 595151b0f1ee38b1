"""The simulator draws a MoE run's expert all-to-alls inside its F and B boxes, at the lengths the cost model
priced them (``costmodel.local.predicted_timeline``, ``costmodel.moe.moe_spans``), and the PNG shows them."""

import pytest

from modelpar.cli import main
from modelpar.costmodel.local import moe_stage_seconds, predict_local, predicted_timeline
from modelpar.costmodel.local_memory import LocalLayout
from modelpar.costmodel.moe import MoESeconds, MoESpec, moe_spans
from modelpar.costmodel.presets import PROFILES
from modelpar.costmodel.specs import ModelSpec
from modelpar.schedules.action import Kind
from modelpar.simulate.plot import _INNER, plot_timelines
from tests._images import assert_drawn, picture_colours

SPEC = ModelSpec(layers=4, hidden=1024, heads=8, seq=1024, vocab=512, ffn=2048, gated_mlp=True,
                 tied_embeddings=False, learned_positions=False, bias=False, dropout=False)
RUN = LocalLayout(SPEC, p=2, d=4, microbatches=4, batch=32, precision="bf16", moe=MoESpec(8, 2048, every=2), ep=4)
H100 = PROFILES["h100-sxm"]


def test_spans_by_hand():
    sec = MoESeconds(0.0, 0.0, 0.0, a2a_forward=2.0, a2a_backward=4.0)
    # F of [dense, MoE] over 10: 8 of compute, 4 per layer; the MoE layer: 2 compute, dispatch 1, 2, combine 1
    assert moe_spans(0.0, 10.0, [False, True], sec, "F") == [(6.0, 7.0), (9.0, 10.0)]
    # B over 12, the MoE layer first: combine's gradient 2, 4 compute halves apart, dispatch's 2, then the dense 4
    assert moe_spans(0.0, 12.0, [False, True], sec, "B") == [(0.0, 2.0), (4.0, 6.0)]


def test_timeline_carries_the_priced_all_to_alls_inside_the_boxes():
    tl = predicted_timeline(RUN, H100)
    assert tl.step_time == pytest.approx(1e3 * predict_local(RUN, H100).time["pipeline"])  # the same spine
    _, sec = moe_stage_seconds(RUN, H100, 0)
    assert sec is not None and sec.a2a_forward > 0
    for d in range(2):
        for a, s, e in zip(tl.actions[d], tl.starts[d], tl.ends[d]):
            inside = [(x, y) for _, x, y in tl.inner[d] if s <= x < e]
            assert all(y <= e + 1e-9 for _, y in inside)
            want = sec.a2a_forward if a.kind is Kind.F else sec.a2a_backward
            assert sum(y - x for x, y in inside) == pytest.approx(1e3 * want)  # one MoE layer per stage


def test_png_shows_the_segments_and_the_cli_draws_a_train_config(tmp_path, capsys):
    moe, dense = tmp_path / "moe.png", tmp_path / "dense.png"
    plot_timelines([predicted_timeline(RUN, H100)], moe)
    plot_timelines([predicted_timeline(LocalLayout(SPEC, p=2, d=4, microbatches=4, batch=32), H100)], dense)
    ink = tuple(int(_INNER[i:i + 2], 16) for i in (1, 3, 5))
    assert ink in assert_drawn(moe) and ink not in picture_colours(dense)
    config = tmp_path / "moe.toml"
    config.write_text('[model]\narch = "llama"\nhidden = 256\nheads = 4\nlayers = 4\nseq_len = 128\nexperts = 8\n'
                      'moe_every = 2\n[parallelism]\ntp = 1\npp = 2\ndp = 4\nep = 4\n[planning]\nhardware = "h100-sxm"\n')
    assert main(["simulate", "--train-config", str(config), "--png", str(tmp_path / "cli.png"), "--json"]) == 0
    assert '"all_to_all_ms"' in capsys.readouterr().out and ink in assert_drawn(tmp_path / "cli.png")
    assert main(["simulate", "--train-config", str(tmp_path / "missing.toml")]) == 2
    assert "--train-config" in capsys.readouterr().err
