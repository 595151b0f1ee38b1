"""Rank processes a test may look for: those of local runs, not the shared clusters' (tests/cluster); and the
process table (`processes`, `descendants`, `alive`) the launcher and stopping tests read."""

import os
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


def processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, name) of every process, from /proc."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read().decode(errors="replace")
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            out[int(pid)] = (int(ppid), state, name)
    return out


def descendants(pid: int) -> dict[int, str]:
    """pid -> name of every live process below ``pid``."""
    table, found, frontier = processes(), {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, state, name) in table.items():
            if ppid == parent and state != "Z" and child not in found:
                found[child] = name
                frontier.append(child)
    return found


def alive(pids) -> list[int]:
    table = processes()
    return [p for p in pids if p in table and table[p][1] != "Z"]
