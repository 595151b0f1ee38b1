"""Configuration fields that carry their own help and section, and strict construction from a mapping.

A config dataclass declares each field once, with ``option(default, help, section=...)``; the
command line (``modelpar train``'s flags, help and argument groups), the ``--config`` file's
tables, the docs and the summary are generated from these fields, so a field added here is a
flag, a file key and a documented setting at once (torchtitan's ``JobConfig`` keeps its sections
the same way). Pure Python: command modules read it without importing torch.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["SECTIONS", "FieldInfo", "about", "check_keys", "coerce", "construct", "field_infos", "option"]

# The sections of a training run, in the order the help, the docs and the summary list them.
SECTIONS = ("model", "data", "parallelism", "schedule", "optimisation", "checkpoint", "planning", "run")


def option(default: Any = dataclasses.MISSING, *, help: str, section: str | None = None,
           flag: str | None = None, parse: Callable[[str], Any] | None = None, cli: bool = True,
           default_factory: Any = dataclasses.MISSING, metavar: str | None = None) -> Any:
    """A dataclass field with its help text and section (None: the class's own section).

    ``flag``: the command-line name when it is not the field's (``--data`` for ``paths``);
    ``parse``: turns a command-line or file string into the value (``"5,6"`` -> ``(5, 6)``);
    ``cli=False``: no flag (set by the program, or only in a file).
    """
    meta = about(help, section=section, flag=flag, parse=parse, cli=cli, metavar=metavar)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def about(help: str, *, section: str | None = None, flag: str | None = None,
          parse: Callable[[str], Any] | None = None, cli: bool = True, metavar: str | None = None) -> dict[str, Any]:
    """The metadata ``option`` stores, for a ``dataclasses.field(metadata=about(...))`` of its own."""
    if section is not None and section not in SECTIONS:
        raise ValueError(f"section must be one of {{{', '.join(SECTIONS)}}}, got {section!r}")
    return {"help": help, "section": section, "flag": flag, "parse": parse, "cli": cli, "metavar": metavar}


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One configurable field as the command line, the file and the docs see it."""

    name: str
    kind: Any  # the resolved type annotation
    default: Any
    help: str
    section: str | None
    flag: str  # --name on the command line
    parse: Callable[[str], Any] | None
    cli: bool
    metavar: str | None

    @property
    def nested(self) -> bool:
        """A field holding a whole config section (``TrainConfig.model``)."""
        return isinstance(self.kind, type) and dataclasses.is_dataclass(self.kind)


def field_infos(cls: type) -> list[FieldInfo]:
    """The fields of config dataclass ``cls`` in declaration order, with their metadata."""
    hints = typing.get_type_hints(cls)
    infos = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        infos.append(FieldInfo(f.name, hints[f.name], default, meta.get("help", ""), meta.get("section"),
                               meta.get("flag") or "--" + f.name.replace("_", "-"), meta.get("parse"),
                               meta.get("cli", True), meta.get("metavar")))
    return infos


def check_keys(where: str, given: Iterable[str], allowed: Iterable[str]) -> None:
    """ValueError naming the first unknown key of ``given`` and the allowed ones (``where`` says where:
    ``"run.toml: [schedule]"``, ``"model config:"``)."""
    allowed = list(allowed)
    for key in given:
        if key not in allowed:
            raise ValueError(f"{where} unknown key {key!r}; allowed: {', '.join(allowed)}")


def coerce(name: str, kind: Any, value: Any, parse: Callable[[str], Any] | None = None) -> Any:
    """``value`` (from JSON / TOML) as a ``kind``: lists become tuples, strings go through ``parse``."""
    if parse is not None and isinstance(value, str):
        return parse(value)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if value is None:
        if type(None) in typing.get_args(kind):
            return None
        raise ValueError(f"{name} must not be null")
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    base = args[0] if union and len(args) == 1 else kind
    origin = typing.get_origin(base)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {value!r}")
        item = typing.get_args(base)[0]
        return tuple(coerce(f"{name} entries", item, v, None) for v in value)
    if base is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):  # NaN and inf: TOML and Python's JSON read them
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    return value


def construct(cls: type, values: Mapping[str, Any], where: str, extra: Iterable[str] = ()) -> Any:
    """``cls(**values)`` with every key known (else a one-line ValueError naming it and the allowed
    ones), lists as tuples, nested sections built the same way. ``extra``: keys silently accepted
    and left out (retired fields a caller handles)."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{where} must be a table of settings, got {values!r}")
    infos = {info.name: info for info in field_infos(cls)}
    keep = {k: v for k, v in values.items() if k not in set(extra)}
    check_keys(where, keep, infos)
    built = {}
    for key, value in keep.items():
        info = infos[key]
        if info.nested and isinstance(value, Mapping):
            built[key] = construct(info.kind, value, f"{where} [{key}]")
        elif info.nested:
            built[key] = value
        else:
            built[key] = coerce(f"{where} {key}", info.kind, value, info.parse)
    return cls(**built)
