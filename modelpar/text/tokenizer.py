"""Text ↔ token ids: bytes (vocabulary 256), or a byte-level BPE from the ``tokenizers`` library.

The interface is what training and ``modelpar generate`` need: ``encode``, ``decode``,
``vocab_size`` and ``eos_id`` (the end-of-document token appended after each document, or None).
``load_tokenizer(directory)`` gives the tokenizer a run used: its ``tokenizer.json``, or bytes
when there is none. BPE here is GPT-2's byte-level scheme: text is split into bytes shown as 256
printable symbols, so every string encodes (no unknown token) and ``decode(encode(text)) == text``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["EOS", "TOKENIZER_FILE", "BPETokenizer", "ByteTokenizer", "Tokenizer", "describe", "load_tokenizer", "train_bpe"]

EOS = "<|endoftext|>"  # the end-of-document token of the BPE tokenizers trained here (GPT-2's name)
TOKENIZER_FILE = "tokenizer.json"
_EOS_NAMES = (EOS, "</s>", "<eos>", "<|end_of_text|>")  # what other tokenizer.json files call it


class Tokenizer(Protocol):
    """Text to token ids and back."""

    name: str  # "bytes" or "bpe"
    vocab_size: int  # ids are in [0, vocab_size)
    eos_id: int | None  # appended after each document; None: documents are simply concatenated

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids as an integer array."""
        ...

    @property
    def digest(self) -> str:
        """A short content hash: two tokenizers with the same digest encode alike."""
        ...

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer.json (ValueError for bytes, which has none)."""
        ...


def describe(tokenizer: Tokenizer) -> str:
    return f"{tokenizer.name} (vocabulary {tokenizer.vocab_size:,})"


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocabulary 256, nothing to train or to save."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")  # a cut multi-byte character shows as U+FFFD

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    @property
    def digest(self) -> str:
        return "bytes"

    def save(self, path: str | os.PathLike) -> None:
        raise ValueError("the bytes tokenizer has no tokenizer.json: it needs none")


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` (a tokenizer.json), used without its special-token templates."""

    name = "bpe"

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
        self.vocab_size = max(vocab.values()) + 1
        self.eos_id = next((vocab[n] for n in _EOS_NAMES if n in vocab), None)
        self._json = tokenizer.to_str()  # type: ignore[attr-defined]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))  # type: ignore[attr-defined]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)  # type: ignore[attr-defined]
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()[:16]

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self._json, encoding="utf-8")


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None) -> BPETokenizer:
    """A byte-level BPE with ``vocab_size`` tokens (the 256 bytes, the EOS token, merges) trained on ``texts``.

    Fewer tokens come out when the text has fewer distinct pairs to merge. ``length``: how many
    texts there are (for the library's bookkeeping).
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer, length=length)
    return BPETokenizer(tokenizer)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in ``path``: a tokenizer.json file, or a directory holding one (none there: bytes)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
        if not path.exists():
            return ByteTokenizer()
    if not path.is_file():
        raise ValueError(f"tokenizer {str(path)!r} does not exist (give bytes, bpe or a tokenizer.json file)")
    try:
        return BPETokenizer(HFTokenizer.from_file(str(path)))
    except Exception as err:  # the library's parse error, on one line
        raise ValueError(f"tokenizer {str(path)!r} is not a tokenizer.json file: "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
