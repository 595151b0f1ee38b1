"""The code passes the checkers configured in pyproject.toml (ruff, mypy), as part of the test command."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_reports_nothing():
    run = _run("ruff", "check", "--no-cache", "modelpar", "tests", "benchmarks", "examples")
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_reports_nothing_on_the_package():
    run = _run("mypy")  # the package, as configured in pyproject.toml; it ships py.typed
    assert run.returncode == 0, run.stdout + run.stderr


def test_no_merge_conflict_markers_left_in_text_files():
    """A conflict resolved in the code but not in a doc leaves markers that no checker above reads."""
    markers = ("<<<<<<< ", ">>>>>>> ")
    suffixes = {".py", ".md", ".toml", ".txt", ".sh", ".json", ".cfg", ".yml", ".yaml"}
    found = [f"{path.relative_to(ROOT)}:{n}" for path in ROOT.rglob("*")
             if path.suffix in suffixes and path.is_file() and not {".git", ".venv", "venv"} & set(path.parts)
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.startswith(markers)]
    assert not found, found
