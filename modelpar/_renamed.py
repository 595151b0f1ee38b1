"""Old names that still work: issue 27's renames (docs/notation.md's table), each a DeprecationWarning once.

Pure Python (no torch), so the schedules and the simulator can keep their old names with it. The
rename itself is ``tools/rename_ranks.py``; the lines that define an alias carry the marker
``rename: keep`` so that a rerun of it leaves them alone.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["RenamedFlag", "renamed_attribute", "renamed_function", "renamed_kwargs", "warn_renamed"]

F = TypeVar("F", bound=Callable[..., Any])
_warned: set[str] = set()  # old names already announced in this process


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """A DeprecationWarning "``old`` is deprecated: use ``new``", the first time ``old`` is used."""
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=stacklevel)


def renamed_kwargs(**renames: str) -> Callable[[F], F]:
    """Decorator: the keywords ``old=new`` still accepted under their old names (both at once: TypeError)."""
    def wrap(func: F) -> F:
        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{func.__name__}() got both {old}= and {new}=; {old}= is the old name of {new}=")
                    warn_renamed(f"{func.__name__}({old}=...)", f"{new}=")
                    kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def renamed_function(func: F, old: str) -> F:
    """``func`` under its old name ``old``: warns, then calls it."""
    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        warn_renamed(old, func.__name__)
        return func(*args, **kwargs)
    call.__name__ = call.__qualname__ = old.rsplit(".", 1)[-1]
    return call  # type: ignore[return-value]


class renamed_attribute:  # lower case: used like property
    """A class attribute (property or method) read under its old name: ``num_devices = renamed_attribute("num_ranks")``."""

    def __init__(self, new: str, old: str = "") -> None:
        self.new = new
        self.old = old  # "Class.name"; set from the class statement when empty

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = self.old or f"{owner.__name__}.{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warn_renamed(self.old, f"{type(obj).__name__}.{self.new}")
        return getattr(obj, self.new)


class RenamedFlag(argparse.Action):
    """A command-line flag under its old name: stores into the new flag's ``dest`` and warns once.

    ``p.add_argument("--stages", dest="ranks", action=RenamedFlag, new="--ranks", help=argparse.SUPPRESS)``
    """

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        warn_renamed(option_string or self.option_strings[0], self.new, stacklevel=2)
        setattr(namespace, self.dest, values)
