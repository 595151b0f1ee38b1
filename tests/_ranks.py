"""Rank processes a test may look for: those of local runs, not the shared clusters' (tests/cluster)."""

from multiprocessing import forkserver
from pathlib import Path

from modelpar.distributed import LocalCluster

# The session's shared clusters (tests/cluster/conftest.py): their ranks live on between tests by design.
SHARED_CLUSTERS: list[LocalCluster] = []


def rank_processes() -> list[int]:
    """Live children of multiprocessing's forkserver other than the shared clusters' ranks: the rank
    processes of local runs, which must all have exited once a run returns."""
    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    shared = {pid for cluster in SHARED_CLUSTERS for pid in cluster.pids}
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        pid = int(stat.parent.name)
        if server is not None and int(ppid) == server and state != "Z" and pid not in shared:
            found.append(pid)
    return found
