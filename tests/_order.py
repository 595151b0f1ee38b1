"""The order the suite's modules are handed to the workers in: longest first, by recorded seconds."""

import math
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar


class _HasNodeId(Protocol):
    nodeid: str


T = TypeVar("T", bound=_HasNodeId)


def module_of(nodeid: str) -> str:
    """``tests/cli/test_x.py::test_y[1]`` -> ``tests/cli/test_x.py``."""
    return nodeid.split("::", 1)[0]


def longest_first(items: Sequence[T], seconds: Mapping[str, float]) -> list[T]:
    """Items by their module's seconds, longest first; a module not recorded first of all (it may be long, and
    the short ones fill the end); the sort is stable, so a module's tests stay together and in order."""
    return sorted(items, key=lambda item: -seconds.get(module_of(item.nodeid), math.inf))
