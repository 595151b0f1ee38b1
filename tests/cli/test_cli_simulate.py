"""``modelpar simulate``: default comparison, options, JSON, sweep, bad input, and no torch."""

import json
import subprocess
import sys

import pytest
from _images import assert_drawn

from modelpar.cli import main


def run(capsys, *argv):
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_no_arguments_compares_four_schedules(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    for name in ("gpipe (K = 4, M = 8): step 33 units, bubble 27.3%",
                 "1f1b (K = 4, M = 8): step 33 units, bubble 27.3%, peak held microbatches per rank [4, 3, 2, 1]",
                 "interleaved (K = 4, M = 8, v = 2): step 28.5 units",
                 "zb-h1 (K = 4, M = 8): step 27 units, bubble 11.1%"):
        assert name in out
    assert "Device 0 |F0F1F2F3············B0B0F4B1B1" in out
    assert out.count("Device 3 |") == 4


def test_json_keys_and_values(capsys):
    code, out, _ = run(capsys, "--json", "--schedule", "gpipe", "--schedule", "interleaved")
    rows = json.loads(out)
    assert code == 0 and [r["schedule"] for r in rows] == ["gpipe", "interleaved"]
    for key in ("schedule", "stages", "microbatches", "chunks", "step_time", "bubble", "peak_held", "transfers"):
        assert key in rows[0]
    assert rows[0]["step_time"] == 33 and rows[0]["peak_held"] == [8, 8, 8, 8] and rows[0]["transfers"] == 48
    assert rows[1]["chunks"] == 2 and rows[1]["peak_held"][0] == 5.5


def test_transfer_and_backward_ratio(capsys):
    _, out, _ = run(capsys, "--json", "--schedule", "1f1b", "--microbatches", "32", "--transfer", "0.2")
    assert round(json.loads(out)[0]["bubble"], 3) == 0.168
    _, out, _ = run(capsys, "--json", "--schedule", "gpipe", "--backward-ratio", "1")
    assert json.loads(out)[0]["step_time"] == 22  # (M + K - 1)(1 + 1)


def test_from_file_table_and_outputs(capsys, tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("# hand-written 1F1B\ndevice 0: 0F0 0F1 0B0 0B1\ndevice 1: 1F0 1B0 1F1 1B1\n")
    png, svg, trace = tmp_path / "t.png", tmp_path / "t.svg", tmp_path / "t.json"
    code, out, _ = run(capsys, "--from", str(path), "--table", "--png", str(png), "--svg", str(svg), "--trace", str(trace))
    assert code == 0
    assert "mine (K = 2, M = 2): step 9 units, bubble 33.3%" in out
    assert "   3  0B0       1F1" in out  # the step x device table
    import matplotlib.pyplot as plt

    colours = assert_drawn(png)
    assert all(tuple(round(255 * c) for c in plt.get_cmap("tab10")(m)[:3]) in colours for m in (0, 1))  # both microbatches
    assert svg.read_text().startswith("<?xml")
    assert "traceEvents" in json.loads(trace.read_text())


def test_comm_prints_the_lowered_programs(capsys):
    code, out, _ = run(capsys, "--schedule", "1f1b", "--ranks", "2", "--microbatches", "3", "--comm")
    assert code == 0
    assert "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0F2 0SEND_F2 0RECV_B2 0B1 0B2" in out
    assert "rank 1: 1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2" in out
    code, out, _ = run(capsys, "--schedule", "interleaved", "--ranks", "2", "--microbatches", "2", "--comm", "--json")
    programs = json.loads(out)[0]["programs"]
    assert code == 0 and sorted(programs) == ["0", "1"]
    assert programs["0"][:4] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1"]  # stage 0 -> 1 crosses devices
    assert "1SEND_F0" in programs["1"] and "2RECV_F0" in programs["0"]  # 1 -> 2 crosses back
    _, out, _ = run(capsys, "--schedule", "gpipe", "--json")
    assert "programs" not in json.loads(out)[0]


def test_sweep_prints_both_tables(capsys):
    code, out, _ = run(capsys, "--sweep", "8,32", "--schedule", "gpipe", "--schedule", "1f1b")
    assert code == 0
    assert "transfer 0 (" in out and "transfer 0.2 (" in out
    assert out.splitlines()[-1].split() == ["32", "9.6%", "16.8%"]
    code, out, _ = run(capsys, "--sweep", "4,6", "--json", "--schedule", "interleaved")
    rows = json.loads(out)
    assert [r["bubble"] is None for r in rows] == [False, True, False, True]  # M = 6 is not a multiple of K


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "foo"], "--schedule must be one of {naive, gpipe, 1f1b, interleaved, looped-bfs, zb-h1, "
                                "zb-h2, zb-v, v-half, v-min, dualpipe-v, dualpipe-v-serial} or auto, got 'foo'"),
        (["--ranks", "0"], "--ranks must be >= 1, got 0"),
        (["--microbatches", "2.5"], "--microbatches must be an integer, got '2.5'"),
        (["--schedule", "interleaved", "--microbatches", "6"],
         "--microbatches (6) must be divisible by --ranks (4) for schedule 'interleaved'"),
        (["--chunks", "0"], "--chunks must be >= 1, got 0"),
        (["--transfer", "-1"], "--transfer must be >= 0.0, got -1.0"),
        (["--from", "/no/such/file"], "--from must be a readable file, got '/no/such/file'"),
        (["--ranks", "100000", "--microbatches", "100000"], "must be <= 10,000,000"),
        # issue 35: K = 32, M = 128 ran 161 s, K = 64 never answered: refused from the synthesis's cost K^3·M
        (["--schedule", "auto", "--ranks", "32", "--microbatches", "128"],
         "grows as K^3·M (--ranks^3 x --microbatches) and answers in seconds up to 524,288"),
        (["--pareto", "--ranks", "64"], "got K = 64, M = 8: 2,097,152; use fewer --ranks or --microbatches"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_deadlocking_file_is_reported(capsys, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1\n")
    code, _, err = run(capsys, "--from", str(path))
    assert code == 2 and "deadlock: rank 0 waits at 0B0" in err
    code, _, err = run(capsys, "--from", str(path), "--comm")
    assert code == 2 and "deadlock: rank 0 waits at 0B0" in err  # simulate validates before lowering


def test_simulate_never_imports_torch():
    code = (
        "import sys; from modelpar.cli import main; "
        "rc = main(['simulate', '--json', '--comm']); "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["schedule"] == "gpipe"


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "modelpar", "simulate", "--schedule", "naive", "--ranks", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Device 1 |··F0B0B0····|" in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--png", "/no-such-folder/x.png"], "--png: folder '/no-such-folder' does not exist"),
    (["--trace", "trace.txt"], "--trace must name a .json file, got 'trace.txt'"),
    (["--svg", "chart.png"], "--svg must name a .svg file"),
    (["--unit", "-1"], "--unit must be > 0.0, got -1.0"),
])
def test_output_and_unit_checked_before_any_work(capsys, args, message):
    from modelpar.cli import main

    assert main(["simulate", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""  # nothing printed before the error


def test_export_csv_and_read_it_back(capsys, tmp_path):
    path = tmp_path / "zbv.csv"
    code, out, _ = run(capsys, "--schedule", "zb-v", "--ranks", "2", "--microbatches", "4", "--export-csv", str(path))
    assert code == 0 and f"wrote {path} (compute_only)" in out
    assert path.read_text().splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0,")
    code, out, _ = run(capsys, "--from", str(path))
    assert code == 0 and "zbv (K = 2, M = 4, v = 2): step" in out
    code, out, _ = run(capsys, "--schedule", "1f1b", "--ranks", "2", "--microbatches", "2", "--export-csv",
                       str(path), "--comm", "--json")
    assert code == 0 and path.read_text() == "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0RECV_B1,0B0,0B1,0REDUCE_GRAD\n" \
        "1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1REDUCE_GRAD\n"


@pytest.mark.parametrize("text, message", [
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", "action 0B1 is missing (rank 0)"),
    ("0F0,0B0\n0F1,1F0,1B0\n", "stage 0 appears on rank 0 and rank 1 (action 0F1)"),
    ("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n", "deadlock: rank 0 waits at 0B0 (position 1) for 1B0 on rank 1"),
])
def test_bad_csv_is_one_line_naming_the_first_bad_action(capsys, tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    code, out, err = run(capsys, "--from", str(path))
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err


def test_export_csv_needs_one_schedule(capsys, tmp_path):
    code, _, err = run(capsys, "--export-csv", str(tmp_path / "x.csv"))
    assert code == 2 and "--export-csv writes one schedule: give one --schedule or --from, got 4" in err


def test_blank_csv_lines_are_no_ranks(capsys, tmp_path):
    """Issue 35 #10: a blank line (trailing, or between rows) made an idle rank; it is skipped (docs/simulator.md)."""
    rows = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    for n, text in enumerate((rows + "\n\n", rows.replace("\n", "\n\n", 1), rows + " , \n")):
        path = tmp_path / f"s{n}.csv"
        path.write_text(text)
        code, out, err = run(capsys, "--from", str(path), "--json")
        assert code == 0 and json.loads(out)[0]["ranks"] == 2, (text, err)


def test_ranks_with_from_must_agree_with_the_file(capsys, tmp_path):
    """Issue 35 #10: --ranks was ignored with --from; now it is checked against the file's lines."""
    path = tmp_path / "s.txt"
    path.write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    code, out, err = run(capsys, "--from", str(path), "--ranks", "4")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"--ranks 4 but --from {str(path)!r} has 2 ranks (one line each)" in err
    code, out, _ = run(capsys, "--from", str(path), "--ranks", "2", "--json")
    assert code == 0 and json.loads(out)[0]["ranks"] == 2


def test_a_reader_that_leaves_ends_the_command_quietly():
    """`modelpar simulate ... | head`: the pipe closes while ~300 KB are still to be written (more than a pipe
    holds, so the writer is blocked on it): exit 141 (128 + SIGPIPE) as a killed writer, nothing on stderr."""
    cmd = [sys.executable, "-m", "modelpar", "simulate", "--schedule", "1f1b", "--ranks", "16", "--microbatches", "256",
           "--comm"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(100)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == b""
