"""Training text: sources (``--data``), tokenizers, the token cache and the seeded batches.

    sources.py    files, folders, JSONL, Parquet/Arrow, or the shipped corpus → documents, split
    tokenizer.py  bytes | byte-level BPE (``tokenizers``) | a tokenizer.json; ``load_tokenizer``
    cache.py      documents → uint16/uint32 token files, keyed by the files and the tokenizer
    batches.py    ``Corpus``: train/val tokens (memory-mapped), seeded batches, bits per byte
    prepare.py    all of it once in the launching process; ``open_corpus`` on every rank
    config.py     ``DataConfig``: the flags
"""

from modelpar.text.batches import Corpus, rank_batch
from modelpar.text.config import DataConfig
from modelpar.text.prepare import cache_root, open_corpus, prepare_data, prepare_on_rank0
from modelpar.text.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "Corpus",
    "DataConfig",
    "Tokenizer",
    "cache_root",
    "load_tokenizer",
    "open_corpus",
    "prepare_data",
    "prepare_on_rank0",
    "rank_batch",
    "train_bpe",
]
