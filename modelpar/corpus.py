"""The shipped byte-level corpus and its batches, under one short name (``modelpar.text`` holds them).

``load_corpus()`` is the Python documentation topics split into train/validation blocks
(``modelpar.text.shipped``); ``Corpus`` and ``rank_batch`` draw the seeded batches every rank shares.
"""

from modelpar.text.batches import Corpus, rank_batch
from modelpar.text.shipped import VOCAB_SIZE, load_corpus

__all__ = ["VOCAB_SIZE", "Corpus", "load_corpus", "rank_batch"]
