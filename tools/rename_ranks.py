"""Codemod for issue 27: a pipeline position is a *rank*, *stage* a (virtual) stage of the model, *device* a torch.device.

    python tools/rename_ranks.py            # rewrite modelpar/, tests/, examples/, benchmarks/, docs/ in place
    python tools/rename_ranks.py --check    # list the files it would change; exit 1 if any

Idempotent: a second run changes nothing. Run it again after merging a branch written with the old
names. What it renames (docs/notation.md has the table; the deprecated aliases of the old names were
removed in issue 37; a line carrying the marker ``rename: keep`` is still left alone):

1. Everywhere (identifiers, comments, docstrings, messages; Markdown too): ``num_devices`` ->
   ``num_ranks``, ``device_of`` -> ``rank_of``, ``stage_to_device`` -> ``stage_to_rank``,
   ``bubble_per_device`` -> ``bubble_per_rank``, ``per_device`` -> ``per_rank``, ``on_one_device``
   -> ``on_one_rank``. A string literal that is exactly an output key (``DATA_KEYS``) is kept.
2. In the pure layers (modelpar/schedules, modelpar/simulate), identifiers only: ``device`` ->
   ``rank``, ``devices`` -> ``ranks`` (there a device is always a pipeline rank; prose is left).
3. ``stages`` meaning K (pipeline ranks, not the S = K·v virtual stages): the keyword in calls to
   the schedule generators, ``get_schedule`` and the synthesis/sweep functions (``K_CALLS``); their
   parameter and its uses inside their bodies (``K_DEFS``), with the argument-name strings of their
   checks. Python's ``ast`` finds them, so ``Pipe(stages, ...)``, ``num_stages``, ``stage_layers``
   and every other ``stages`` are left alone.
4. ``modelpar simulate --stages`` -> ``--ranks``: in the command, its tests, and Markdown lines that
   run ``modelpar simulate``.
5. A pipeline rank called ``device`` outside the pure layers, function by function (``SCOPED``:
   ``split_stages``' parameter, ``dry_run``'s loop variable), and a few one-off texts (``EXTRA``: the
   messages whose wording names the renamed argument, and the tests that match them).
6. The layers per rank: ``device_layers`` -> ``rank_layers`` (``modelpar.layer_split``, the planner's
   ``Estimate``), ``device_loads`` -> ``rank_loads`` (``modelpar.costmodel.stages``); the JSON key
   ``"device_layers"`` stays (``DATA_KEYS``; ``"rank_layers"`` is written beside it).
7. Prose: "device" and "devices" for a pipeline rank in the comments, docstrings and messages of the
   pure layers and of the split's modules (``PROSE``), and "Device d" where a docstring speaks of rank
   d; in the strings of their tests (``PROSE_TESTS``), which match those messages. The charts' row
   labels ("Device 0 |", as the reference text draws them) are not prose and stay.
8. The lowering's channel model: ``rendezvous(..., channel="device")`` -> ``channel="rank"`` (``LITERALS``).

Not renamed (docs/notation.md says why): ``clock_cycles``' and ``Pipe``'s reference names, the
one-chunk closed forms' ``stages``, ``modelpar bench pipeline/microbatch --stages``,
``StageCosts.stages`` (the K whole stages, model segments, whose costs chunking divides), the charts'
"Device d" rows, and prose saying "device" for a rank outside ``PROSE``.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("modelpar", "tests", "examples", "benchmarks", "docs")
SKIP = {"docs/notation.md", "tests/unit/test_renamed_names.py"}  # hand-written: old names on purpose
KEEP = "rename: keep"

EVERYWHERE = {
    "num_devices": "num_ranks", "device_of": "rank_of", "stage_to_device": "stage_to_rank",
    "bubble_per_device": "bubble_per_rank", "per_device": "per_rank", "on_one_device": "on_one_rank",
    "_dualpipe_device": "_dualpipe_rank", "device_layers": "rank_layers", "device_loads": "rank_loads",
}
DATA_KEYS = {"bubble_per_device", "device_layers"}  # `simulate --json`'s and `plan --json`'s keys: scripts read them
PURE = ("modelpar/schedules/", "modelpar/simulate/")
IN_PURE = {"device": "rank", "devices": "ranks"}
PROSE = PURE + ("modelpar/layer_split.py", "modelpar/costmodel/stages.py")  # where "device" in prose is a rank
_PROSE_WORDS = re.compile(r"\b(devices|device)\b|(?<![\"'])\bDevice(?= (?:d\b|``d``))")
LITERALS = {'channel="device"': 'channel="rank"'}  # in every file (Markdown too)
PROSE_TESTS = {f"tests/test_{name}.py" for name in (  # their strings match the pure layers' messages and tables
    "schedules", "schedules_family", "schedules_properties", "lower", "torch_csv", "cli_simulate", "synthesis",
    "render", "simulator", "kinds")}

GENERATORS = {"naive", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "looped_bfs",
              "zb_h2", "zb_v", "v_half", "v_min", "dualpipe_v"}
K_CALLS = GENERATORS | {"get_schedule", "candidates", "synthesize", "sweep", "sweep_table",
                        "gen"}  # ``gen``: a test's parameter that runs through generators
K_DEFS = {
    "modelpar/schedules/generators.py": GENERATORS | {"get_schedule", "_counts"},
    "modelpar/schedules/zero_bubble.py": GENERATORS | {"_counts"},
    "modelpar/simulate/synthesis.py": {"candidates", "synthesize"},
    "modelpar/simulate/tables.py": {"sweep", "sweep_table"},
}
SCOPED = {  # (file, function): {old: new} for a parameter or local variable and its uses, the pure layers' rule elsewhere
    ("modelpar/pipeline/stages.py", "split_stages"): {"device": "rank"},
    ("modelpar/pipeline/shapes.py", "dry_run"): {"device": "rank"},
}
SIMULATE_CLI = {"modelpar/commands/simulate.py", "tests/cli/test_cli_simulate.py"}
EXTRA = {  # one-off uses the rules above cannot see: an Event's rank read outside the pure layers; the flag's value
    "tests/cluster/test_pipeline_runtime_units.py": [(re.compile(r"\be\.device\b"), "e.rank")],
    "tests/unit/test_train_config.py": [(re.compile(r"two stages per device"), "two stages per rank")],  # check_chunks
    "tests/cli/test_train_cli.py": [(re.compile(r'"device \(the least any schedule'), '"rank (the least any schedule')],  # synthesize
    "tests/cluster/test_pipeline_runtime.py": [(re.compile(r"\b(but |hang: )device (\d)"), r"\1rank \2"),  # lower's hang message
                                       (re.compile(r"; device (\d) waits at"), r"; rank \1 waits at")],
    "modelpar/commands/simulate.py": [(re.compile(r"\bargs\.stages\b"), "args.ranks"),
                                      (re.compile(r'f"device \{d\}: '), 'f"rank {d}: ')],  # --comm's programs
    "modelpar/schedules/zero_bubble.py": [(re.compile(r"2 x stages"), "2 x ranks")],
    "modelpar/simulate/timeline.py": [(re.compile(r"Device ``device``"), "Rank ``rank``"),
                                      (re.compile(r"event device must"), "event rank must")],
    "tests/unit/test_simulator.py": [(re.compile(r"event device must"), "event rank must")],
    "tests/unit/test_schedules.py": [(re.compile(r"2 x stages"), "2 x ranks"),
                                (re.compile(r'r"stages must be'), 'r"ranks must be'),
                                (re.compile(r"divisible by stages"), "divisible by ranks")],
}

_WORDS = re.compile(r"\b(" + "|".join(map(re.escape, EVERYWHERE)) + r")\b")
_K_MD = re.compile(r"\b((?:" + "|".join(sorted(K_CALLS)) + r")\([^()]*?)\bstages=")


def _everywhere(text: str) -> str:
    return _WORDS.sub(lambda m: EVERYWHERE[m.group(1)], text)


def _prose(text: str) -> str:
    """device -> rank, devices -> ranks; "Device d" (rank d in a docstring) -> "Rank d"."""
    return _PROSE_WORDS.sub(lambda m: {"device": "rank", "devices": "ranks"}.get(m.group(1) or "", "Rank"), text)


def _literals(line: str) -> str:
    for old, new in LITERALS.items():
        line = line.replace(old, new)
    return line


def _fstring_names(text: str, names: dict[str, str]) -> str:
    """Rename identifiers inside an f-string's ``{...}`` fields (Python 3.11 tokenizes an f-string as one STRING)."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    parts = re.split(r"(\{\{|\}\})", text)  # doubled braces are literal text, not fields
    return "".join(part if part in ("{{", "}}") else
                   re.sub(r"\{[^{}]*\}", lambda f: pattern.sub(lambda m: names[m.group(1)], f.group(0)), part)
                   for part in parts)


