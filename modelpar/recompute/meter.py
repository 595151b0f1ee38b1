"""``ActivationMeter``: count the activations autograd holds for backward, as they come and go.

Every tensor an autograd node saves passes through the pack hook of
``torch.autograd.graph.saved_tensors_hooks``; we wrap it in a small holder and learn, through a
weak-reference finaliser, the moment the node lets it go (after its backward ran, or when the
graph is dropped). Tensors sharing a storage count once (tanh's output saved by tanh and by the
next multiply is one activation); parameters and views of them are not activations and are skipped.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from types import TracebackType

import torch
from torch import nn

__all__ = ["ActivationMeter", "HeldActivations"]


@dataclass(frozen=True)
class HeldActivations:
    """A meter's reading: activations saved for backward and their storage bytes."""

    count: int
    bytes: int


class _Saved:
    """What the pack hook hands autograd instead of the tensor; its death means 'released'."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class ActivationMeter:
    """``with meter: ...`` counts what autograd saves inside the block, live, until it is released.

    ``now`` is the current reading and ``peak`` the largest seen (count and bytes peak separately).
    Enter the meter again for later steps (e.g. around the backward that re-runs a checkpoint):
    readings carry on. Saves made outside any ``with meter`` block are not counted.
    """

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}  # storage pointer -> holders alive
        self._lock = threading.RLock()  # a finaliser may run inside _pack (cyclic GC) on this thread
        self._hooks: list[torch.autograd.graph.saved_tensors_hooks] = []
        self.count = self.bytes = self.peak_count = self.peak_bytes = 0

    @property
    def now(self) -> HeldActivations:
        return HeldActivations(self.count, self.bytes)

    @property
    def peak(self) -> HeldActivations:
        return HeldActivations(self.peak_count, self.peak_bytes)

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        self.peak_count, self.peak_bytes = self.count, self.bytes

    def _pack(self, tensor: torch.Tensor) -> object:
        if _is_parameter(tensor) or tensor.untyped_storage().nbytes() == 0:
            return tensor
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        holder = _Saved(tensor.detach())  # detached: an output saved by its own node makes no cycle
        with self._lock:
            self._refs[key] = self._refs.get(key, 0) + 1
            if self._refs[key] == 1:
                self.count += 1
                self.bytes += nbytes
                self.peak_count = max(self.peak_count, self.count)
                self.peak_bytes = max(self.peak_bytes, self.bytes)
        weakref.finalize(holder, self._release, key, nbytes)
        return holder

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.count -= 1
                self.bytes -= nbytes

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed  # type: ignore[return-value]

    def __enter__(self) -> ActivationMeter:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._hooks.append(hooks)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.pop().__exit__(kind, value, tb)
