"""Checking a written picture by its content: it decodes, has the size asked for, and is not blank."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def picture_colours(path: str | Path, min_width: int = 200, min_height: int = 150) -> set[tuple[int, int, int]]:
    """The distinct RGB colours of the PNG at ``path``, after checking that it decodes (matplotlib's
    reader, which rejects a truncated or corrupt file) and is at least ``min_width`` × ``min_height``."""
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[2] in (3, 4), image.shape
    height, width = image.shape[:2]
    assert width >= min_width and height >= min_height, (width, height)
    rgb = np.round(image[..., :3] * 255).astype(int).reshape(-1, 3)
    return {tuple(p) for p in np.unique(rgb, axis=0).tolist()}


def assert_drawn(path: str | Path, min_colours: int = 4, **size: int) -> set[tuple[int, int, int]]:
    """A PNG with a drawing on it: several colours (background, axes, text and at least one mark)."""
    colours = picture_colours(path, **size)
    assert len(colours) >= min_colours, f"{path} has {len(colours)} colours: blank or nearly so"
    return colours
