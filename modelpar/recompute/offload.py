"""``HostOffload``: saved activations of chosen layers moved to host memory in the forward, back for the backward.

Autograd hands every tensor a node saves to the pack hook of ``torch.autograd.graph.saved_tensors_hooks``;
inside a chosen layer's forward (``apply_offload`` puts the hooks around it) the tensor's storage is copied
to a host buffer (pinned on a GPU) and only the buffer is kept, so the device storage is freed as soon as
the forward drops it. A storage saved twice in one layer (q, k, v views of one projection) is copied once.
The first unpack of a layer's tensors in the backward copies all of that layer's storages back, and starts
copying the layer before it (the next one the backward reaches): the reload is prefetched one layer ahead.

On a GPU both copies run on a side stream, the device memory kept alive for it by ``record_stream`` and the
compute stream waiting for a reload only when it needs it. On a CPU the same code runs with plain copies:
"host memory" is a second allocation, the saved tensor's own storage is released, and what the run counts
as held activations (``ActivationMeter``, ``training.saved``) no longer includes it: the copies are real
memcpys of real bytes (their time is measured: ``seconds``), not a relabelling.

Tensors passed to the layer besides its input (the rotary cos/sin every layer shares), parameters and
views of them, and anything saved while the backward re-runs a layer (recomputation) stay where they are.
The buffers live as long as autograd keeps the packed objects: through a split backward's I until its W.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelpar._compat import in_backward
from modelpar.offload_plan import offload_layers

__all__ = ["HostOffload", "OffloadReading", "apply_offload"]


@dataclass(frozen=True)
class OffloadReading:
    """A store's reading: bytes in host memory now and at the peak, bytes copied each way, seconds copying (CPU)."""

    bytes: int
    peak_bytes: int
    copied_out: int
    copied_in: int
    seconds: float


class _Layer:
    """One forward of one chosen layer: its host copies, and (after the first unpack) their device copies."""

    def __init__(self, store: HostOffload, previous: _Layer | None) -> None:
        self.store = store
        self.previous = weakref.ref(previous) if previous is not None else None
        self.host: dict[int, torch.UntypedStorage] = {}  # device storage pointer at pack time -> host copy
        self.loaded: dict[int, torch.UntypedStorage] | None = None
        self.event: Any = None  # GPU: the reload's completion on the side stream
        self.device = torch.device("cpu")
        self.skip: set[int] = set()  # storages passed in beside the input (cos/sin): not moved
        self.lock = threading.Lock()

    def load(self) -> None:
        """Start copying this layer's storages back (on a GPU asynchronously, on the side stream)."""
        with self.lock:
            if self.loaded is not None:
                return
            self.loaded = {key: self.store._to_device(host, self.device) for key, host in self.host.items()}
            if self.device.type == "cuda":
                self.event = torch.cuda.Event()
                self.event.record(self.store._stream(self.device))


