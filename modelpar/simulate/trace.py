"""Chrome trace JSON (the format chrome://tracing, Perfetto and torch.profiler use).

One process per timeline, one thread per device, one complete event (``"ph": "X"``) per
action; cross-device dependencies become flow arrows (``"s"`` at the producer's end, ``"f"``
at the consumer's start), so the sends and receives the schedule implies are visible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from modelpar.simulate.report import label
from modelpar.simulate.timeline import Timeline

__all__ = ["chrome_trace", "write_trace"]


def chrome_trace(timelines: Sequence[Timeline], us_per_unit: float = 1000.0) -> dict:
    """The trace as a dict with ``traceEvents``; one time unit becomes ``us_per_unit`` µs.

    Simulated times are in forward units (default: 1 unit = 1 ms); pass 1e6 for a measured
    timeline in seconds.
    """
    if not us_per_unit > 0:
        raise ValueError(f"us_per_unit must be > 0, got {us_per_unit}")
    events: list[dict] = []
    flow_id = 0
    for pid, tl in enumerate(timelines):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label(tl.name or f"timeline {pid}", tl.chunks)}})
        where: dict = {}
        for d in range(tl.num_devices):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": d, "args": {"name": f"Device {d}"}})
            for a, s, e in zip(tl.actions[d], tl.starts[d], tl.ends[d]):
                where[a] = (d, s, e)
                events.append({
                    "name": tl.token(a), "cat": a.kind.value, "ph": "X", "pid": pid, "tid": d,
                    "ts": s * us_per_unit, "dur": (e - s) * us_per_unit,
                    "args": {"stage": a.stage, "kind": a.kind.value, "microbatch": a.microbatch},
                })
        if tl.schedule is None:
            continue
        for d, acts in enumerate(tl.actions):
            for a, s in zip(acts, tl.starts[d]):
                for dep in tl.schedule.dependencies(a):
                    if dep in where and where[dep][0] != d:
                        flow_id += 1
                        src_d, _, src_end = where[dep]
                        common = {"name": "transfer", "cat": "transfer", "id": flow_id, "pid": pid}
                        events.append({**common, "ph": "s", "tid": src_d, "ts": src_end * us_per_unit})
                        events.append({**common, "ph": "f", "bp": "e", "tid": d, "ts": s * us_per_unit})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timelines: Sequence[Timeline], path: str | Path, us_per_unit: float = 1000.0) -> Path:
    """Write ``chrome_trace(timelines)`` as JSON to ``path``; return the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timelines, us_per_unit)))
    return path