def _is_fstring(token: str) -> bool:
    return "f" in token[: token.find(token[-1])].lower()


def _scoped_edits(source: str, rel: str) -> dict[tuple[int, int], tuple[str, str]]:
    """(line, column) -> (old, new) for each scoped name: ``stages`` meaning K (keywords of K_CALLS,
    parameters and names in K_DEFS) and the SCOPED parameters and locals."""
    tree = ast.parse(source)
    lines = source.splitlines()
    at: dict[tuple[int, int], tuple[str, str]] = {}

    def add(node: ast.AST, old: str, new: str, offset: int = 0) -> None:
        line = lines[node.lineno - 1]  # type: ignore[attr-defined]
        col = len(line.encode()[: node.col_offset].decode()) + offset  # type: ignore[attr-defined]  # ast counts bytes
        at[node.lineno, col] = (old, new)  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            built = isinstance(f, ast.Subscript) and isinstance(f.value, ast.Name) and f.value.id == "_BUILD"
            if name in K_CALLS or built:
                for kw in node.keywords:
                    if kw.arg == "stages":
                        add(kw, "stages", "ranks")
        if not isinstance(node, ast.FunctionDef):
            continue
        renames = dict(SCOPED.get((rel, node.name), {}))
        if node.name in K_DEFS.get(rel, ()):
            renames["stages"] = "ranks"
        every = node.args.args + node.args.kwonlyargs + node.args.posonlyargs
        for old, new in renames.items():
            if old == "stages" and not any(a.arg == old for a in every):
                continue  # a generator's helper without the parameter: its ``stages`` is something else
            for a in every:
                if a.arg == old:
                    add(a, old, new)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and sub.id == old:
                    add(sub, old, new)  # an f-string's names too: ast gives their place inside it
                if isinstance(sub, ast.Constant) and sub.value == old:
                    add(sub, old, new, offset=1)  # the argument's name in a check's message, inside the quote
    return at


