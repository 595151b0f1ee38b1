"""Ctrl-C in tests that works when pytest runs as a background job (``pytest ... &``, a CI step under ``nohup``).

A shell starts a background job with SIGINT ignored, its children inherit that, and modelpar keeps an ignored
signal ignored (as ``nohup`` asks): so a test that sends SIGINT first sets it back to its default, in the child
it starts (``CTRL_C_DEFAULT``) or in this process (the ``python_ctrl_c`` fixture, tests/conftest.py).
"""

import signal
from typing import Any


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


CTRL_C_DEFAULT: dict[str, Any] = {"preexec_fn": _sigint_default}  # ``subprocess.Popen(..., **CTRL_C_DEFAULT)``
