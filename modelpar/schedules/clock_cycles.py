"""GPipe's clock-cycle order (torchgpipe, reference §2.2): which (microbatch, stage) pairs run in each wave."""

from __future__ import annotations

from collections.abc import Iterator

from modelpar._validate import check_int


def clock_cycles(
    num_batches: int | None = None,
    num_partitions: int | None = None,
    *,
    microbatches: int | None = None,
    stages: int | None = None,
) -> Iterator[list[tuple[int, int]]]:
    """Yield the waves of the forward pass: wave k holds every (i, j) with i + j = k.

    Called as the reference and HW5 call it, ``clock_cycles(num_batches, num_partitions)``
    (``clock_cycles(3, 3)``), or by keyword as ``clock_cycles(microbatches=M, stages=K)``.
    Microbatch i on stage j must wait for (i, j - 1) (data) and (i - 1, j) (one rank does one
    thing at a time), so it starts at clock i + j at the earliest. Pairs are (microbatch, stage),
    stage ascending; there are M + K - 1 waves. For M = K = 3::

        k = 0: [(0, 0)]
        k = 1: [(1, 0), (0, 1)]
        k = 2: [(2, 0), (1, 1), (0, 2)]
        k = 3: [(2, 1), (1, 2)]
        k = 4: [(2, 2)]

    It is a generator: bad arguments raise ValueError on the first iteration, not at the call.
    """
    m = check_int("num_batches", _one_of("num_batches", num_batches, "microbatches", microbatches), minimum=0)
    n = check_int("num_partitions", _one_of("num_partitions", num_partitions, "stages", stages), minimum=1)
    for k in range(m + n - 1 if m else 0):
        yield [(k - j, j) for j in range(max(0, k - m + 1), min(k, n - 1) + 1)]


def _one_of(name: str, value: int | None, alias: str, alias_value: int | None) -> int:
    """The argument given under its reference name or its keyword alias, exactly once."""
    if (value is None) == (alias_value is None):
        raise ValueError(f"clock_cycles: give {name} (positionally) or {alias}=, exactly one of the two")
    return value if value is not None else alias_value  # type: ignore[return-value]