def rewrite_python(source: str, rel: str) -> str:
    scoped = _scoped_edits(source, rel)
    names = dict(EVERYWHERE, **(IN_PURE if rel.startswith(PURE) else {}))
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, int, str]] = []  # start line and column, end line and column, replacement
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        (row, col), (erow, ecol) = tok.start, tok.end
        if row > len(lines) or KEEP in lines[row - 1]:
            continue
        new = tok.string
        if tok.type == tokenize.NAME:
            new = names.get(tok.string, tok.string)
            old, renamed = scoped.get((row, col), ("", ""))
            if tok.string == old:
                new = renamed
        elif tok.type == tokenize.COMMENT:
            new = _everywhere(tok.string)
            if rel.startswith(PROSE):
                new = _prose(new)
        elif tok.type == tokenize.STRING:
            literal = re.fullmatch(r"[rbuRBUfF]*('{3}|\"{3}|'|\")(.*)\1", tok.string, re.S)
            if literal and literal.group(2) in DATA_KEYS:
                continue
            inside = sorted((c - col, *scoped[r, c]) for r, c in scoped if r == row == erow and col < c < ecol)
            if inside:  # an argument's name in a check's message, or a field of an f-string
                for at, old, renamed in reversed(inside):
                    if new[at:at + len(old)] == old:
                        new = new[:at] + renamed + new[at + len(old):]
            else:
                new = _everywhere(tok.string)
                if _is_fstring(tok.string):
                    new = _fstring_names(new, names)
                if rel in SIMULATE_CLI:
                    new = re.sub(r"--stages\b", "--ranks", new)
            if rel.startswith(PROSE) or rel in PROSE_TESTS:
                new = _prose(new)
        if new != tok.string:
            edits.append((row, col, erow, ecol, new))
    return _apply(lines, edits, rel)


def _apply(lines: list[str], edits: list[tuple[int, int, int, int, str]], rel: str) -> str:
    text = "".join(lines)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    for row, col, erow, ecol, new in sorted(edits, reverse=True):
        text = text[: starts[row - 1] + col] + new + text[starts[erow - 1] + ecol:]
    for pattern, repl in EXTRA.get(rel, ()):
        text = "".join(line if KEEP in line else pattern.sub(repl, line) for line in text.splitlines(keepends=True))
    return "".join(line if KEEP in line else _literals(line) for line in text.splitlines(keepends=True))


def rewrite_markdown(text: str) -> str:
    out = []
    for line in text.splitlines(keepends=True):
        if KEEP not in line:
            line = _literals(_everywhere(line))
            while _K_MD.search(line):
                line = _K_MD.sub(r"\1ranks=", line)
            if "modelpar simulate" in line:
                line = re.sub(r"--stages\b", "--ranks", line)
        out.append(line)
    return "".join(out)


def files() -> list[Path]:
    found = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if path.suffix in (".py", ".md") and path.is_file() and rel not in SKIP and "__pycache__" not in rel:
                found.append(path)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list what would change; write nothing")
    args = parser.parse_args(argv)
    changed = []
    for path in files():
        rel = path.relative_to(ROOT).as_posix()
        old = path.read_text()
        new = rewrite_python(old, rel) if path.suffix == ".py" else rewrite_markdown(old)
        if new != old:
            changed.append(rel)
            if not args.check:
                path.write_text(new)
    for rel in changed:
        print(("would change " if args.check else "changed ") + rel)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
