"""The shipped byte corpus: split, seeded batches, the per-rank feed and the unigram baseline."""

import math

import numpy as np
import pytest
import torch

from modelpar.corpus import VOCAB_SIZE, Corpus, load_corpus, rank_batch


def test_shipped_text_and_block_split():
    c = load_corpus()
    assert len(c.train) + len(c.val) == 466_273  # bytes of the Python 3.11 pydoc topics, as shipped
    assert len(c.val) == 11 * 2048  # every 20th block of 2048 bytes: 228 blocks -> 11 for validation
    text = bytes(c.train[:200]).decode()
    assert text.startswith('The "assert" statement')
    small = load_corpus(block=1000, val_every=4)
    assert len(small.val) > len(c.val)  # other settings, other split


def test_batches_depend_only_on_seed_split_and_step():
    c = load_corpus()
    x, y = c.batch("train", 7, 4, 32, seed=1)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    again, _ = c.batch("train", 7, 4, 32, seed=1)
    assert torch.equal(x, again)
    assert not torch.equal(x, c.batch("train", 8, 4, 32, seed=1)[0])
    assert not torch.equal(x, c.batch("train", 7, 4, 32, seed=2)[0])
    row = bytes(x[0].tolist())
    assert row in bytes(c.train)  # a real window of the training split


def test_rank_batch_feeds_first_and_last_stages_only():
    x = torch.arange(12).view(6, 2)
    y = x + 100
    xi, yi = rank_batch(x, y, dp_rank=1, dp=3, first_stage=True, last_stage=False)
    assert torch.equal(xi, x[2:4]) and yi is None
    xi, yi = rank_batch(x, y, dp_rank=2, dp=3, first_stage=False, last_stage=True)
    assert xi is None and torch.equal(yi, y[4:6])
    assert rank_batch(x, y, dp_rank=0, dp=1, first_stage=False, last_stage=False) == (None, None)
    with pytest.raises(ValueError, match=r"batch size \(6\) must be divisible by dp \(4\)"):
        rank_batch(x, y, dp_rank=0, dp=4, first_stage=True, last_stage=True)
    with pytest.raises(ValueError, match="dp_rank must be <= 2, got 3"):
        rank_batch(x, y, dp_rank=3, dp=3, first_stage=True, last_stage=True)


def test_unigram_baseline_hand_checked():
    train = np.array([0, 0, 0, 1], dtype=np.uint8)  # counts+1: byte 0 -> 4, byte 1 -> 2, others 1
    c = Corpus(train=train, val=np.array([0, 1], dtype=np.uint8))
    total = 4 + 2 + (VOCAB_SIZE - 2)
    want = -(math.log(4 / total) + math.log(2 / total)) / 2
    assert c.unigram_baseline() == pytest.approx(want, rel=1e-12)
    assert c.unigram_entropy() == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), rel=1e-12)


def test_shipped_baseline_values():
    c = load_corpus()
    assert c.unigram_baseline() == pytest.approx(3.2404, abs=1e-4)  # nats per byte, 4.67 bits
    assert c.unigram_entropy() == pytest.approx(3.2621, abs=1e-4)


def test_bad_arguments():
    c = load_corpus()
    with pytest.raises(ValueError, match=r"split must be one of \{train, val\}, got 'test'"):
        c.batch("test", 0, 1, 8)
    with pytest.raises(ValueError, match="seq_len must be <= "):
        c.batch("val", 0, 1, 10**9)
    with pytest.raises(ValueError, match="block too large|block \\(10000000\\) too large"):
        load_corpus(block=10**7)
