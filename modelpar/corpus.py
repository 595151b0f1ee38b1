"""A byte-level text corpus that ships with the package: no download, the same bytes everywhere.

The text is the Python documentation topics (``modelpar/data/pydoc_topics.txt.xz``, from the
standard library's ``pydoc_data``; see ``modelpar/data/NOTICE.txt``), ~465 kB of English prose and
code. Tokens are bytes (vocabulary 256), so there is no tokenizer to ship or to disagree about.

Split: the text is cut into blocks of ``block`` bytes and every ``val_every``-th block goes to
validation, so both splits sample the whole text (the topics are sorted by name). A batch is
``batch_size`` random windows of ``seq_len + 1`` bytes whose positions depend only on
(seed, split, step): resuming at step k needs nothing but k, and every parallel layout sees the same
global batch. ``rank_batch`` then hands each rank only what it needs (§6: inputs to the first
pipeline stage, labels to the last, rows split across data-parallel replicas).
"""

from __future__ import annotations

import lzma
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np
import torch

from modelpar._validate import check_choice, check_int

__all__ = ["VOCAB_SIZE", "Corpus", "load_corpus", "rank_batch"]

VOCAB_SIZE = 256  # byte-level: every byte value is a token
_DATA_FILE = "pydoc_topics.txt.xz"
_SPLIT_IDS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class Corpus:
    """The training and validation bytes, as uint8 arrays."""

    train: np.ndarray
    val: np.ndarray

    def split(self, name: str) -> np.ndarray:
        check_choice("split", name, _SPLIT_IDS)
        return self.train if name == "train" else self.val

    def batch(self, split: str, step: int, batch_size: int, seq_len: int,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows as (inputs, targets), int64 [batch_size, seq_len], targets shifted by one.

        The window starts come from a generator seeded by (seed, split, step) only.
        """
        data = self.split(split)
        check_int("step", step, minimum=0)
        check_int("batch_size", batch_size, minimum=1)
        check_int("seq_len", seq_len, minimum=1, maximum=len(data) - 1)
        rng = np.random.default_rng([seed, _SPLIT_IDS[split], step])
        starts = rng.integers(0, len(data) - seq_len, size=batch_size)
        windows = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int64)
        tokens = torch.from_numpy(windows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def unigram_baseline(self) -> float:
        """Cross entropy (nats/byte) of the validation bytes under the training bytes' frequencies.

        The loss of the best model that ignores context: a trained GPT must end clearly below it.
        Add-one smoothing keeps bytes unseen in training finite.
        """
        counts = np.bincount(self.train, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
        log_p = np.log(counts / counts.sum())
        val_counts = np.bincount(self.val, minlength=VOCAB_SIZE).astype(np.float64)
        return float(-(val_counts * log_p).sum() / val_counts.sum())

    def unigram_entropy(self) -> float:
        """Entropy (nats/byte) of the training bytes' unigram distribution."""
        counts = np.bincount(self.train, minlength=VOCAB_SIZE).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


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


def rank_batch(inputs: torch.Tensor, targets: torch.Tensor, *, dp_rank: int, dp: int,
               first_stage: bool, last_stage: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This rank's part of a global batch: rows of replica ``dp_rank``; inputs only on the first
    pipeline stage, targets only on the last (the middle stages get their input from a neighbour)."""
    check_int("dp", dp, minimum=1)
    check_int("dp_rank", dp_rank, minimum=0, maximum=dp - 1)
    rows = inputs.shape[0]
    if rows % dp:
        raise ValueError(f"batch size ({rows}) must be divisible by dp ({dp})")
    part = slice(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)
    return (inputs[part] if first_stage else None), (targets[part] if last_stage else None)
