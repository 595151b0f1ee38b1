"""Chrome trace JSON (the format chrome://tracing, Perfetto and torch.profiler use).

One process per timeline, one thread per rank, one complete event (``"ph": "X"``) per
action; cross-rank dependencies become flow arrows (``"s"`` at the producer's end, ``"f"``
at the consumer's start), so the sends and receives the schedule implies are visible. A
rank's data-parallel collectives (``Timeline.comm``) go on a thread of their own, "Device d
dp comm".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from modelpar.simulate.tables import label
from modelpar.simulate.timeline import Timeline

__all__ = ["chrome_trace", "write_trace"]


def chrome_trace(timelines: Sequence[Timeline], us_per_unit: float | None = None) -> dict:
    """The trace as a dict with ``traceEvents``; one time unit becomes ``us_per_unit`` µs.

    By default each timeline's own unit decides (``Timeline.us_per_unit``): measured times in
    s/ms/µs keep their real length, a simulated forward unit is drawn as 1 ms. A number given
    here applies to every timeline.
    """
    if us_per_unit is not None and not us_per_unit > 0:
        raise ValueError(f"us_per_unit must be > 0, got {us_per_unit}")
    events: list[dict] = []
    flow_id = 0
    for pid, tl in enumerate(timelines):
        scale = tl.us_per_unit if us_per_unit is None else us_per_unit
        name = label(tl.name or f"timeline {pid}", tl.chunks)
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        where: dict = {}
        for d in range(tl.num_ranks):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": d, "args": {"name": f"Device {d}"}})
            for a, s, e in zip(tl.actions[d], tl.starts[d], tl.ends[d]):
                where[a] = (d, s, e)
                events.append({
                    "name": tl.token(a), "cat": a.kind.value, "ph": "X", "pid": pid, "tid": d,
                    "ts": s * scale, "dur": (e - s) * scale,
                    "args": {"stage": a.stage, "kind": a.kind.value, "microbatch": a.microbatch},
                })
            if tl.comm[d]:
                tid = tl.num_ranks + d
                events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                               "args": {"name": f"Device {d} dp comm"}})
                events += [{"name": what, "cat": "dp", "ph": "X", "pid": pid, "tid": tid, "ts": s * scale,
                            "dur": (e - s) * scale} for what, s, e in tl.comm[d]]
        if tl.schedule is None:
            continue
        for d, acts in enumerate(tl.actions):
            for a, s in zip(acts, tl.starts[d]):
                for dep in tl.schedule.dependencies(a):
                    if dep in where and where[dep][0] != d:
                        flow_id += 1
                        src_d, _, src_end = where[dep]
                        common = {"name": "transfer", "cat": "transfer", "id": flow_id, "pid": pid}
                        events.append({**common, "ph": "s", "tid": src_d, "ts": src_end * scale})
                        events.append({**common, "ph": "f", "bp": "e", "tid": d, "ts": s * scale})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(timelines: Sequence[Timeline], path: str | Path, us_per_unit: float | None = None) -> Path:
    """Write ``chrome_trace(timelines)`` as JSON to ``path``; return the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timelines, us_per_unit)))
    return path
