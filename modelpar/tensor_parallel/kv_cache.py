"""A key/value cache for incremental decoding: each new token attends to the stored keys and values
of the positions before it, so it costs one position's work instead of the whole prefix's."""

from __future__ import annotations

import torch

from modelpar._validate import check_int

__all__ = ["KVCache", "LayerCache"]


class KVCache:
    """Keys and values of the first ``pos`` positions, for every attention layer of one model.

    Buffers [b, kv heads, max_len, d] are allocated at a layer's first ``update``; the model
    advances ``pos`` once all its layers have seen a chunk of positions.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = check_int("max_len", max_len, minimum=1)
        self.pos = 0
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions as cached (after every layer stored them)."""
        self.pos += n

    def reset(self) -> None:
        """Forget every position (the buffers are kept for reuse)."""
        self.pos = 0


class LayerCache:
    """One layer's view of a ``KVCache``: where its new positions start, and where they go."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    @property
    def pos(self) -> int:
        return self.cache.pos

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` [b, heads, n, d] at positions pos … pos + n − 1; return all keys and values so far."""
        start, stop = self.cache.pos, self.cache.pos + k.shape[2]
        if stop > self.cache.max_len:
            raise ValueError(f"the KV cache holds {self.cache.max_len} positions; {stop} were asked for")
        if self.index not in self.cache._buffers:
            shape = (k.shape[0], k.shape[1], self.cache.max_len, k.shape[3])
            self.cache._buffers[self.index] = (k.new_zeros(shape), v.new_zeros(shape))
        keys, values = self.cache._buffers[self.index]
        keys[:, :, start:stop] = k
        values[:, :, start:stop] = v
        return keys[:, :, :stop], values[:, :, :stop]
