"""GPipe's clock-cycle order (torchgpipe, reference §2.2): which (microbatch, stage) pairs run in each wave."""

from __future__ import annotations

from collections.abc import Iterator

from modelpar._validate import check_int


def clock_cycles(*, stages: int, microbatches: int) -> Iterator[list[tuple[int, int]]]:
    """Yield the waves of the forward pass: wave k holds every (i, j) with i + j = k.

    Microbatch i on stage j must wait for (i, j - 1) (data) and (i - 1, j) (one device does one
    thing at a time), so it starts at clock i + j at the earliest. Pairs are (microbatch, stage),
    stage ascending; there are M + K - 1 waves. For M = K = 3::

        k = 0: [(0, 0)]
        k = 1: [(1, 0), (0, 1)]
        k = 2: [(2, 0), (1, 1), (0, 2)]
        k = 3: [(2, 1), (1, 2)]
        k = 4: [(2, 2)]

    It is a generator: bad arguments raise ValueError on the first iteration, not at the call.
    """
    n = check_int("stages", stages, minimum=1)
    m = check_int("microbatches", microbatches, minimum=0)
    for k in range(m + n - 1 if m else 0):
        yield [(k - j, j) for j in range(max(0, k - m + 1), min(k, n - 1) + 1)]
