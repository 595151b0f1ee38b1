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
