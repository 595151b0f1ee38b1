"""The token cache: a source tokenized once into flat uint16/uint32 files that every rank memory-maps.

    <cache_dir>/tokens-<key>/
        train.bin  val.bin   token ids, documents back to back (each followed by the end-of-document
                             token when the tokenizer has one), in the source's document order
        counts.npy           [2, V] token frequencies (train, val): the unigram baseline without a pass
        meta.json            dtype, token and byte counts, each file's sha256, seconds spent
        tokenizer.json       the tokenizer that made them (absent for bytes)

``key`` hashes everything the tokens depend on: the files' paths, sizes and modification times,
the text field, the split (validation fraction, seed), the tokenizer's content and the dtype. A
write goes into a hidden temporary folder renamed into place at the end, so a crash leaves no
half entry and two runs preparing the same key at once both end up with one complete entry.

An entry is not trusted: ``verify_tokens`` reads every file back and compares its size and sha256
with meta.json's (a disk error, a truncated copy, a zeroed file), and the run's data fingerprint
is the sha256 of the tokens read, not meta.json's claim. A damaged entry (or an unreadable
meta.json) is a ``DamagedCache`` naming the file; ``prepare_data`` then tokenizes again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from modelpar._validate import json_error
from modelpar.text.batches import Corpus
from modelpar.text.tokenizer import TOKENIZER_FILE, Tokenizer

__all__ = ["DamagedCache", "TokenFiles", "cache_key", "discard_tokens", "read_tokens", "verify_tokens", "write_tokens"]

_META = "meta.json"
_FILES = ("train.bin", "val.bin", "counts.npy")  # what meta.json's sha256 covers
_HASH_BLOCK = 1 << 24  # bytes read at a time when verifying
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
    sha256: dict[str, str]  # of each file of _FILES, as written

    def corpus(self) -> Corpus:
        """The tokens, memory-mapped read-only (nothing is loaded until a batch reads its windows)."""
        root = Path(self.path)
        train, val = (np.memmap(root / f"{split}.bin", dtype=self.dtype, mode="r") for split in ("train", "val"))
        return Corpus(train=train, val=val, vocab_size=self.vocab_size, val_bytes=self.val_bytes,
                      counts=np.load(root / "counts.npy"))


class DamagedCache(ValueError):
    """A cache entry whose files do not match its meta.json (or whose meta.json cannot be read)."""


def read_tokens(path: str | os.PathLike) -> TokenFiles | None:
    """The entry at ``path`` as its meta.json describes it, or None if there is none; ``DamagedCache``
    naming meta.json if it is missing from the folder or is not such a description."""
    root = Path(path)
    meta = root / _META
    if not root.exists():
        return None
    try:
        raw = json.loads(meta.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DamagedCache(f"token cache entry {str(root)!r} has no {_META}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        why = json_error(err) if isinstance(err, json.JSONDecodeError) else str(err)
        raise DamagedCache(f"token cache file {str(meta)!r} cannot be read ({why})") from None
    return TokenFiles(**_checked_meta(raw, meta), path=str(path))


def _checked_meta(raw: Any, meta: Path) -> dict[str, Any]:
    """meta.json's fields with their types checked: ``DamagedCache`` naming the first missing or wrong one."""
    if not isinstance(raw, dict):
        raise DamagedCache(f"token cache file {str(meta)!r} holds a JSON {type(raw).__name__}, not an object")
    kinds = {f.name: str(f.type) for f in fields(TokenFiles) if f.name != "path"}  # annotations as text
    for name, kind in kinds.items():
        value = raw.get(name)
        ok = {"int": isinstance(value, int) and not isinstance(value, bool) and value >= 0,
              "str": isinstance(value, str), "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "dict[str, str]": isinstance(value, dict) and all(isinstance(value.get(f), str) for f in _FILES)}[kind]
        if not ok or (name == "dtype" and value not in ("uint16", "uint32")):
            raise DamagedCache(f"token cache file {str(meta)!r} has {'no' if name not in raw else 'a bad'} "
                               f"{name!r} ({_META} was not written by this modelpar, or was damaged)")
    return {name: raw[name] for name in kinds}


def verify_tokens(entry: TokenFiles) -> TokenFiles:
    """``entry`` after reading every file back: each must have the size and the sha256 meta.json gives
    (else ``DamagedCache`` naming it). The digest returned is the one computed from the tokens read."""
    root, width = Path(entry.path), np.dtype(entry.dtype).itemsize
    sizes = {"train.bin": entry.train_tokens * width, "val.bin": entry.val_tokens * width}
    computed = {}
    for name in _FILES:
        file = root / name
        try:
            size = file.stat().st_size
            if name in sizes and size != sizes[name]:
                raise DamagedCache(f"token cache file {str(file)!r} has {size:,} bytes, {_META} says {sizes[name]:,} "
                                   f"({entry.dtype} tokens): it is damaged")
            computed[name] = _file_sha256(file)
        except OSError as err:
            raise DamagedCache(f"token cache file {str(file)!r} cannot be read ({err.strerror or err})") from None
        if computed[name].hexdigest() != entry.sha256[name]:
            raise DamagedCache(f"token cache file {str(file)!r} does not match its sha256 in {_META}: it is damaged")
    digest = hashlib.sha256(computed["train.bin"].digest() + computed["val.bin"].digest()).hexdigest()
    if digest != entry.digest:
        raise DamagedCache(f"token cache file {str(root / _META)!r} gives digest {entry.digest[:16]}..., its token "
                           f"files {digest[:16]}...: it is damaged")
    return replace(entry, digest=digest)


def _file_sha256(path: Path) -> Any:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h


def discard_tokens(path: str | os.PathLike) -> None:
    """Remove a damaged entry: renamed aside at once (a concurrent run then sees none), then deleted.
    ValueError naming it if it cannot be removed."""
    path = Path(path)
    trash = path.parent / f".{path.name}.damaged-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:  # another run removed it first
        return
    except OSError as err:
        raise ValueError(f"the damaged token cache entry {str(path)!r} cannot be removed ({err.strerror or err}): "
                         "delete it") from None
    shutil.rmtree(trash, ignore_errors=True)


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
        sha256 = {"train.bin": writer.hashes[0].hexdigest(), "val.bin": writer.hashes[1].hexdigest(),
                  "counts.npy": _file_sha256(tmp / "counts.npy").hexdigest()}
        if tokenizer.name != "bytes":
            tokenizer.save(tmp / TOKENIZER_FILE)
        entry = TokenFiles(path=str(path), dtype=dtype, vocab_size=tokenizer.vocab_size,
                           train_tokens=writer.tokens[0], val_tokens=writer.tokens[1], train_bytes=writer.bytes[0],
                           val_bytes=writer.bytes[1], documents=writer.documents[0] + writer.documents[1],
                           val_documents=writer.documents[1],
                           digest=hashlib.sha256(writer.hashes[0].digest() + writer.hashes[1].digest()).hexdigest(),
                           tokenizer=tokenizer.digest, seconds=round(time.perf_counter() - start, 3), sha256=sha256)
        (tmp / _META).write_text(json.dumps({k: v for k, v in asdict(entry).items() if k != "path"}, indent=1))
        try:
            os.rename(tmp, path)
        except OSError:  # another run completed the same entry first: use theirs (verified)
            theirs = read_tokens(path)
            if theirs is None:
                raise
            return verify_tokens(theirs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


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
