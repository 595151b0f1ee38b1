"""A pipeline schedule as data: the stage -> rank map and one ordered action list per pipeline rank.

Generators produce it, the simulator times it, the runtime executes it and the renderers draw
it. Communication is not written into it: it follows from dependencies that cross ranks, and
``modelpar.schedules.lower`` makes it explicit. ``overlapped`` marks DualPipe's F&B pairs
(``modelpar.schedules.overlap``): two consecutive actions of a rank run together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from modelpar._validate import check_int
from modelpar.schedules.action import Action, Kind
from modelpar.schedules.kinds import STYLES, inputs_of, producers, style_of
from modelpar.schedules.overlap import can_pair, format_pair, parse_pair


def contiguous_map(num_ranks: int) -> tuple[int, ...]:
    """Stage s on rank s: one stage per rank."""
    return tuple(range(check_int("num_ranks", num_ranks, minimum=1)))


def loop_map(num_ranks: int, chunks: int) -> tuple[int, ...]:
    """Megatron's interleaved ("loop") placement: rank d holds stages d, d + K, d + 2K, ..."""
    k = check_int("num_ranks", num_ranks, minimum=1)
    v = check_int("chunks", chunks, minimum=1)
    return tuple(s % k for s in range(k * v))


def v_map(num_ranks: int) -> tuple[int, ...]:
    """The V placement of ZB-V and DualPipe-V: 2K stages, rank d holds d and 2K − 1 − d."""
    k = check_int("num_ranks", num_ranks, minimum=1)
    return tuple(range(k)) + tuple(range(k - 1, -1, -1))


