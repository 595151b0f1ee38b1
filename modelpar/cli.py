"""The ``modelpar`` command: one subcommand per module in ``modelpar.commands``.

Each command module defines ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed arguments and returning an exit code. Command modules
import heavy libraries (torch, matplotlib) inside ``func`` only, so ``modelpar simulate`` and
``modelpar plan`` start without torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# Subcommand name -> module that registers it.
COMMANDS: dict[str, str] = {
    "plan": "modelpar.commands.plan",
    "calibrate": "modelpar.commands.calibrate",
    "bench": "modelpar.commands.bench",
    "export": "modelpar.commands.export",
    "simulate": "modelpar.commands.simulate",
    "train": "modelpar.commands.train",
    "generate": "modelpar.commands.generate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modelpar",
        description="Model parallelism in PyTorch, and the tools to reason about it: train a GPT with "
        "tensor x pipeline x data parallelism, simulate pipeline schedules, plan (t, p, d), measure.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.owns_process = argv is None  # the command line's own process (it exits after this), not a call from Python
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # bad input: one line, exit code 2, no traceback
        print(f"modelpar {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`modelpar simulate | head`): stop quietly, as a killed writer would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more reaches the closed pipe
        return 128 + signal.SIGPIPE
    except OSError as err:  # a file system that refused a write (read-only, full, a path under a file): one line
        print(f"modelpar {args.command}: error: {_os_error(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C: exit code 130, and where it stopped if the command says
        print(f"modelpar {args.command}: {str(err) or 'interrupted (SIGINT)'}", file=sys.stderr)
        return 130
    except RuntimeError as err:  # a rank that died or stopped answering: its launcher says which and how
        if not _rank_death(err):
            raise
        print(f"modelpar {args.command}: error: {err}", file=sys.stderr)
        return 1


def _os_error(err: OSError) -> str:
    """An OSError in words, naming its path: ``'/mnt/ro/model.json': Read-only file system``."""
    what = err.strerror or str(err)
    if err.filename is None:
        return what
    paths = repr(str(err.filename)) + (f" -> {str(err.filename2)!r}" if err.filename2 is not None else "")
    return f"{paths}: {what}"


def _rank_death(err: BaseException) -> bool:
    """True for the launcher's error about a rank that died or stopped answering (``modelpar.distributed.RankError``
    with an exit code, or ``hung``): its one line says it all."""
    from modelpar.distributed import RankError

    return isinstance(err, RankError) and (err.exitcode is not None or err.hung)


if __name__ == "__main__":
    raise SystemExit(main())
