"""Rotary position embedding (Su et al. 2021, RoFormer), in Hugging Face Llama's layout.

Each head's d features are two halves [x₁, x₂] rotated pairwise by position-dependent angles:
(x₁, x₂) ↦ (x₁·cos θ − x₂·sin θ, x₂·cos θ + x₁·sin θ) with θᵢ = position / theta^(2i/d),
i < d/2 (``rotate_half``; Meta's original pairs neighbouring features instead, and HF's
conversion permutes q and k to this layout). q·k then depends on positions only through their
difference. No parameters: every rank rotates its own heads, so tensor parallelism needs nothing.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "rotary_angles"]


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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
