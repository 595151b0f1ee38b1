"""Renderers: the reference's ASCII charts verbatim, PNG/SVG files, Chrome trace JSON."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelpar.schedules import Kind, get_schedule, gpipe, interleaved_1f1b, naive, one_f_one_b, zb_h1
from modelpar.schedules.replay import replay_times
from modelpar.simulate import Costs, Timeline, simulate
from modelpar.simulate.ascii import IDLE, ascii_chart, auto_unit
from modelpar.simulate.plot import plot_timelines
from modelpar.simulate.tables import headline, metrics_table
from modelpar.simulate.trace import chrome_trace, write_trace

# §1.2, §2.3 and §4.1, with 设备 -> Device
NAIVE = """\
Device 0 |F0F0····································B0B0B0B0|
Device 1 |····F0F0························B0B0B0B0········|
Device 2 |········F0F0············B0B0B0B0················|
Device 3 |············F0F0B0B0B0B0························|"""
GPIPE = """\
Device 0 |F0F1F2F3F4F5F6F7··················B7B7B6B6B5B5B4B4B3B3B2B2B1B1B0B0|
Device 1 |··F0F1F2F3F4F5F6F7············B7B7B6B6B5B5B4B4B3B3B2B2B1B1B0B0····|
Device 2 |····F0F1F2F3F4F5F6F7······B7B7B6B6B5B5B4B4B3B3B2B2B1B1B0B0········|
Device 3 |······F0F1F2F3F4F5F6F7B7B7B6B6B5B5B4B4B3B3B2B2B1B1B0B0············|"""
ONE_F_ONE_B = """\
Device 0 |F0F1F2F3············B0B0F4B1B1F5B2B2F6B3B3F7B4B4··B5B5··B6B6··B7B7|
Device 1 |··F0F1F2········B0B0F3B1B1F4B2B2F5B3B3F6B4B4F7B5B5··B6B6··B7B7····|
Device 2 |····F0F1····B0B0F2B1B1F3B2B2F4B3B3F5B4B4F6B5B5F7B6B6··B7B7········|
Device 3 |······F0B0B0F1B1B1F2B2B2F3B3B3F4B4B4F5B5B5F6B6B6F7B7B7············|"""


def test_ascii_charts_are_the_reference_charts():
    assert ascii_chart(simulate(naive(ranks=4)), unit=0.5) == NAIVE
    assert ascii_chart(simulate(gpipe(ranks=4, microbatches=8))) == GPIPE
    assert ascii_chart(simulate(one_f_one_b(ranks=4, microbatches=8))) == ONE_F_ONE_B


def test_ascii_chart_split_backward_chunks_and_wide_microbatch_numbers():
    assert ascii_chart(simulate(zb_h1(ranks=2, microbatches=2))).splitlines() == [
        "Device 0 |F0F1··I0W0I1W1|",
        "Device 1 |··F0I0F1I1W0W1|",
    ]
    inter = ascii_chart(simulate(interleaved_1f1b(ranks=2, microbatches=2, chunks=2)))  # half-unit cells, chunk 1 lower case
    assert inter.splitlines()[0].startswith("Device 0 |F0F1f0f1")
    assert "F10" in ascii_chart(simulate(gpipe(ranks=2, microbatches=11))).splitlines()[0]
    assert ascii_chart(simulate(gpipe(ranks=1, microbatches=11))).startswith("Device 0 |F00F01")


def test_auto_unit_and_bad_unit():
    assert auto_unit(simulate(gpipe(ranks=4, microbatches=8))) == 1.0
    assert auto_unit(simulate(gpipe(ranks=2, microbatches=2), Costs(transfer=0.5))) == 0.5
    assert auto_unit(simulate(interleaved_1f1b(ranks=4, microbatches=8, chunks=4))) == 0.25
    with pytest.raises(ValueError, match="unit must be > 0, got 0"):
        ascii_chart(simulate(gpipe(ranks=2, microbatches=2)), unit=0)


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".svg", b"<?xml")])
def test_plot_writes_a_real_image(tmp_path, suffix, magic):
    timelines = [simulate(gpipe(ranks=4, microbatches=8)), simulate(zb_h1(ranks=4, microbatches=8))]
    path = plot_timelines(timelines, tmp_path / f"t{suffix}", "K = 4")
    data = path.read_bytes()
    assert data.startswith(magic)
    if suffix == ".svg":
        text = data.decode()
        assert "bubble 27.3%" in text and "Device 3" in text  # title with metrics, row labels
        return
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt
    import numpy as np

    image = mpimg.imread(path)
    # 0.28 · 33 + 3 = 12.24 in wide, 1.1 + 0.42 · 8 + 0.75 · 2 = 5.96 in high, at 110 dpi
    assert image.shape == (655, 1346, 4)
    pixels = {tuple(p) for p in np.round(image[..., :3] * 255).astype(int).reshape(-1, 3).tolist()}
    microbatch_colours = [tuple(round(255 * c) for c in plt.get_cmap("tab10")(m)[:3]) for m in range(8)]
    assert all(c in pixels for c in microbatch_colours)  # a solid F bar of every microbatch
    assert (230, 230, 230) in pixels  # the grey step band where a device idles


def test_plot_rejects_other_formats(tmp_path):
    with pytest.raises(ValueError, match=r"plot path must end in .png or .svg, got '.*t.pdf'"):
        plot_timelines([simulate(gpipe(ranks=2, microbatches=2))], tmp_path / "t.pdf")


def test_chrome_trace_structure(tmp_path):
    tl = simulate(gpipe(ranks=2, microbatches=2), Costs(transfer=0.5))
    trace = json.loads(write_trace([tl], tmp_path / "t.json").read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 8
    f1 = next(e for e in complete if e["tid"] == 1 and e["name"] == "F0")
    assert (f1["ts"], f1["dur"]) == (1500.0, 1000.0)  # after F0 on device 0 and a 0.5 transfer
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"gpipe", "Device 0", "Device 1"}
    starts = [e for e in events if e["ph"] == "s"]
    assert len(starts) == tl.transfers == len([e for e in events if e["ph"] == "f"])
    assert chrome_trace([tl], us_per_unit=1e6)["traceEvents"][2]["dur"] == 1e6


def test_measured_timeline_renders():
    s = one_f_one_b(ranks=2, microbatches=1)
    tl = Timeline.from_events([(0, s.actions[0][0], 5.0, 6.0), (1, s.actions[1][0], 6.0, 7.0),
                   (1, s.actions[1][1], 7.0, 9.0), (0, s.actions[0][1], 9.0, 11.0)], 2)
    assert ascii_chart(tl) == "Device 0 |F0······B0B0|\nDevice 1 |··F0B0B0····|"
    assert chrome_trace([tl])["traceEvents"][-1]["ph"] == "X"  # no schedule: no flow arrows


# --- measured timelines: their time unit, and every action visible in the ASCII chart ---------

def _measured(unit: str = "s") -> Timeline:
    """1F1B K=2, M=2 as a run might record it: uneven action times in seconds, clock not at 0."""
    s = one_f_one_b(ranks=2, microbatches=2)
    t = {  # device -> (start, end) per action, in the schedule's order: F0 F1 B0 B1 / F0 B0 F1 B1
        0: [(10.000, 10.002), (10.002, 10.0023), (10.006, 10.010), (10.011, 10.015)],
        1: [(10.003, 10.004), (10.004, 10.006), (10.006, 10.0064), (10.0064, 10.0104)],
    }
    return Timeline.from_events([(d, a, *t[d][i]) for d in (0, 1) for i, a in enumerate(s.actions[d])], 2, s, unit=unit)


def test_simulated_timelines_are_in_forward_units_measured_ones_carry_their_clock_unit(tmp_path):
    sim, measured = simulate(gpipe(ranks=4, microbatches=8)), _measured()
    assert sim.unit == "forward" == Timeline.from_events([], 1).unit
    assert headline(sim).startswith("gpipe (K = 4, M = 8): step 33 units, bubble 27.3%")
    assert measured.unit == "s" and "step 0.015 s, bubble" in headline(measured)
    assert "0.015 s" in metrics_table([measured]) and " 33 " in metrics_table([sim])
    svg = plot_timelines([measured], tmp_path / "m.svg").read_text()
    assert "time (s)" in svg and "units of one" not in svg and "step 0.015 s" in svg
    assert "time (units of one microbatch" in plot_timelines([sim], tmp_path / "s.svg").read_text()
    with pytest.raises(ValueError, match=r"must share a unit, got units \['forward', 's'\]"):
        plot_timelines([sim, measured], tmp_path / "mixed.png")
    # Chrome trace: real durations in µs by default; simulated keeps 1 forward unit = 1 ms
    f0 = next(e for e in chrome_trace([measured])["traceEvents"] if e["ph"] == "X")
    assert f0["name"] == "F0" and f0["dur"] == pytest.approx(2000.0)
    ms = Timeline.from_events([(0, naive(ranks=1).actions[0][0], 0.0, 2.5)], 1, unit="ms")
    assert chrome_trace([ms])["traceEvents"][-1]["dur"] == 2500.0
    assert chrome_trace([sim])["traceEvents"][2]["dur"] == 1000.0
    with pytest.raises(ValueError, match=r"unit must be one of \{forward, s, ms, us\}, got 'sec'"):
        Timeline.from_events([], 1, unit="sec")


def test_pipeline_measure_builds_timelines_in_seconds():
    pytest.importorskip("torch")
    from modelpar.pipeline.measure import measured_durations, simulate_measured

    measured = _measured()
    assert simulate_measured(measured.schedule, measured_durations([measured]), 0.0005).unit == "s"


def _runs(row: str, width: int = 2) -> list[str]:
    """The tokens of one chart row, each run of equal cells once, idle cells dropped."""
    cells = [row[i:i + width] for i in range(0, len(row), width)]
    return [c for i, c in enumerate(cells) if IDLE not in c and (i == 0 or cells[i - 1] != c)]


def test_ascii_chart_shows_an_action_shorter_than_a_cell():
    # device 1's F1 lasts 0.4 ms and shares its 1 ms cell with B1: it used to vanish under B1
    chart = ascii_chart(_measured(), unit=0.001)
    assert chart == "Device 0 |F0F0F1······B0B0B0B0··B1B1B1B1|\nDevice 1 |······F0B0B0F1B1B1B1··········|"
    # cells much longer than the actions: one cell each, in order, the chart wider than 1.5 cells
    assert ascii_chart(_measured(), unit=0.01) == "Device 0 |F0F1B0B1|\nDevice 1 |F0B0F1B1|"


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
    k=st.integers(1, 4),
    m=st.integers(1, 6),
    times=st.lists(st.floats(1e-4, 5e-3), min_size=16, max_size=16),
    cell=st.floats(1e-4, 1e-2),
)
def test_ascii_chart_draws_every_measured_action_in_order(name, k, m, times, cell):
    s = get_schedule(name, ranks=k, microbatches=m)
    durations = {kind: times[4 * i:4 * i + k] for i, kind in enumerate(Kind)}
    starts, ends = replay_times(s, durations, [0.0] + [times[-1] / 3] * (k - 1))
    tl = Timeline.from_events([(d, a, starts[d][i], ends[d][i]) for d in range(k) for i, a in enumerate(s.actions[d])],
                  k, s, unit="s")
    rows = [line.split("|")[1] for line in ascii_chart(tl, unit=cell).splitlines()]
    assert len({len(r) for r in rows}) == 1
    for d, row in enumerate(rows):
        assert _runs(row) == [tl.token(a) for a in s.actions[d]]


def test_communication_spans_are_a_row_of_their_own_with_the_exposed_tail(tmp_path):
    s = one_f_one_b(ranks=2, microbatches=2)
    events = [(d, a, *t) for d, times in ((0, [(10.000, 10.002), (10.002, 10.003), (10.006, 10.010), (10.011, 10.015)]),
                                          (1, [(10.003, 10.004), (10.004, 10.006), (10.006, 10.007), (10.007, 10.0104)]))
              for a, t in zip(s.actions[d], times)]
    comm = [(1, "all-reduce", 10.0104, 10.013), (0, "all-reduce", 10.015, 10.018), (0, "all-gather", 10.018, 10.019)]
    tl = Timeline.from_events(events, 2, s, unit="s", comm=comm)
    assert tl.comm[0] == [("all-reduce", pytest.approx(0.015), pytest.approx(0.018)),
                          ("all-gather", pytest.approx(0.018), pytest.approx(0.019))]
    # device 1's all-reduce hides under device 0's last backward; device 0's run 4 ms past its own
    assert tl.exposed_comm() == [pytest.approx(0.004), pytest.approx(0.0026)]
    assert tl.exposed_comm({"all-gather"}) == [pytest.approx(0.004), 0.0]
    assert tl.step_time == pytest.approx(0.015)  # the compute's span: bubble and step as before
    assert Timeline.from_events(events, 2, s, unit="s").exposed_comm() == [0.0, 0.0]
    svg = plot_timelines([tl], tmp_path / "comm.svg").read_text()
    assert "dp comm" in svg and "dp exposed 0.004 s" in svg
    trace = chrome_trace([tl])["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and "tid" in e}
    assert names[2] == "Device 0 dp comm" and names[3] == "Device 1 dp comm"
    spans = [e for e in trace if e.get("cat") == "dp"]
    assert [(e["name"], e["tid"], e["dur"]) for e in spans] == [
        ("all-reduce", 2, pytest.approx(3000.0)), ("all-gather", 2, pytest.approx(1000.0)),
        ("all-reduce", 3, pytest.approx(2600.0))]
    with pytest.raises(ValueError, match="comm span must have a rank in 0..1"):
        Timeline.from_events(events, 2, s, unit="s", comm=[(2, "all-reduce", 0.0, 1.0)])
