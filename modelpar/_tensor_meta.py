"""A tensor's shape and dtype as a short row of integers, to compare or share across ranks.

One encoding for the whole package: the tensor-parallel shape check all-gathers it, the pipeline
runtime all-reduces it to learn the batch shape before anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["DTYPES", "MAX_DIMS", "META_LEN", "decode_meta", "describe_meta", "encode_meta"]

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
MAX_DIMS = 8
META_LEN = 2 + MAX_DIMS  # ndim, dtype code, sizes (padded with -1)


def encode_meta(x: torch.Tensor) -> list[int]:
    """``[ndim, dtype code, size0, size1, ...]``: code -1 for a dtype outside ``DTYPES``; at most
    ``MAX_DIMS`` sizes are kept (``ndim`` says how many there were)."""
    code = DTYPES.index(x.dtype) if x.dtype in DTYPES else -1
    sizes = list(x.shape)[:MAX_DIMS]
    return [x.dim(), code, *sizes, *[-1] * (MAX_DIMS - len(sizes))]


def decode_meta(row: Sequence[int]) -> tuple[tuple[int, ...], torch.dtype | None]:
    """The (shape, dtype) ``encode_meta`` wrote; dtype None when it was outside ``DTYPES``."""
    ndim, code = int(row[0]), int(row[1])
    return tuple(int(n) for n in row[2:2 + min(ndim, MAX_DIMS)]), (DTYPES[code] if code >= 0 else None)


def describe_meta(row: Sequence[int]) -> str:
    """``(2, 6) torch.float64``, for error messages."""
    shape, dtype = decode_meta(row)
    return f"{shape} {dtype if dtype is not None else 'an unsupported dtype'}"
