"""Hardware profiles: what the cost model knows about a machine, as versioned JSON (pure Python, no torch).

A profile is either *measured* (``modelpar calibrate`` writes one: matmul throughput over the GEMM
shapes a transformer layer uses, per dtype; attention and element-wise throughput; latency and
bandwidth of every collective per group size and link) or a *table* entry, one per named GPU node
(``presets.GPUS``), in the same form: the data-sheet peak, the efficiency curve's ceiling, HBM and
link bandwidths, no measured points. The cost model reads measured numbers where a profile has
them and the named assumptions (``assumptions.py``) where it has not, so a table profile predicts
exactly what the named GPU did before.

``busy`` holds a pair's message and collectives as training issues them (right after compute, with
every process of the node busy: a blocked receiver's wake-up, the partner's late arrival, waiting
for a core when ranks outnumber cores; ``calibrate/busy.py``), keyed by the process count.
Compute tables are keyed by ``ranks``: how many training processes share the node while measuring
(a CPU's cores are split between them, as ``modelpar train`` splits its threads), so a profile
prices a 4-rank run on 2 cores from a 4-rank measurement. Collective costs are
``latency_s + bytes / (gbps·1e9)``, or, where the measured sizes are kept, those interpolated
(``CollectiveCost``), bytes being what one rank sends with a ring algorithm
(``formulas.allreduce_bytes`` / ``allgather_bytes``; the message itself for point-to-point).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from modelpar._validate import check_choice, check_int, check_number

__all__ = ["BUSY_OPS", "BUSY_WARNING", "COLLECTIVES", "DTYPES", "LINKS", "PROFILE_FORMAT", "PROFILE_VERSION",
           "CollectiveCost", "HardwareProfile", "busy_warning", "check_torch", "load_profile", "node_profile",
           "profile_cache_dir", "profile_source", "save_profile"]

PROFILE_FORMAT = "modelpar-hardware-profile"
PROFILE_VERSION = 2  # 2: the trainer's own work measured whole (layer, ends, blockwise, runtime_s, optimizer)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
BUSY_OPS = (*COLLECTIVES, "exchange")  # exchange: both ranks of a pair send and receive at once (cp's ring shift)
LINKS = ("intra", "inter")  # inside one node (NVLink, shared memory, loopback), across nodes
DTYPES = ("fp32", "bf16", "fp16", "fp64")


@dataclass(frozen=True)
class CollectiveCost:
    """One collective on one link and group size: ``latency_s + bytes/(gbps·1e9)``, or where the sizes it was
    measured at are kept (``points``: (bytes sent, seconds), ascending), between them the measurements
    interpolated, below them the smallest one's, above the largest one's plus the rest at ``gbps``. A line
    through every size misprices the small messages: gloo's cost rises steeply up to ~1 MB and slowly
    after, so the line's latency sat 0.5-0.7 ms above what a 64 KB tensor-parallel all-reduce cost in a step
    (2.2 ms priced, 1.4-1.7 ms measured on a 2-core VM)."""

    latency_s: float
    gbps: float
    points: tuple[tuple[float, float], ...] = ()

    def time(self, nbytes: float) -> float:
        if not self.points:
            return self.latency_s + nbytes / (self.gbps * 1e9)
        (x0, y0), (xn, yn) = self.points[0], self.points[-1]
        if nbytes <= x0:
            return y0
        for (a, ya), (b, yb) in zip(self.points, self.points[1:]):
            if nbytes <= b:
                return ya + (yb - ya) * (nbytes - a) / (b - a)
        return yn + (nbytes - xn) / (self.gbps * 1e9)


def _cost(fit: Sequence[Any]) -> CollectiveCost:
    """The ``CollectiveCost`` of a profile's ``[latency_s, GB/s]`` or ``[latency_s, GB/s, [[bytes, s], ...]]``."""
    points = tuple((float(x), float(y)) for x, y in fit[2]) if len(fit) > 2 else ()
    return CollectiveCost(float(fit[0]), float(fit[1]), points)


