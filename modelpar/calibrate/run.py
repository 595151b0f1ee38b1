"""``calibrate``: measure this machine on the processes it trains with and build its hardware profile.

Locally (CPU, gloo) one ``LocalCluster`` per process count in ``ranks`` (default 1, 2, 4, …, up to
twice the cores) measures compute with every rank busy at once, each with the threads
``modelpar train`` gives it; the largest also measures the collectives of every group size.
On a GPU outside torchrun one process measures its device. Under torchrun the launched processes
measure (NCCL on GPUs): compute at the node's process count, collectives over every group size,
intra- or inter-node. The result is ``modelpar.costmodel.profiles.HardwareProfile``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from modelpar.calibrate.busy import BUSY_OPS, measure_busy
from modelpar.calibrate.comm import measure_collectives
from modelpar.calibrate.compute import (
    cpu_model,
    gemm_shapes,
    measure_attention,
    measure_elementwise,
    measure_matmul,
    measure_op_latency,
)
from modelpar.calibrate.layers import (
    QUICK_S,
    Grid,
    fit_optimizer,
    measure_blockwise,
    measure_compiled_layers,
    measure_ends,
    measure_layers,
    measure_optimizer,
    measure_runtime,
    measure_tp_layers,
    only_grid,
)
from modelpar.calibrate.machine_load import busier, cpu_busy_share
from modelpar.costmodel.profiles import HardwareProfile, installed_torch
from modelpar.training.dispatch import measure_launch

__all__ = ["PASSES", "RANKS_PER_CORE", "WHOLE_TABLES", "calibrate", "check_ranks", "default_ranks", "max_ranks",
           "mean_passes", "measure_rank", "measure_whole", "slowest"]


RANKS_PER_CORE = 2  # local process counts measured go up to this many per core (what sharing the cores costs)


def default_ranks(cores: int | None = None) -> list[int]:
    """1, 2, 4, … up to twice the cores (two ranks per core shows what sharing them costs)."""
    out, n = [], 1
    while n <= max_ranks(cores):
        out.append(n)
        n *= 2
    return out


def max_ranks(cores: int | None = None) -> int:
    """The most local processes calibrate starts: ``RANKS_PER_CORE`` per core of this machine (or ``cores``)."""
    return RANKS_PER_CORE * (cores or os.cpu_count() or 1)


def check_ranks(flag: str, ranks: list[int], cores: int | None = None) -> list[int]:
    """``ranks``, or a ValueError naming ``flag`` for a count above ``max_ranks`` (a run of minutes on shared cores)."""
    top = max_ranks(cores)
    if max(ranks, default=0) > top:
        raise ValueError(f"{flag} {max(ranks)}: at most {top} local processes on this machine's "
                         f"{cores or os.cpu_count() or 1} cores ({RANKS_PER_CORE} per core), got "
                         f"{','.join(map(str, ranks))}")
    return ranks


def measure_rank(dtypes: tuple[str, ...], threads: int | None, local_size: int, collectives: bool,
                 budget_s: float = 0.05, whole: bool = True, passes: int = 0, grid: Grid | None = None,
                 compiled: bool = False) -> dict[str, Any]:
    """Everything one rank measures (called on every rank of the group at once); ``whole``: the trainer's own
    work too (``layers.py``; locally only up to one process per core, the cost model shares cores beyond), in
    ``passes`` passes (0: ``PASSES``, one below ``QUICK_S``), at ``grid`` alone if given (``layers.only_grid``),
    with the compiled layer where ``compiled``."""
    with only_grid(grid):
        return _measure_rank(dtypes, threads, local_size, collectives, budget_s, whole, passes, compiled)


def _measure_rank(dtypes: tuple[str, ...], threads: int | None, local_size: int, collectives: bool,
                  budget_s: float, whole: bool, passes: int, compiled: bool) -> dict[str, Any]:
    if threads is not None:
        torch.set_num_threads(threads)
    device = _device()
    cuda = device.type == "cuda"
    shapes = gemm_shapes(device.type)
    out: dict[str, Any] = {
        "device": device.type,
        "name": torch.cuda.get_device_name(device) if cuda else cpu_model(),
        "memory": torch.cuda.get_device_properties(device).total_memory if cuda else _host_memory(),
        "matmul": {d: measure_matmul(d, device, shapes, budget_s) for d in dtypes},
        "attention": {d: measure_attention(d, device, 2 * budget_s) for d in dtypes},
        "elementwise_gbps": measure_elementwise(device, budget_s),
        "op_latency_s": measure_op_latency(device, budget_s),
        "launch_s": measure_launch(device, budget_s),
    }
    if whole:
        passes = passes or _passes(budget_s)
        out.update(mean_passes([_whole_work(dtypes, device, budget_s, compiled) for _ in range(passes)]))
    if dist.is_initialized() and dist.get_world_size() > 1:
        out["busy"] = measure_busy(device)
        if collectives:
            out["collectives"] = measure_collectives(device, local_size)
    return out


PASSES = 2  # the whole-work tables are measured this many times over, one pass after the other, and averaged


def _passes(budget_s: float) -> int:
    """``PASSES``, or one below ``QUICK_S`` (tests)."""
    return PASSES if budget_s >= QUICK_S else 1


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL, or outside a process group where there is one; else the CPU."""
    cuda = (dist.is_initialized() and dist.get_backend() == "nccl") or (not dist.is_initialized() and torch.cuda.is_available())
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _whole_work(dtypes: tuple[str, ...], device: torch.device, budget_s: float, compiled: bool = False) -> dict[str, Any]:
    """One pass over the trainer's own work (``layers.py``), the compiled layer too where ``compiled`` (compiled
    in the first pass; later passes find its graphs cached): a cell is measured within a fraction of a second,
    and a VM's speed drifts over seconds (one layer's forward 0.27 then 0.38 ms, 20 s apart), so each pass
    catches another moment and their mean another several."""
    out = {"layer": {d: measure_layers(d, device, budget_s) for d in dtypes},
           "ends": {d: measure_ends(d, device, budget_s) for d in dtypes},
           "blockwise": {d: measure_blockwise(d, device, budget_s) for d in dtypes},
           "runtime_s": measure_runtime(device, budget_s),
           "optimizer": measure_optimizer(device, budget_s)}
    if compiled:
        out["layer_compiled"] = {d: measure_compiled_layers(d, device, budget_s) for d in dtypes}
    if dist.is_initialized() and dist.get_world_size() > 1:  # pairs of ranks: the t = 2 layer, collectives in
        out["tp_layer"] = {d: measure_tp_layers(d, device, budget_s) for d in dtypes}
    return out


