"""Argument checks shared by every module: errors name the argument, its value and what is allowed.

Pure Python (no torch), so the simulator and cost model can use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` if it is a whole number within [minimum, maximum], else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_number(name: str, value: Any, minimum: float | None = 0.0, *, strict: bool = False) -> float:
    """Return ``value`` as a finite float >= minimum (> minimum when ``strict``), else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be {op} {minimum}, got {value}")
    return float(value)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``choices``, else raise ValueError listing them."""
    choices = list(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) if not isinstance(c, str) else c for c in choices)
        raise ValueError(f"{name} must be one of {{{allowed}}}, got {value!r}")
    return value


def check_divisible(name: str, value: int, divisor_name: str, divisor: int) -> None:
    """Raise ValueError unless ``divisor`` divides ``value``."""
    if divisor <= 0 or value % divisor:
        raise ValueError(f"{name} ({value}) must be divisible by {divisor_name} ({divisor})")


def check_output_path(name: str, path: str, suffixes: Iterable[str]) -> str:
    """Return ``path`` if it ends in one of ``suffixes`` and its folder exists; else raise ValueError.

    Checked before the work that produces the file, so a typo costs nothing.
    """
    import os

    allowed = [s.lower() for s in suffixes]
    if os.path.splitext(path)[1].lower() not in allowed:
        raise ValueError(f"{name} must name a {' or '.join(allowed)} file, got {path!r}")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"{name}: folder {folder!r} does not exist")
    return path


def json_error(err: Any) -> str:
    """A ``json.JSONDecodeError`` in words with its column: ``Expecting value at column 3`` (json's
    ``... starting at`` messages keep their own ``at``)."""
    where = err.msg if err.msg.endswith(" at") else f"{err.msg} at"
    return f"{where} column {err.colno}"
