"""Training and validation tokens, and the seeded batches every rank draws from them.

A batch is ``batch_size`` windows of ``seq_len + 1`` tokens. Window ``i`` of step ``k`` starts at
the ``i``-th number drawn by a generator seeded with (seed, split, k), so sample order is a
function of (seed, step, global sample index) alone: every (t, p, d) split sees the same global
batch, and a run resumed at step k needs nothing but k. The token arrays may be memory-mapped
files (``modelpar.text.cache``): a batch reads its windows, never the whole file.
``rank_batch`` then hands each rank only what it needs (§6: inputs to the first pipeline stage,
labels to the last, rows split across data-parallel replicas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from modelpar._validate import check_choice, check_int

__all__ = ["Corpus", "rank_batch"]

_SPLIT_IDS = {"train": 0, "val": 1}
_COUNT_CHUNK = 1 << 24  # tokens counted at a time, so counting a memory-mapped file stays in bounded memory


@dataclass(frozen=True)
class Corpus:
    """The training and validation tokens (1-D integer arrays, in memory or memory-mapped)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int = 256  # ids are in [0, vocab_size)
    val_bytes: int | None = None  # UTF-8 bytes of text the validation tokens stand for (None: one per token)
    counts: np.ndarray | None = None  # [2, vocab_size] token frequencies of (train, val); None: counted here

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
        self._check_ids(windows, split, step)
        tokens = torch.from_numpy(windows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _check_ids(self, windows: np.ndarray, split: str, step: int) -> None:
        """ValueError unless every id of the batch is in [0, vocab_size): checked here, on the host, once per
        batch, so that the model's forward never has to read ids back from the device."""
        lo, hi = int(windows.min()), int(windows.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"the {split} tokens of batch {step} hold id {bad}, outside the vocabulary "
                             f"[0, {self.vocab_size}): the token file does not match its tokenizer")

    @property
    def tokens_per_byte(self) -> float:
        """Validation tokens per byte of validation text (1 for bytes; about 1/4 for a BPE on English)."""
        return 1.0 if self.val_bytes is None else len(self.val) / self.val_bytes

    def bits_per_byte(self, nats_per_token: float) -> float:
        """A validation loss in bits per byte of text: comparable across tokenizers."""
        return nats_per_token * self.tokens_per_byte / math.log(2)

    def token_counts(self, split: str) -> np.ndarray:
        """How often each id occurs in ``split`` (float64, length vocab_size)."""
        if self.counts is not None:
            return self.counts[_SPLIT_IDS[check_choice("split", split, _SPLIT_IDS)]].astype(np.float64)
        data, counts = self.split(split), np.zeros(self.vocab_size, dtype=np.float64)
        for i in range(0, len(data), _COUNT_CHUNK):
            counts += np.bincount(data[i:i + _COUNT_CHUNK], minlength=self.vocab_size)
        return counts

    def unigram_baseline(self) -> float:
        """Cross entropy (nats/token) of the validation tokens under the training tokens' frequencies.

        The loss of the best model that ignores context: a trained GPT must end clearly below it.
        Add-one smoothing keeps tokens unseen in training finite.
        """
        counts = self.token_counts("train") + 1.0
        log_p = np.log(counts / counts.sum())
        val_counts = self.token_counts("val")
        return float(-(val_counts * log_p).sum() / val_counts.sum())

    def unigram_entropy(self) -> float:
        """Entropy (nats/token) of the training tokens' unigram distribution."""
        counts = self.token_counts("train")
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def rank_batch(inputs: torch.Tensor, targets: torch.Tensor, *, dp_rank: int, dp: int,
               first_stage: bool, last_stage: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This rank's part of a global batch: rows of replica ``dp_rank`` (its own tensors); inputs only on the
    first pipeline stage, targets only on the last (the middle stages get their input from a neighbour)."""
    check_int("dp", dp, minimum=1)
    check_int("dp_rank", dp_rank, minimum=0, maximum=dp - 1)
    rows = inputs.shape[0]
    if rows % dp:
        raise ValueError(f"batch size ({rows}) must be divisible by dp ({dp})")
    part = slice(dp_rank * rows // dp, (dp_rank + 1) * rows // dp)

    def mine(x: torch.Tensor) -> torch.Tensor:  # a copy at d > 1: a view would keep the whole global batch alive
        return x[part].clone() if dp > 1 else x

    return (mine(inputs) if first_stage else None), (mine(targets) if last_stage else None)