def _cell_mean(tables: list[Any]) -> Any:
    """The element-wise mean of equally shaped nested lists / dicts of numbers (key columns are equal, so kept)."""
    first = tables[0]
    if isinstance(first, dict):
        return {k: _cell_mean([t[k] for t in tables]) for k in first}
    if isinstance(first, list):
        return [_cell_mean(list(col)) for col in zip(*tables)]
    return sum(tables) / len(tables)


def mean_passes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole-work tables of several passes (``_whole_work``), each cell the mean of the passes'."""
    return _cell_mean(passes)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def measure_whole(dtypes: tuple[str, ...], threads: int, budget_s: float, grid: Grid | None = None,
                  compiled: bool = False) -> dict[str, Any]:
    """One more pass over the trainer's own work on this rank (``_whole_work``), at ``threads`` (and ``grid``)."""
    torch.set_num_threads(threads)
    with only_grid(grid):
        return _whole_work(dtypes, _device(), budget_s, compiled)


def _local(ranks: list[int], dtypes: tuple[str, ...], budget_s: float, grid: Grid | None = None,
           compiled: bool = False) -> dict[int, dict[str, Any]]:
    """Per process count: the measurements of a local gloo cluster of that many processes (``slowest``). The
    whole-work tables' passes go round the process counts in turn (1, 2, 4, then 1, 2 again): a VM drifts over
    minutes, and one process count's tables taken in one stretch priced its runs 19-47% too slow in one
    calibration while the other's were right; in turn, each count's tables span the whole calibration."""
    from modelpar.distributed import LocalCluster
    from modelpar.training.start import rank_threads

    found: dict[int, dict[str, Any]] = {}
    whole = [n for n in ranks if n <= (os.cpu_count() or 1)]
    passes = _passes(budget_s)
    with contextlib.ExitStack() as stack:
        # one process too runs in a cluster of its own: the trainer's step end is measured by training (a group)
        clusters = {n: stack.enter_context(LocalCluster(n, timeout=120.0, run_timeout=600.0)) for n in ranks}
        for n in ranks:
            found[n] = slowest(clusters[n].run(measure_rank, dtypes, rank_threads(n), n, n == max(ranks),
                                               budget_s, n in whole, 1, grid, compiled))
        tables = {n: [{k: found[n][k] for k in WHOLE_TABLES if k in found[n]}] for n in whole}
        for _ in range(passes - 1):
            for n in whole:
                tables[n].append(slowest(clusters[n].run(measure_whole, dtypes, rank_threads(n), budget_s, grid,
                                                         compiled)))
    for n in whole:
        found[n].update(mean_passes(tables[n]))
    return found


# the leading key columns of each whole-work table's rows
_KEYS = {"layer": 4, "layer_compiled": 4, "ends": 3, "blockwise": 4, "tp_layer": 5}
WHOLE_TABLES = (*_KEYS, "runtime_s", "optimizer")  # what ``_whole_work`` measures


