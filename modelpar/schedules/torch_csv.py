"""torch.distributed.pipelining's schedule CSV: write a schedule for torch, read one from it (pure Python).

torch's ``_PipelineScheduleRuntime._load_csv`` (and torchtitan's ``pipeline_parallel_schedule_csv``)
read one row per rank, one cell per action in ``_Action``'s text: ``0F3`` (stage 0, forward,
microbatch 3), ``1I2`` / ``1W2`` (split backward), ``2B0`` (full backward); with
``format="compute_comms"`` also the sends and receives (``0SEND_F3``, ``1RECV_F3``, ...), which
our lowered programs already are. Our text form is torch's, so a cell is ``str(op)``.

An overlapped F&B pair (``Schedule.overlapped``) is written as torch writes DualPipeV's:
``(0F3;7B1)OVERLAP_F_B``, its I and the W right behind it as the full backward B they are
(``(0F3;7I1)OVERLAP_F_B`` when the W is elsewhere, and in ``compute_comms``, where the pair's
sends stand between its I and W); torch's runtime runs a pair's two actions one after the other.

Reading also takes what torch's own schedules write: empty cells (idle steps), overlapped pairs
(kept as pairs), and the data-parallel / FSDP actions
``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` (no part of the pipeline order: dropped). Sends and
receives are dropped too — ``lower`` derives them. A full backward B in a schedule that also
splits backwards (DualPipe-V) becomes I then W, the one style our schedules use. A blank line
(no cell, or only empty ones) is skipped, as in our text form: it is no rank (a trailing newline or
two must not add an idle one).
"""

from __future__ import annotations

import csv
import io
import re

from modelpar.schedules.action import Action, Kind
from modelpar.schedules.kinds import SPECS
from modelpar.schedules.lower import lower
from modelpar.schedules.overlap import format_pair, parse_pair
from modelpar.schedules.schedule import Schedule

__all__ = ["FORMATS", "from_csv", "to_csv"]

FORMATS = ("compute_only", "compute_comms")
_CELL = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")
_DROPPED = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


def to_csv(schedule: Schedule, comm: bool = False) -> str:
    """One row per rank: its actions (``compute_only``) or its lowered program (``compute_comms``).

    ``compute_comms`` is what torch's own lowering writes: the program, and ``<stage>REDUCE_GRAD``
    after each stage's last weight-gradient action (B or W) and its sends — where torch scales the gradients
    by 1/M and would reduce them over data parallelism; without it torch leaves them M times larger.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for d, ops in enumerate(lower(schedule) if comm else schedule.validate().actions):
        cells = [str(op) for op in ops]
        if comm:
            last = {op.stage: i for i, op in enumerate(ops) if isinstance(op, Action) and SPECS[op.kind].weight_grads}
            for stage, i in sorted(last.items(), key=lambda x: -x[1]):
                while i + 1 < len(ops) and "SEND" in cells[i + 1]:  # after the action's own sends, as torch
                    i += 1
                cells.insert(i + 1, f"{stage}REDUCE_GRAD")
        writer.writerow(_pair_cells(cells, schedule, d))
    return out.getvalue()


def _pair_cells(cells: list[str], schedule: Schedule, rank: int) -> list[str]:
    """Rank ``rank``'s cells with each overlapped pair in one cell; an I with its W right behind as B."""
    acts = schedule.actions[rank]
    pairs = {str(acts[i]): (acts[i], acts[i + 1]) for i in schedule.overlapped[rank]}
    out: list[str] = []
    i = 0
    while i < len(cells):
        first, second = pairs.get(cells[i], (None, None))
        if first is None or second is None or i + 1 >= len(cells) or cells[i + 1] != str(second):
            out.append(cells[i])
            i += 1
            continue
        whole = Action(second.stage, Kind.W, second.microbatch)
        merge = second.kind is Kind.I and i + 2 < len(cells) and cells[i + 2] == str(whole)
        out.append(format_pair(first, Action(second.stage, Kind.B, second.microbatch) if merge else second))
        i += 3 if merge else 2
    return out


def from_csv(text: str, name: str = "") -> Schedule:
    """The schedule a torch schedule CSV describes (row r = rank r); ValueError naming the first bad cell."""
    per_rank: list[list[tuple[Action, bool]]] = []  # (action, the forward of an overlapped pair)
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        if not any(cell.strip() for cell in row):
            continue  # a blank line is no rank (as in the text form): an empty row would be an idle rank
        acts: list[tuple[Action, bool]] = []
        for c, cell in enumerate(row):
            acts.extend(_cell(cell.strip(), r, len(per_rank), c))
        per_rank.append(acts)
    split = any(a.kind in (Kind.I, Kind.W) for acts in per_rank for a, _ in acts)
    lines: list[list[Action]] = []
    pairs: list[list[int]] = []
    for acts in per_rank:
        line: list[Action] = []
        starts: list[int] = []
        for a, first in acts:
            if first:
                starts.append(len(line))
            if split and a.kind is Kind.B:  # a full backward among split ones: I then W (a pair's: the pair is F, I)
                line += [Action(a.stage, Kind.I, a.microbatch), Action(a.stage, Kind.W, a.microbatch)]
            else:
                line.append(a)
        lines.append(line)
        pairs.append(starts)
    return Schedule.from_actions(lines, name=name, overlapped=pairs)


def _cell(cell: str, row: int, rank: int, column: int) -> list[tuple[Action, bool]]:
    if not cell:
        return []
    if cell.startswith("(") and cell.endswith(")OVERLAP_F_B"):
        try:
            pair = parse_pair(cell)
        except ValueError:
            pair = None
        if pair is None:
            raise ValueError(f"CSV row {row} (rank {rank}), column {column}: {cell!r} is not an overlapped pair "
                             "(<stage>F<microbatch>;<stage><B|I><microbatch>)OVERLAP_F_B")
        return [(pair[0], True), (pair[1], False)]
    match = _CELL.match(cell)
    if match is None or (match[2] in "FIBW" and not match[3]):
        raise ValueError(f"CSV row {row} (rank {rank}), column {column}: {cell!r} is not an action of torch's "
                         f"schedule CSV (<stage><F|I|B|W><microbatch>, a SEND/RECV, UNSHARD, RESHARD, "
                         f"REDUCE_GRAD or (a;b)OVERLAP_F_B)")
    if match[2] in _DROPPED:
        return []
    return [(Action(int(match[1]), Kind(match[2]), int(match[3])), False)]