@dataclass(frozen=True)
class HardwareProfile:
    """One machine kind, measured or from a data sheet; ``to_json``/``from_json`` round-trip it."""

    name: str
    device: str  # "cpu", "cuda" (measured) or "gpu" (a data-sheet table entry)
    backend: str  # process-group backend it was measured with: gloo or nccl ("-" for a table entry)
    memory_gb: float  # memory per device, GB (1e9 B)
    devices_per_node: int  # devices (or, on a CPU, training processes) that share the fast link
    peak_tflops: dict[str, float]  # dtype -> dense matmul peak (table) or the best measured, TFLOP/s
    intra_node_gbps: float  # per device, one direction: nominal (table) or the measured p2p bandwidth
    inter_node_gbps: float
    hbm_tb_s: float  # element-wise (memory-bound) throughput, TB/s (table: HBM; measured: at one rank)
    matmul_ceiling: float = 0.8  # table entries: the efficiency curve's ceiling (assumptions.py's curve)
    host_gbps: float = 0.0  # device <-> host copies, GB/s one direction (PCIe, C2C); 0: a CPU's memcpy (element-wise)
    torch: str | None = None  # torch version measured with; None for a table entry
    host: str = "-"
    cores: int = 0  # CPU cores of the host (0: unknown)
    # measured: dtype -> str(ranks) -> [[m, n, k, TFLOP/s], ...] (x[m×k] · w[k×n])
    matmul: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    attention: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> str(ranks) -> TFLOP/s
    elementwise_gbps: dict[str, float] = field(default_factory=dict)  # str(ranks) -> GB/s per rank
    op_latency_s: dict[str, float] = field(default_factory=dict)  # str(ranks) -> seconds per dispatched op
    launch_s: dict[str, float] = field(default_factory=dict)  # str(ranks) -> host seconds per op dispatched unsynced
    collectives: dict[str, dict[str, dict[str, list[Any]]]] = field(default_factory=dict)
    #              op -> link -> str(group size) -> [latency_s, GB/s] or [latency_s, GB/s, [[bytes, s], ...]]
    busy: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    #       op -> str(ranks) -> the same: a pair's message / collective right after compute, every rank busy
    layer: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    #      dtype -> str(ranks) -> [[hidden, heads, seq, tokens, fwd_s, bwd_s, fwd_recomputed_s, bwd_recomputed_s]]
    layer_compiled: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    #      the same rows for the layer as ``--compile`` runs it (``calibrate --compile``; absent otherwise)
    ends: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    #     dtype -> str(ranks) -> [[hidden, tokens, vocab, embed_fwd_s, embed_bwd_s, head_fwd_s, head_bwd_s]]
    blockwise: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    #          dtype -> str(ranks) -> [[cp, hidden, seq, tokens, fwd_s, bwd_s]]: context-parallel attention
    tp_layer: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    #         dtype -> str(ranks) -> [[t, hidden, heads, seq, tokens, fwd_s, bwd_s, fwd_rc_s, bwd_rc_s]]: a layer
    #         sharded over t ranks, its collectives included (absent from profiles measured before)
    runtime_s: dict[str, list[float]] = field(default_factory=dict)  # str(ranks) -> [per action, per step]
    optimizer: dict[str, list[float]] = field(default_factory=dict)  # str(ranks) -> [latency_s, per_tensor_s, GB/s]
    # the optimizer fits are the trainer's whole step end (``calibrate.layers.trainer_step_end``: the batch, the stop
    # agreement and the norm's all-reduce in them); False: the norm, AdamW and zeroing alone (a GPU; before 2026-12-06)
    step_end_measured: bool = False
    cpu_busy: float | None = None  # share of the CPUs busy with other work just before or just after it was measured
    #         (``calibrate.machine_load``; None: unknown, or a table entry)

    def __post_init__(self) -> None:
        check_choice("device", self.device, ("cpu", "cuda", "gpu"))
        for name in ("memory_gb", "intra_node_gbps", "inter_node_gbps", "hbm_tb_s"):
            check_number(name, getattr(self, name), strict=True)
        check_int("devices_per_node", self.devices_per_node, minimum=1)
        if not 0 < check_number("matmul_ceiling", self.matmul_ceiling, strict=True) <= 1:
            raise ValueError(f"matmul_ceiling must be in (0, 1], got {self.matmul_ceiling}")
        if self.cpu_busy is not None and not 0 <= check_number("cpu_busy", self.cpu_busy) <= 1:
            raise ValueError(f"cpu_busy must be in [0, 1], got {self.cpu_busy}")
        if not self.peak_tflops:
            raise ValueError("peak_tflops must name at least one dtype, got {}")
        for dtype, value in self.peak_tflops.items():
            check_choice("peak_tflops dtype", dtype, DTYPES)
            check_number(f"peak_tflops[{dtype}]", value, strict=True)
        for dtype, table in self.matmul.items():
            check_choice("matmul dtype", dtype, DTYPES)
            for ranks, points in table.items():
                _ranks(f"matmul[{dtype}]", ranks)
                for point in points:
                    if len(point) != 4 or any(not isinstance(x, (int, float)) or not x > 0 for x in point):
                        raise ValueError(f"matmul[{dtype}][{ranks}] points must be [m, n, k, TFLOP/s] > 0, got {point!r}")
        for op, links in self.collectives.items():
            check_choice("collective", op, COLLECTIVES)
            for link, sizes in links.items():
                check_choice(f"collectives[{op}] link", link, LINKS)
                for n, cost in sizes.items():
                    _ranks(f"collectives[{op}][{link}] group size", n)
                    _check_fit(f"collectives[{op}][{link}][{n}]", cost)

        for name, width, grid in (("layer", 8, 4), ("layer_compiled", 8, 4), ("ends", 7, 3), ("blockwise", 6, 4),
                                  ("tp_layer", 9, 5)):
            for dtype, table in getattr(self, name).items():
                check_choice(f"{name} dtype", dtype, DTYPES)
                for ranks, rows in table.items():
                    _ranks(f"{name}[{dtype}]", ranks)
                    _check_rows(f"{name}[{dtype}][{ranks}]", rows, width, grid)
        for ranks, seconds in self.launch_s.items():
            _ranks("launch_s ranks", ranks)
            check_number(f"launch_s[{ranks}]", seconds, strict=True)
        for ranks, row in self.runtime_s.items():
            _ranks("runtime_s ranks", ranks)
            _check_rows(f"runtime_s[{ranks}]", [row], 2, 0)
        for ranks, fit in self.optimizer.items():
            _ranks("optimizer ranks", ranks)
            _check_rows(f"optimizer[{ranks}]", [fit], 3, 0)
            check_number(f"optimizer[{ranks}] GB/s", fit[2], strict=True)
        for op, per_ranks in self.busy.items():
            check_choice("busy op", op, BUSY_OPS)
            for count, fit in per_ranks.items():
                _ranks(f"busy[{op}] ranks", count)
                _check_fit(f"busy[{op}][{count}]", fit)

    @property
    def measured(self) -> bool:
        """True for a ``modelpar calibrate`` profile, False for a data-sheet table entry."""
        return self.device != "gpu"

    @property
    def overlaps_compute(self) -> bool:
        """Can communication run beside compute? Not on a CPU: gloo copies and reduces the bytes on the cores
        that compute (every local rank's threads take a share of them), so what a GPU's copy engines would hide
        costs its time there too."""
        return self.device != "cpu"

    @property
    def dtype(self) -> str:
        """The dtype the planner prices compute in: bf16 when the profile has it (a GPU), else the first."""
        return "bf16" if "bf16" in self.peak_tflops and self.device != "cpu" else next(iter(self.peak_tflops))

    def ranks_measured(self, ranks: int, table: dict[str, Any] | None = None) -> str:
        """The key of ``table`` (default: the element-wise one) measured with the most processes per node
        at or below ``ranks`` (the fewest if none is)."""
        keys = sorted(int(k) for k in (self.elementwise_gbps if table is None else table))
        if not keys:
            return "1"
        below = [k for k in keys if k <= ranks]
        return str(below[-1] if below else keys[0])

    def matmul_tflops(self, m: float, n: float, k: float, dtype: str | None = None, ranks: int = 1) -> float | None:
        """Measured throughput of x[m×k]·w[k×n], TFLOP/s: inverse-distance weighting of the four nearest
        measured shapes in log space (exact at a measured shape); None without measured points."""
        table = self.matmul.get(dtype or self.dtype, {})
        if not table:
            return None
        points = table[self.ranks_measured(ranks, table)]
        target = (math.log(m), math.log(n), math.log(k))
        scored = sorted((sum((math.log(p) - x) ** 2 for p, x in zip(pt[:3], target)), pt[3]) for pt in points)[:4]
        if scored[0][0] < 1e-12:
            return scored[0][1]
        weights = [1 / d for d, _ in scored]
        return sum(w * tf for w, (_, tf) in zip(weights, scored)) / sum(weights)

    def attention_tflops(self, dtype: str | None = None, ranks: int = 1) -> float | None:
        table = self.attention.get(dtype or self.dtype, {})
        return table[self.ranks_measured(ranks, table)] if table else None

    def elementwise_bytes_per_s(self, ranks: int = 1) -> float:
        if self.elementwise_gbps:
            return self.elementwise_gbps[self.ranks_measured(ranks)] * 1e9
        return self.hbm_tb_s * 1e12

    def host_bytes_per_s(self, ranks: int = 1) -> float:
        """Bytes per second one rank copies to host memory and back (activation offload): ``host_gbps``, else (a
        CPU, where the host is the device's own memory) its memory-bound element-wise throughput, the memcpy rate."""
        return self.host_gbps * 1e9 if self.host_gbps else self.elementwise_bytes_per_s(ranks)

    def op_latency(self, ranks: int = 1) -> float | None:
        table = self.op_latency_s
        return table[self.ranks_measured(ranks, table)] if table else None

    def launch(self, ranks: int = 1) -> float | None:
        """Host seconds per op the trainer dispatches without waiting for the device (``training.dispatch``:
        a layer's forward and backward at tiny shapes, timed on the host, over its counted ops); None if not
        measured."""
        table = self.launch_s
        return table[self.ranks_measured(ranks, table)] if table else None

    def _rows(self, tables: dict[str, dict[str, list[list[float]]]], dtype: str, ranks: int) -> list[list[float]]:
        """The rows of ``tables[dtype]`` measured with the most processes at or below ``ranks`` ([]: none)."""
        table = tables.get(dtype, {})
        return table[self.ranks_measured(ranks, table)] if table else []

    def layer_rows(self, dtype: str, ranks: int = 1, compiled: bool = False) -> list[list[float]]:
        """The measured layers (``calibrate.layers``) in ``dtype`` with the most processes at or below ``ranks``;
        ``compiled``: the layer under ``--compile`` (``layer_compiled``; [] where not measured)."""
        return self._rows(self.layer_compiled if compiled else self.layer, dtype, ranks)

    def tp_layer_rows(self, dtype: str, ranks: int = 1) -> list[list[float]]:
        """The measured tensor-parallel layers (``calibrate.layers.measure_tp_layers``), as ``layer_rows``."""
        return self._rows(self.tp_layer, dtype, ranks)

    def end_rows(self, dtype: str, ranks: int = 1) -> list[list[float]]:
        """The measured embeddings and output layers in ``dtype``, as ``layer_rows``."""
        return self._rows(self.ends, dtype, ranks)

    def blockwise_rows(self, dtype: str, ranks: int = 1) -> list[list[float]]:
        """The measured context-parallel attention in ``dtype``, as ``layer_rows``."""
        return self._rows(self.blockwise, dtype, ranks)

    def runtime(self, ranks: int = 1) -> tuple[float, float] | None:
        """(seconds per action, per step) the pipeline runtime adds beyond computing; None if not measured."""
        table = self.runtime_s
        return tuple(table[self.ranks_measured(ranks, table)]) if table else None  # type: ignore[return-value]

    def optimizer_fit(self, ranks: int = 1) -> tuple[float, float, float] | None:
        """(latency_s, per_tensor_s, GB/s) of a step's gradient norm, AdamW update and zeroing; None if not measured."""
        table = self.optimizer
        return tuple(table[self.ranks_measured(ranks, table)]) if table else None  # type: ignore[return-value]

    def collective(self, op: str, group: int, link: str = "intra") -> CollectiveCost | None:
        """The measured cost of ``op`` over ``group`` ranks on ``link`` (nearest measured group size), or None."""
        sizes = self.collectives.get(op, {}).get(link) or self.collectives.get(op, {}).get("intra")
        if not sizes or group < 2:
            return None
        near = min(sizes, key=lambda n: (abs(math.log(int(n) / group)), -int(n)))
        return _cost(sizes[near])

    def busy_cost(self, op: str, ranks: int) -> CollectiveCost | None:
        """``op`` over a pair as the trainer issues it (after compute, every one of ``ranks`` processes busy;
        ``calibrate.busy``), from the table of the most processes at or below ``ranks``; None if not measured."""
        table = self.busy.get(op)
        if not table:
            return None
        return _cost(table[self.ranks_measured(ranks, table)])

    def to_json(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: Any, source: str = "profile") -> HardwareProfile:
        """The profile a ``to_json`` wrote; a ValueError naming ``source`` and the bad field otherwise."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{source} is not a modelpar hardware profile (no \"format\": \"{PROFILE_FORMAT}\")")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{source} has profile version {data.get('version')!r}; this modelpar reads version "
                             f"{PROFILE_VERSION}: run modelpar calibrate again")
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in data.items() if k not in ("format", "version")}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source} has unknown fields {unknown}")
        try:
            return cls(**values)
        except TypeError as err:  # a missing field
            raise ValueError(f"{source} is malformed: {err}") from None
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{source} is malformed: {err}") from None


def _check_fit(where: str, fit: Any) -> None:
    """A ``[latency_s, GB/s]`` pair, optionally with the measured ``[[bytes, seconds], ...]`` (ascending bytes):
    numbers, the bandwidth above 0."""
    if not isinstance(fit, list | tuple) or len(fit) not in (2, 3):
        raise ValueError(f"{where} must be [latency_s, GB/s] or [latency_s, GB/s, [[bytes, s], ...]], got {fit!r}")
    check_number(f"{where} latency_s", fit[0])
    check_number(f"{where} GB/s", fit[1], strict=True)
    if len(fit) == 3:
        points = fit[2]
        if not isinstance(points, list | tuple) or any(not isinstance(pt, list | tuple) or len(pt) != 2 for pt in points):
            raise ValueError(f"{where} points must be [[bytes, seconds], ...], got {points!r}")
        for x, y in points:
            check_number(f"{where} point bytes", x, strict=True)
            check_number(f"{where} point seconds", y)
        if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
            raise ValueError(f"{where} points must be in ascending bytes, got {points!r}")


def _check_rows(where: str, rows: Any, width: int, grid: int) -> None:
    """Rows of ``width`` numbers, the first ``grid`` (a measured shape) above 0, the rest (seconds) at least 0."""
    for row in rows:
        if (not isinstance(row, list) or len(row) != width
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in row)
                or any(x <= 0 for x in row[:grid]) or any(x < 0 for x in row[grid:])):
            raise ValueError(f"{where} rows must be {width} numbers (the first {grid} > 0, the rest >= 0), got {row!r}")


def _ranks(name: str, key: Any) -> int:
    try:
        return check_int(name, int(key), minimum=1)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number >= 1, got {key!r}") from None


def installed_torch() -> str | None:
    """The installed torch's version, read from its package metadata (torch itself is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def check_torch(profile: HardwareProfile, source: str = "profile") -> HardwareProfile:
    """``profile`` if it was measured with the installed torch (or is a table entry), else a ValueError."""
    here = installed_torch()
    if profile.torch is not None and here is not None and profile.torch != here:
        raise ValueError(f"{source} was measured with torch {profile.torch}, this is torch {here}: "
                         "run modelpar calibrate again")
    return profile