def slowest(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's measurements with the whole-work tables of the slowest rank, cell by cell: a synchronous step
    goes at its slowest rank's pace, and the cores of a VM need not be equally fast (two processes' plain
    stage forwards: 5.6 against 4.1 ms at one moment, 4.8 against 4.9 at another). The optimizer's rows too,
    before they are fitted (the worst of each rank's fitted terms combined one rank's latency with another's
    bandwidth: 0.67 to 3.2 GB/s in six calibrations of one machine)."""
    out = dict(ranks[0])
    for name, keys in _KEYS.items():
        if name in out:  # a rank that measured none of a table (no t = 2 partner) has no say in it
            out[name] = {d: [[*rows[0][:keys], *(max(col) for col in zip(*(r[keys:] for r in rows)))]
                             for rows in zip(*(m[name][d] for m in ranks if m[name][d]))] for d in out[name]}
    if "runtime_s" in out:
        out["runtime_s"] = [max(col) for col in zip(*(m["runtime_s"] for m in ranks))]
    if "optimizer" in out:
        out["optimizer"] = [[*rows[0][:2], max(r[2] for r in rows)] for rows in zip(*(m["optimizer"] for m in ranks))]
    return out


def calibrate(ranks: list[int] | None = None, dtypes: tuple[str, ...] | None = None, budget_s: float = 0.05,
              name: str | None = None, grid: Grid | None = None, compiled: bool = False) -> HardwareProfile:
    """Measure this machine and return its profile (see the module docstring for which processes measure); the
    whole-work tables at ``grid`` alone if given (one run's shapes: ``calibrate.cache``); the layer under
    ``--compile`` too where ``compiled`` (``layer_compiled``)."""
    from modelpar.distributed import init_from_env, is_torchrun

    busy: float | None = None  # the share of the CPUs other work keeps busy (unknown under torchrun)
    if is_torchrun():
        init_from_env(timeout=300.0)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        cuda = dist.get_backend() == "nccl"
        dtypes = dtypes or (("bf16", "fp32") if cuda else ("fp32",))
        mine = measure_rank(dtypes, None, local, True, budget_s, grid=grid, compiled=compiled)
        found = {local: mine}
        backend = str(dist.get_backend())
    else:
        before = cpu_busy_share()  # before any process of ours starts
        if torch.cuda.is_available():
            dtypes = dtypes or ("bf16", "fp32")
            found, backend = {1: measure_rank(dtypes, None, 1, False, budget_s, grid=grid, compiled=compiled)}, "nccl"
        else:
            dtypes = dtypes or ("fp32",)
            found, backend = _local(ranks or default_ranks(), dtypes, budget_s, grid, compiled), "gloo"
        busy = busier(before, cpu_busy_share())  # ours have ended: what still runs is other work
    return replace(build_profile(found, backend, name), cpu_busy=busy)


def _per_dtype(found: dict[int, dict[str, Any]], name: str, dtypes: list[str]) -> dict[str, dict[str, Any]]:
    """dtype -> str(process count) -> the rows of table ``name`` where measured ({} where never)."""
    if not any(name in m for m in found.values()):
        return {}
    return {d: {str(n): m[name][d] for n, m in found.items() if name in m} for d in dtypes}


def build_profile(found: dict[int, dict[str, Any]], backend: str, name: str | None = None) -> HardwareProfile:
    """The profile of per-process-count measurements (``measure_rank``'s dicts)."""
    first = found[min(found)]
    measured = [m["collectives"] for _, m in sorted(found.items(), reverse=True) if "collectives" in m]
    collectives: dict[str, Any] = measured[0] if measured else {}
    p2p = [fit[1] for link in collectives.get("p2p", {}).values() for fit in link.values()]
    dtypes = list(first["matmul"])
    return HardwareProfile(
        name=name or f"{platform.node() or 'host'}-{first['device']}",
        device="cuda" if first["device"] == "cuda" else "cpu",
        backend=backend,
        memory_gb=first["memory"] / 1e9,
        devices_per_node=max(found),
        peak_tflops={d: max(pt[3] for pt in first["matmul"][d]) for d in dtypes},
        intra_node_gbps=p2p[0] if p2p else 1.0,
        inter_node_gbps=p2p[-1] if p2p else 1.0,
        hbm_tb_s=first["elementwise_gbps"] / 1e3,
        torch=installed_torch() or torch.__version__,  # what check_torch compares with
        host=f"{platform.node()} ({first['name']}), {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        cores=os.cpu_count() or 0,
        matmul={d: {str(n): m["matmul"][d] for n, m in found.items()} for d in dtypes},
        attention={d: {str(n): m["attention"][d] for n, m in found.items()} for d in dtypes},
        elementwise_gbps={str(n): m["elementwise_gbps"] for n, m in found.items()},
        op_latency_s={str(n): m["op_latency_s"] for n, m in found.items()},
        launch_s={str(n): m["launch_s"] for n, m in found.items() if "launch_s" in m},
        collectives=collectives,
        layer=_per_dtype(found, "layer", dtypes),
        layer_compiled=_per_dtype(found, "layer_compiled", dtypes),
        ends=_per_dtype(found, "ends", dtypes),
        blockwise=_per_dtype(found, "blockwise", dtypes),
        tp_layer=_per_dtype(found, "tp_layer", dtypes),
        runtime_s={str(n): m["runtime_s"] for n, m in found.items() if "runtime_s" in m},
        optimizer={str(n): fit_optimizer(m["optimizer"]) for n, m in found.items() if "optimizer" in m},
        step_end_measured=first["device"] == "cpu" and any("optimizer" in m for m in found.values()),
        busy={op: {str(n): m["busy"][op] for n, m in found.items() if "busy" in m} for op in BUSY_OPS
              if any("busy" in m for m in found.values())},
    )
