"""The code passes the linters configured in pyproject.toml (ruff), as part of the test command."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_reports_nothing():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "modelpar", "tests", "benchmarks",
                          "examples"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
