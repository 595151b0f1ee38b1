"""Which microbatch counts a schedule takes (pure Python): one ``MicrobatchRule`` per schedule that restricts M.

The generator checks its own rule and the registry entry carries the same object, so the trainer's
config, ``modelpar simulate``, the sweep tables, the synthesis and the planner ask it before building.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ANY_MICROBATCHES", "MicrobatchRule"]


@dataclass(frozen=True)
class MicrobatchRule:
    """M ≥ max(1, ``least_per_rank``·K) and, with v > 1 chunks, M a multiple of K when ``multiple_of_ranks``."""

    least_per_rank: int = 0  # DualPipe-V pairs microbatches from both ends: 2
    multiple_of_ranks: bool = False  # interleaved: microbatches go through a chunk in groups of K

    def least(self, ranks: int) -> int:
        """The fewest microbatches at ``ranks`` K."""
        return max(1, self.least_per_rank * ranks)

    def step(self, ranks: int, chunks: int) -> int:
        """What M must be a multiple of at K ``ranks`` and v ``chunks``."""
        return ranks if self.multiple_of_ranks and chunks > 1 else 1

    def problem(self, name: str, microbatches: int, ranks: int, chunks: int, m_label: str = "microbatches",
                k_label: str = "ranks") -> str:
        """Why schedule ``name`` cannot take M ``microbatches`` at K ``ranks`` and v ``chunks`` ("" if it can);
        the labels name the arguments as the caller's user knows them (``--microbatches``, ``pp``)."""
        least = self.least(ranks)
        if microbatches < least:
            return (f"{m_label} must be >= {least}, got {microbatches} (schedule {name!r} needs "
                    f"{self.least_per_rank} x {k_label})")
        if microbatches % self.step(ranks, chunks):
            return f"{m_label} ({microbatches}) must be divisible by {k_label} ({ranks}) for schedule {name!r}"
        return ""

    def allows(self, microbatches: int, ranks: int, chunks: int) -> bool:
        """Whether M ``microbatches`` is taken at K ``ranks`` and v ``chunks``."""
        return not self.problem("", microbatches, ranks, chunks)

    def check(self, name: str, microbatches: int, ranks: int, chunks: int, m_label: str = "microbatches",
              k_label: str = "ranks") -> None:
        """Raise ValueError with ``problem``'s one line unless the count is taken."""
        message = self.problem(name, microbatches, ranks, chunks, m_label, k_label)
        if message:
            raise ValueError(message)


ANY_MICROBATCHES = MicrobatchRule()  # every M >= 1
