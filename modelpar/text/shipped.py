"""The byte-level text corpus that ships with the package: no download, the same bytes everywhere.

The text is the Python documentation topics (``modelpar/data/pydoc_topics.txt.xz``, from the
standard library's ``pydoc_data``; see ``modelpar/data/NOTICE.txt``), ~465 kB of English prose and
code. Tokens are bytes (vocabulary 256), so there is no tokenizer to ship or to disagree about.
It is the default data of ``modelpar train``; ``--data`` replaces it (``modelpar.text``).

Split: the text is cut into blocks of ``block`` bytes and every ``val_every``-th block goes to
validation, so both splits sample the whole text (the topics are sorted by name). Batches come
from ``modelpar.text.Corpus``: seeded by (seed, split, step) only.
"""

from __future__ import annotations

import lzma
import math
from functools import lru_cache
from importlib import resources

import numpy as np

from modelpar._validate import check_int
from modelpar.text.batches import Corpus

__all__ = ["VOCAB_SIZE", "load_corpus"]

VOCAB_SIZE = 256  # byte-level: every byte value is a token
_DATA_FILE = "pydoc_topics.txt.xz"


@lru_cache(maxsize=4)
def load_corpus(block: int = 2048, val_every: int = 20) -> Corpus:
    """The shipped corpus split into train/validation by blocks (every ``val_every``-th block)."""
    check_int("block", block, minimum=1)
    check_int("val_every", val_every, minimum=2)
    raw = lzma.decompress(resources.files("modelpar").joinpath("data", _DATA_FILE).read_bytes())
    data = np.frombuffer(raw, dtype=np.uint8)
    n_blocks = math.ceil(len(data) / block)
    is_val = (np.arange(len(data)) // block) % val_every == val_every - 1
    if n_blocks < val_every:
        raise ValueError(f"block ({block}) too large: the corpus has only {n_blocks} blocks, "
                         f"needs at least val_every ({val_every})")
    return Corpus(train=data[~is_val].copy(), val=data[is_val].copy())
