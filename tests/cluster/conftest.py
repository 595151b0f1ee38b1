"""Cluster tests start real ranks over gloo. The ranks are shared: one cluster per world size per pytest-xdist
worker, started the first time a test asks for it and kept for every module after (starting four ranks costs
seconds of a 2-core machine). A failed run ends its cluster's ranks; the next run starts them again.

A test leaves the ranks as it found them: a function run on them restores what it changes (default dtype,
threads, seeds are set by the functions that depend on them, as every rank function of the suite does)."""

from collections.abc import Iterator

import pytest

from modelpar.distributed import LocalCluster
from tests._ranks import SHARED_CLUSTERS

# Bounds each collective inside the ranks: generous, for a loaded 2-core machine and the compile tests'
# first graphs; a rank that dies is still noticed at once.
COLLECTIVE_TIMEOUT = 300


def _cluster(world_size: int) -> Iterator[LocalCluster]:
    with LocalCluster(world_size, timeout=COLLECTIVE_TIMEOUT) as cluster:
        SHARED_CLUSTERS.append(cluster)  # its ranks are not a run's leftovers (tests/_ranks.py)
        try:
            yield cluster
        finally:
            SHARED_CLUSTERS.remove(cluster)


@pytest.fixture(scope="session")
def c1() -> Iterator[LocalCluster]:
    yield from _cluster(1)


@pytest.fixture(scope="session")
def c2() -> Iterator[LocalCluster]:
    yield from _cluster(2)


@pytest.fixture(scope="session")
def c4() -> Iterator[LocalCluster]:
    yield from _cluster(4)


@pytest.fixture(scope="session")
def c8() -> Iterator[LocalCluster]:
    yield from _cluster(8)