def load_profile(path: str | os.PathLike, torch_check: bool = True) -> HardwareProfile:
    """Read a profile JSON file; one-line ValueError for a missing, unreadable, malformed or other-torch file."""
    source = f"hardware profile {os.fspath(path)!r}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise ValueError(f"{source}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{source} is not JSON: {err}") from None
    profile = HardwareProfile.from_json(data, source)
    return check_torch(profile, source) if torch_check else profile


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")


def node_profile(name: str, peak_tflops: float, memory_gb: float, hbm_tb_s: float, matmul_ceiling: float,
                 gpus_per_node: int, intra_node_gbps: float, inter_node_gbps: float) -> HardwareProfile:
    """A data-sheet GPU node as a table profile (no measured points: the assumptions price the rest)."""
    return HardwareProfile(name=name, device="gpu", backend="-", memory_gb=memory_gb, devices_per_node=gpus_per_node,
                           peak_tflops={"bf16": peak_tflops}, intra_node_gbps=intra_node_gbps,
                           inter_node_gbps=inter_node_gbps, hbm_tb_s=hbm_tb_s, matmul_ceiling=matmul_ceiling)


BUSY_WARNING = 0.25  # share of the CPUs busy with other work above which a measured profile is flagged


def busy_warning(share: float | None) -> str | None:
    """What to say of a profile measured with ``share`` of the CPUs busy with other work, or None (quiet, unknown)."""
    if share is None or share <= BUSY_WARNING:
        return None
    return f"measured while {100 * share:.0f}% of the CPUs were busy with other work: its step times are priced slow"


def profile_cache_dir() -> str:
    """Where ``modelpar train`` keeps this machine's calibrated profiles (``calibrate.cache``):
    ``$XDG_CACHE_HOME/modelpar``, else ``~/.cache/modelpar``."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "modelpar")


def profile_source(hardware: str, presets: Sequence[str]) -> str:
    """How the profile a run names (``--hardware``) was obtained, as its summary says it: one of ``presets``
    (a data sheet), a file in ``profile_cache_dir`` (this machine, calibrated once), or another calibrated file."""
    if hardware.lower() in presets:
        return "data-sheet preset"
    if os.path.dirname(os.path.abspath(hardware)) == os.path.abspath(profile_cache_dir()):
        return "calibrated for this machine, cached"
    return f"calibrated, --hardware {hardware}"