class _Packed:
    """What autograd keeps instead of the tensor: its layer, its storage's key and how to view it again."""

    __slots__ = ("__weakref__", "dtype", "key", "layer", "offset", "size", "stride")

    def __init__(self, layer: _Layer, key: int, tensor: torch.Tensor) -> None:
        self.layer, self.key, self.dtype = layer, key, tensor.dtype
        self.offset, self.size, self.stride = tensor.storage_offset(), tensor.size(), tensor.stride()


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class HostOffload:
    """The host store of one rank: ``layer()`` gives the hooks for one forward of a chosen layer.

    ``reading`` counts the bytes in host memory (each layer's distinct storages), the peak since
    ``reset_peak``, bytes copied out and in, and the seconds the copies took on a CPU (a GPU's overlap).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._streams: dict[int, Any] = {}
        self._outer: tuple[Any, Any] | None = None  # ``passing``'s hooks
        self._last: weakref.ref[_Layer] | None = None  # the chosen layer before, for the prefetch
        self.bytes = self.peak_bytes = self.copied_out = self.copied_in = 0
        self.seconds = 0.0

    @property
    def reading(self) -> OffloadReading:
        return OffloadReading(self.bytes, self.peak_bytes, self.copied_out, self.copied_in, self.seconds)

    @contextlib.contextmanager
    def passing(self, pack: Any, unpack: Any) -> Iterator[None]:
        """Inside: what a chosen layer keeps on the device (cos/sin, ...) goes through these outer hooks, which the
        layer's own hooks otherwise hide (autograd applies the innermost only): how a meter still counts it."""
        self._outer = (pack, unpack)
        try:
            yield
        finally:
            self._outer = None

    def new_chain(self) -> None:
        """The next chosen layer prefetches nothing before it (a new stage forward)."""
        self._last = None

    def reset_peak(self) -> None:
        self.peak_bytes = self.bytes

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def _copy(self, src: torch.UntypedStorage, dst: torch.UntypedStorage, device: torch.device) -> None:
        if device.type == "cuda":
            with torch.cuda.stream(self._stream(device)):
                dst.copy_(src, non_blocking=True)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            self.seconds += time.perf_counter() - t0

    def _to_host(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        device = storage.device
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=device.type == "cuda").untyped_storage()
        if device.type == "cuda":
            self._stream(device).wait_stream(torch.cuda.current_stream(device))  # the tensor is computed
            keep = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            keep.record_stream(self._stream(device))  # not reused before the copy is done
        self._copy(storage, host, device)
        with self._lock:
            self.bytes += storage.nbytes()
            self.copied_out += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        weakref.finalize(host, self._release, storage.nbytes())
        return host

    def _to_device(self, host: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
        back = torch.empty(host.nbytes(), dtype=torch.uint8, device=device).untyped_storage()
        if device.type == "cuda":  # written on the side stream: not reused before that (a graph dropped unread)
            torch.empty(0, dtype=torch.uint8, device=device).set_(back).record_stream(self._stream(device))
        self._copy(host, back, device)
        with self._lock:
            self.copied_in += host.nbytes()
        return back

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes

    @contextlib.contextmanager
    def layer(self, passed: Iterable[Any] = ()) -> Iterator[None]:
        """The hooks around one forward of a chosen layer; ``passed``: tensors given to it besides its input (kept).

        A storage is known by its address, so the device storages copied are kept alive until the layer's forward
        ends: no new tensor of the same forward can take an address whose copy is already on the host."""
        group = _Layer(self, self._last() if self._last is not None else None)
        self._last = weakref.ref(group)
        group.skip = {t.untyped_storage().data_ptr() for t in _tensors(passed)}
        alive: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> Any:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if _is_parameter(tensor):
                return tensor
            if in_backward() or storage.nbytes() == 0 or key in group.skip:
                outer = self._outer  # detached: a Python holder of a node's own output would make a cycle
                return _Kept(outer[1], outer[0](tensor.detach())) if outer is not None else tensor
            if key not in group.host:
                group.device = tensor.device
                group.host[key] = self._to_host(storage)
                alive.append(torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage))
            return _Packed(group, key, tensor)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                yield
        finally:
            alive.clear()


class _Kept:
    """A tensor kept on the device and handed to ``passing``'s outer hooks."""

    __slots__ = ("packed", "unpack")

    def __init__(self, unpack: Any, packed: Any) -> None:
        self.unpack, self.packed = unpack, packed


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Kept):
        return packed.unpack(packed.packed)
    if not isinstance(packed, _Packed):
        return packed
    group = packed.layer
    group.load()
    before = group.previous() if group.previous is not None else None
    if before is not None:
        before.load()  # prefetch: the backward reaches the layer before next
    if group.event is not None:
        torch.cuda.current_stream(group.device).wait_event(group.event)
    assert group.loaded is not None
    storage = group.loaded[packed.key]
    out = torch.empty(0, dtype=packed.dtype, device=group.device)
    return out.set_(storage, packed.offset, packed.size, packed.stride)


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _tensors(v)
        elif isinstance(v, Mapping):
            yield from _tensors(v.values())
        elif hasattr(v, "__dict__"):
            yield from _tensors(vars(v).values())


def apply_offload(stage: nn.Module, offload: str, store: HostOffload) -> list[str]:
    """Offload the saved activations of the chosen layers of ``stage`` (its ``layers``, a ModuleDict in order;
    ``offload_plan.offload_layers`` of their count) into ``store``; return the chosen layers' names. Hooks only:
    no parameter or state-dict name changes, so checkpoints load at any setting. Each forward of the stage starts
    a new prefetch chain (the backward of its first layer does not fetch another stage's or microbatch's)."""
    layers = stage.layers
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(f"stage.layers must be an nn.ModuleDict of the stage's layers, got {type(layers).__name__}")
    names = list(layers.keys())
    if names:
        stage.register_forward_pre_hook(lambda module, args: store.new_chain())
    chosen = [names[i] for i in offload_layers(len(names), offload)]
    for name in chosen:
        _hook(layers[name], store)
    return chosen


def _hook(layer: nn.Module, store: HostOffload) -> None:
    active: list[Any] = []

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hooks = store.layer((args[1:], kwargs)) if torch.is_grad_enabled() and not in_backward() else None
        if hooks is not None:
            hooks.__enter__()
        active.append(hooks)

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        hooks = active.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    layer.register_forward_pre_hook(before, with_kwargs=True)
    layer.register_forward_hook(after, with_kwargs=True, always_call=True)