@dataclass(frozen=True, eq=True)
class Schedule:
    """Ordered actions per pipeline rank, with virtual stage ``s`` living on rank ``stage_to_rank[s]``.

    A rank is a position along the pipeline (0..K−1), a stage a virtual stage of the model (0..S−1,
    S = K·v); docs/notation.md lists the names and the old ones they replaced. ``overlapped[d]``
    holds the positions i on rank d where actions i and i + 1 are an overlapped F&B pair (empty: none).
    """

    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    name: str = ""
    overlapped: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if not self.actions:
            raise ValueError("a schedule needs at least one rank, got 0 action lists")
        for s, d in enumerate(self.stage_to_rank):
            if not 0 <= d < len(self.actions):
                raise ValueError(
                    f"stage {s} is mapped to rank {d}, but ranks are 0..{len(self.actions) - 1}"
                )
        pairs = tuple(tuple(sorted(p)) for p in self.overlapped) or tuple(() for _ in self.actions)
        if len(pairs) != len(self.actions):
            raise ValueError(f"overlapped must hold one tuple per rank ({len(self.actions)}), got {len(pairs)}")
        object.__setattr__(self, "overlapped", pairs)
        for d, (acts, starts) in enumerate(zip(self.actions, pairs)):
            for i, j in zip(starts, starts[1:]):
                if j < i + 2:
                    raise ValueError(f"overlapped pairs on rank {d} share an action (positions {i} and {j})")
            for i in starts:
                if not 0 <= i < len(acts) - 1 or not can_pair(acts[i], acts[i + 1]):
                    what = f"{acts[i]} and {acts[i + 1]}" if 0 <= i < len(acts) - 1 else "no two actions"
                    raise ValueError(f"overlapped pair at position {i} on rank {d}: {what}; a pair is a forward F "
                                     "followed by a backward (B or I)")
                if acts[i] in self.dependencies(acts[i + 1]):
                    raise ValueError(f"overlapped pair {format_pair(acts[i], acts[i + 1])} on rank {d}: its backward "
                                     "needs its forward's output, so the two cannot run together")

    # --- shape -----------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """Number of virtual stages (K · v with interleaving)."""
        return len(self.stage_to_rank)

    @property
    def chunks(self) -> int:
        """Model chunks per rank (v): 1 unless interleaved."""
        return max(1, self.num_stages // self.num_ranks)

    @cached_property
    def num_microbatches(self) -> int:
        return 1 + max((a.microbatch for acts in self.actions for a in acts), default=-1)

    @cached_property
    def style(self) -> tuple[Kind, ...]:
        """The kinds this schedule uses (``modelpar.schedules.kinds.STYLES``): (F,), (F, B) or (F, I, W).

        A schedule that mixes kinds of no single style (B with I) gets the largest; validation
        then names the action that does not belong.
        """
        return style_of({a.kind for acts in self.actions for a in acts}) or STYLES[-1]

    @cached_property
    def forward_only(self) -> bool:
        """True when the schedule has no backward at all (evaluation): each (stage, microbatch) gets F."""
        return self.style == STYLES[0]

    @cached_property
    def split_backward(self) -> bool:
        """True when the backward is split into I (input gradient) and W (weight gradient)."""
        return Kind.W in self.style

    @cached_property
    def _producer(self) -> dict:
        return producers(self.style)

    @property
    def has_overlap(self) -> bool:
        """True when some rank runs an overlapped F&B pair."""
        return any(self.overlapped)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds virtual stage ``stage``."""
        return self.stage_to_rank[stage]


    def stages_on(self, rank: int) -> list[int]:
        """The virtual stages rank ``rank`` holds, in model order."""
        return [s for s, d in enumerate(self.stage_to_rank) if d == rank]

    # --- dependencies ------------------------------------------------------------------------
    def dependencies(self, action: Action) -> list[Action]:
        """Actions that must finish before ``action`` can start (same rank or across).

        The producers of what ``action`` consumes (``kinds.SPECS``), within the model's stages.
        """
        m, last, made = action.microbatch, self.num_stages - 1, self._producer
        return [Action(s, made[v], m) for v, s in inputs_of(action.kind, action.stage) if 0 <= s <= last]

    def is_transfer(self, producer: Action, consumer: Action) -> bool:
        """True when ``consumer`` depends on ``producer`` across ranks (a send/recv)."""
        return self.rank_of(producer.stage) != self.rank_of(consumer.stage)

    # --- text form ---------------------------------------------------------------------------
    def to_text(self) -> str:
        """One line per rank, actions separated by spaces: ``0F0 0F1 0B0 ...``; a pair ``(0F3;7I1)OVERLAP_F_B``."""
        return "\n".join(" ".join(self._tokens(d)) for d in range(self.num_ranks))

    def _tokens(self, rank: int) -> list[str]:
        acts, pairs, out, i = self.actions[rank], set(self.overlapped[rank]), [], 0
        while i < len(acts):
            out.append(format_pair(acts[i], acts[i + 1]) if i in pairs else str(acts[i]))
            i += 2 if i in pairs else 1
        return out

    def __str__(self) -> str:
        return self.to_text()

    @classmethod
    def from_text(cls, text: str, name: str = "") -> Schedule:
        """Parse the text form; each stage's rank is the line its actions appear on.

        Blank lines and ``#`` comments are skipped; a line may start with ``rank N:``.
        """
        lines: list[list[Action]] = []
        pairs: list[list[int]] = []
        for raw in text.splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if ":" in line:
                line = line.split(":", 1)[1]
            acts: list[Action] = []
            starts: list[int] = []
            for tok in line.replace(",", " ").split():
                pair = parse_pair(tok)
                if pair is not None:
                    starts.append(len(acts))
                acts.extend(pair or (Action.parse(tok),))
            lines.append(acts)
            pairs.append(starts)
        return cls.from_actions(lines, name=name, overlapped=pairs)

    @classmethod
    def from_actions(cls, per_rank: Sequence[Iterable[Action]], name: str = "",
                     overlapped: Sequence[Iterable[int]] = ()) -> Schedule:
        """Build a schedule from action lists, inferring the stage -> rank map from them (``overlapped``:
        per rank, the positions of its F&B pairs' forwards)."""
        per_rank = [list(acts) for acts in per_rank]
        owner: dict[int, int] = {}
        for d, acts in enumerate(per_rank):
            for a in acts:
                if owner.setdefault(a.stage, d) != d:
                    raise ValueError(
                        f"stage {a.stage} appears on rank {owner[a.stage]} and rank {d} "
                        f"(action {a}); a stage lives on exactly one rank"
                    )
        num_stages = 1 + max(owner, default=-1)
        missing = [s for s in range(num_stages) if s not in owner]
        if missing:
            raise ValueError(f"stages {missing} have no actions; stages must be 0..{num_stages - 1}")
        return cls(tuple(owner[s] for s in range(num_stages)), tuple(map(tuple, per_rank)), name,
                   tuple(tuple(p) for p in overlapped))

    def validate(self) -> Schedule:
        """Check completeness, per-rank order and freedom from deadlock; return self."""
        from modelpar.schedules.validate import validate_schedule

        validate_schedule(self)
        return self
