"""The token cache: a source tokenized once into flat uint16/uint32 files that every rank memory-maps.

    <cache_dir>/tokens-<key>/
        train.bin  val.bin   token ids, documents back to back (each followed by the end-of-document
                             token when the tokenizer has one), in the source's document order
        counts.npy           [2, V] token frequencies (train, val): the unigram baseline without a pass
        meta.json            dtype, token and byte counts, the tokens' sha256, seconds spent
        tokenizer.json       the tokenizer that made them (absent for bytes)

``key`` hashes everything the tokens depend on: the files' paths, sizes and modification times,
the text field, the split (validation fraction, seed), the tokenizer's content and the dtype. A
write goes into a hidden temporary folder renamed into place at the end, so a crash leaves no
half entry and two runs preparing the same key at once both end up with one complete entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from modelpar.text.batches import Corpus
from modelpar.text.tokenizer import TOKENIZER_FILE, Tokenizer

__all__ = ["TokenFiles", "cache_key", "read_tokens", "write_tokens"]

_META = "meta.json"
_BATCH_CHARS = 1 << 22  # characters handed to the tokenizer at once (encode_batch runs them in parallel)


def cache_key(parts: dict[str, Any]) -> str:
    """A stable 20-hex-digit name for ``parts`` (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:20]


@dataclass(frozen=True)
class TokenFiles:
    """A complete cache entry: where the token files are and what they hold."""

    path: str  # the entry's folder
    dtype: str  # uint16 or uint32
    vocab_size: int
    train_tokens: int
    val_tokens: int
    train_bytes: int  # UTF-8 bytes of the training documents
    val_bytes: int
    documents: int
    val_documents: int
    digest: str  # sha256 of the training then the validation tokens: the data's identity on resume
    tokenizer: str  # the tokenizer's digest
    seconds: float  # time spent tokenizing

    def corpus(self) -> Corpus:
        """The tokens, memory-mapped read-only (nothing is loaded until a batch reads its windows)."""
        root = Path(self.path)
        train, val = (np.memmap(root / f"{split}.bin", dtype=self.dtype, mode="r") for split in ("train", "val"))
        return Corpus(train=train, val=val, vocab_size=self.vocab_size, val_bytes=self.val_bytes,
                      counts=np.load(root / "counts.npy"))


def read_tokens(path: str | os.PathLike) -> TokenFiles | None:
    """The complete entry at ``path``, or None if there is none (meta.json is written last)."""
    meta = Path(path) / _META
    if not meta.is_file():
        return None
    return TokenFiles(**{**json.loads(meta.read_text(encoding="utf-8")), "path": str(path)})


def write_tokens(path: str | os.PathLike, documents: Iterable[tuple[str, bool]], tokenizer: Tokenizer, dtype: str,
                 advance: Callable[[int], None] | None = None) -> TokenFiles:
    """Tokenize (text, is_validation) documents into a new entry at ``path``; return it.

    ``advance(n)`` is called after every n documents (a progress bar).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        start = time.perf_counter()
        with open(tmp / "train.bin", "wb") as train, open(tmp / "val.bin", "wb") as val:
            writer = _Writer((train, val), tokenizer, dtype)
            batch: list[tuple[str, bool]] = []
            chars = 0
            for doc in documents:
                batch.append(doc)
                chars += len(doc[0])
                if chars >= _BATCH_CHARS:
                    writer.add(batch)
                    if advance:
                        advance(len(batch))
                    batch, chars = [], 0
            writer.add(batch)
            if advance:
                advance(len(batch))
        np.save(tmp / "counts.npy", writer.counts)
        if tokenizer.name != "bytes":
            tokenizer.save(tmp / TOKENIZER_FILE)
        entry = TokenFiles(path=str(path), dtype=dtype, vocab_size=tokenizer.vocab_size,
                           train_tokens=writer.tokens[0], val_tokens=writer.tokens[1], train_bytes=writer.bytes[0],
                           val_bytes=writer.bytes[1], documents=writer.documents[0] + writer.documents[1],
                           val_documents=writer.documents[1],
                           digest=hashlib.sha256(writer.hashes[0].digest() + writer.hashes[1].digest()).hexdigest(),
                           tokenizer=tokenizer.digest, seconds=round(time.perf_counter() - start, 3))
        (tmp / _META).write_text(json.dumps({k: v for k, v in asdict(entry).items() if k != "path"}, indent=1))
        try:
            os.rename(tmp, path)
        except OSError:  # another run completed the same entry first: use theirs
            if read_tokens(path) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = read_tokens(path)
    assert found is not None
    return found


class _Writer:
    """Appends encoded documents to the train/val files, counting tokens, bytes and frequencies."""

    def __init__(self, files: tuple[Any, Any], tokenizer: Tokenizer, dtype: str) -> None:
        self.files, self.tokenizer, self.dtype = files, tokenizer, np.dtype(dtype)
        self.counts = np.zeros((2, tokenizer.vocab_size), dtype=np.int64)
        self.tokens, self.bytes, self.documents = [0, 0], [0, 0], [0, 0]
        self.hashes = [hashlib.sha256(), hashlib.sha256()]

    def add(self, batch: list[tuple[str, bool]]) -> None:
        if not batch:
            return
        eos = [] if self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        encoded = self.tokenizer.encode_batch([text for text, _ in batch])
        for split in (0, 1):
            parts = [np.concatenate([ids, eos]) if eos else ids
                     for ids, (_, is_val) in zip(encoded, batch) if int(is_val) == split]
            if not parts:
                continue
            ids = np.concatenate(parts).astype(self.dtype)
            raw = ids.tobytes()
            self.files[split].write(raw)
            self.hashes[split].update(raw)
            self.counts[split] += np.bincount(ids, minlength=self.tokenizer.vocab_size)
            self.tokens[split] += len(ids)
            self.documents[split] += len(parts)
            self.bytes[split] += sum(len(text.encode("utf-8")) for text, is_val in batch if int(is_val) == split)
