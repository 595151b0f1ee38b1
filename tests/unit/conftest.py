"""Unit tests run in the test's own process: starting one (a subprocess, a multiprocessing child, a cluster of
ranks) fails the test with where it belongs instead — tests/cluster (ranks) or tests/cli (commands, fresh
interpreters). Keeps this folder fast to run alone (`python -m pytest tests/unit`)."""

import multiprocessing.process
import subprocess

import matplotlib.font_manager  # noqa: F401  (its first import may run fc-list to build the font cache: here, not in a test)
import pytest


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a unit test starts no process: move it to tests/cluster (ranks) or tests/cli "
                         "(commands, fresh interpreters)")


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
