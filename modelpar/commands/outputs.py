"""The output flags that ``modelpar plan`` and ``modelpar simulate`` share: ``--json`` and the files to write.

Each file flag is declared once with the suffixes it accepts; ``check_outputs`` checks every one
given (suffix, existing folder) before the command does any work, so a typo costs nothing.
"""

from __future__ import annotations

import argparse

from modelpar._validate import check_output_path

__all__ = ["add_outputs", "check_outputs"]


def add_outputs(parser: argparse.ArgumentParser, json_help: str,
                files: dict[str, tuple[tuple[str, ...], str]]) -> argparse._ArgumentGroup:
    """Add the "output" group: ``--json`` (help ``json_help``) and one ``FILE`` flag per ``files`` entry,
    ``{flag: (suffixes, help)}``. Returns the group, for a command's own output flags."""
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help=json_help)
    for flag, (_, text) in files.items():
        out.add_argument(flag, metavar="FILE", help=text)
    parser.set_defaults(output_files={flag: suffixes for flag, (suffixes, _) in files.items()})
    return out


def check_outputs(args: argparse.Namespace) -> None:
    """ValueError naming the flag if a file given to one of ``add_outputs``' flags cannot be written."""
    for flag, suffixes in args.output_files.items():
        path = getattr(args, flag.lstrip("-").replace("-", "_"))
        if path:
            check_output_path(flag, path, suffixes)
