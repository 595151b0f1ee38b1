"""Rotary position embedding (Su et al. 2021, RoFormer), in Hugging Face Llama's layout.

Each head's d features are two halves [x₁, x₂] rotated pairwise by position-dependent angles:
(x₁, x₂) ↦ (x₁·cos θ − x₂·sin θ, x₂·cos θ + x₁·sin θ) with θᵢ = position / theta^(2i/d),
i < d/2 (``rotate_half``; Meta's original pairs neighbouring features instead, and HF's
conversion permutes q and k to this layout). q·k then depends on positions only through their
difference. No parameters: every rank rotates its own heads, so tensor parallelism needs nothing.

``RotaryTable`` computes the angles once per length, device and dtype (in float64, then cast) and
hands the same cos/sin tensors to every layer of a model, as torchtitan's ``freqs_cis``: no layer
recomputes them, and autograd keeps one copy for all layers.
"""

from __future__ import annotations

import torch

__all__ = ["Rope", "RotaryTable", "apply_rotary", "rotary_angles"]

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [s, head_dim]


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> Rope:
    """cos and sin [len(positions), head_dim] of the angles, each half repeated (float64, then cast)."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head dimension, got {head_dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, heads, s, d] by the angles of its s positions (``rotary_angles``)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RotaryTable:
    """cos/sin of positions 0 … n − 1 for one (head_dim, theta), kept per device and dtype and grown on demand.

    ``span`` returns views of the kept table, ``gather`` the rows of given positions (context
    parallelism's zig-zag order). Nothing here is a parameter or a buffer: a checkpoint never holds it.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dimension, got {head_dim}")
        self.head_dim, self.theta = head_dim, theta
        self._tables: dict[tuple[torch.device, torch.dtype], Rope] = {}

    def _table(self, length: int, device: torch.device, dtype: torch.dtype) -> Rope:
        key = (torch.device(device), dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < length:
            table = rotary_angles(torch.arange(length, device=device), self.head_dim, self.theta, dtype)
            self._tables[key] = table
        return table

    def span(self, start: int, s: int, device: torch.device, dtype: torch.dtype) -> Rope:
        """cos, sin [s, head_dim] of positions start … start + s − 1 (views of the kept table)."""
        cos, sin = self._table(start + s, device, dtype)
        return cos[start:start + s], sin[start:start + s]

    def gather(self, positions: torch.Tensor, length: int, dtype: torch.dtype) -> Rope:
        """cos, sin [len(positions), head_dim] of ``positions``, each < ``length``."""
        cos, sin = self._table(length, positions.device, dtype)
        return cos[positions], sin[positions]
