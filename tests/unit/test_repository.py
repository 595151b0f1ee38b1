"""The repository's text is whole: no merge left half-resolved. (ruff and mypy run as their own step of the test
command, before pytest: README, .ci/run.)"""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_no_merge_conflict_markers_left_in_text_files():
    """A conflict resolved in the code but not in a doc leaves markers that no checker reads."""
    markers = ("<<<<<<< ", ">>>>>>> ")
    suffixes = {".py", ".md", ".toml", ".txt", ".sh", ".json", ".cfg", ".yml", ".yaml"}
    found = [f"{path.relative_to(ROOT)}:{n}" for path in ROOT.rglob("*")
             if path.suffix in suffixes and path.is_file() and not {".git", ".venv", "venv"} & set(path.parts)
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.startswith(markers)]
    assert not found, found


def test_a_unit_test_cannot_start_a_process():
    """tests/unit/conftest.py: a process started here fails the test with where it belongs."""
    import multiprocessing
    import subprocess
    import sys

    with pytest.raises(AssertionError, match=r"move it to tests/cluster \(ranks\) or tests/cli"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match=r"move it to tests/cluster \(ranks\) or tests/cli"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_modules_are_handed_out_longest_first_and_unrecorded_ones_before_all():
    from dataclasses import dataclass

    from _order import longest_first, module_of

    @dataclass
    class Item:
        nodeid: str

    items = [Item(n) for n in ("tests/unit/a.py::t1", "tests/unit/a.py::t2", "tests/cli/b.py::t[x]",
                               "tests/cluster/new.py::t", "tests/unit/c.py::t")]
    seconds = {"tests/unit/a.py": 1.0, "tests/cli/b.py": 30.5, "tests/unit/c.py": 0.2}
    assert [i.nodeid for i in longest_first(items, seconds)] == [
        "tests/cluster/new.py::t", "tests/cli/b.py::t[x]", "tests/unit/a.py::t1", "tests/unit/a.py::t2",
        "tests/unit/c.py::t"]
    assert module_of("tests/cli/b.py::t[a::b]") == "tests/cli/b.py"


def test_the_recorded_durations_name_only_modules_that_exist():
    """tests/durations.json, rewritten by `python -m pytest --record-durations`: no stale name after a move."""
    import json

    recorded = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert recorded and all((ROOT / name).is_file() for name in recorded), [n for n in recorded if not (ROOT / n).is_file()]
    assert all(isinstance(s, float | int) and s >= 0 for s in recorded.values())
