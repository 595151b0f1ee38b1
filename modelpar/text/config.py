"""What a run trains on: ``--data`` and its companions, checked without touching the disk.

``DataConfig()`` is the shipped corpus with byte tokens (``modelpar train`` with no flags).
``prepare_data`` (``modelpar.text.prepare``) fills in ``prepared`` and ``fingerprint`` once, in
the launching process; the ranks only memory-map what it names.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelpar._options import option
from modelpar._validate import check_choice, check_int, check_number

__all__ = ["TOKEN_DTYPES", "DataConfig"]

TOKEN_DTYPES = ("auto", "uint16", "uint32")
UINT16_MAX_VOCAB = 65_535  # the largest vocabulary a uint16 token file is allowed to hold
SHIPPED = "shipped corpus, bytes"  # the fingerprint of the default data


@dataclass(frozen=True)
class DataConfig:
    """The text a run trains on and how it becomes tokens."""

    paths: tuple[str, ...] = option(default_factory=tuple, flag="--data", metavar="PATH",
                                    help="text, JSONL, Parquet or Arrow files or folders of them (on the command line "
                                         "repeat --data; empty: the shipped corpus)")
    glob: str = option("*", flag="--data-glob", help="file names taken from --data folders, recursively (hidden "
                                                    "files and folders skipped)")
    text_field: str = option("text", help="the JSONL / table field holding the text")
    val_fraction: float = option(0.01, help="share of documents held out for validation (at least one)")
    tokenizer: str = option("bytes", help="bytes (vocabulary 256), bpe (byte-level BPE trained on the training "
                                          "split) or a tokenizer.json file")
    vocab_size: int | None = option(None, help="the vocabulary --tokenizer bpe is trained to (257 ... 65,535 with "
                                               "uint16)")
    token_dtype: str = option("auto", help="token cache dtype: auto (uint16 when the vocabulary fits), uint16 or uint32")
    cache_dir: str | None = option(None, help="token cache folder (none: modelpar-cache beside --checkpoint-dir, "
                                              "or ./modelpar-cache)")
    prepared: str | None = option(None, cli=False, help="set by prepare_data: the token cache entry the ranks "
                                                        "memory-map")
    fingerprint: str = option(SHIPPED, cli=False, help="set by prepare_data: which tokens and tokenizer (checked "
                                                       "on resume)")

    @property
    def is_shipped_bytes(self) -> bool:
        """The default: the shipped corpus as bytes, held in memory by every rank, nothing to prepare."""
        return not self.paths and self.tokenizer == "bytes"

    def check(self) -> DataConfig:
        """Raise ValueError naming the first bad setting (no file is opened); return self."""
        for path in self.paths:
            if not isinstance(path, str) or not path:
                raise ValueError(f"data paths must be non-empty strings, got {path!r}")
        for name in ("glob", "text_field", "tokenizer"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty, got {getattr(self, name)!r}")
        fraction = check_number("val_fraction", self.val_fraction, 0.0, strict=True)
        if fraction > 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5], got {self.val_fraction}")
        check_choice("token_dtype", self.token_dtype, TOKEN_DTYPES)
        if self.tokenizer == "bpe":
            if self.vocab_size is None:
                raise ValueError("tokenizer bpe needs vocab_size (--vocab-size N, 257 <= N), got None")
            check_vocab_size(self.vocab_size, self.token_dtype)
        elif self.vocab_size is not None:
            raise ValueError(f"vocab_size is for tokenizer bpe (the vocabulary to train); tokenizer "
                             f"{self.tokenizer!r} has its own, got vocab_size={self.vocab_size}")
        return self


def check_vocab_size(vocab_size: int, token_dtype: str) -> int:
    """A byte-level vocabulary: the 256 bytes plus the end-of-document token at least; it must fit the dtype."""
    check_int("vocab_size", vocab_size, minimum=257)
    if token_dtype == "uint16":
        check_int("vocab_size (token_dtype uint16)", vocab_size, maximum=UINT16_MAX_VOCAB)
    return check_int("vocab_size", vocab_size, maximum=2**32 - 1)


def token_dtype_for(vocab_size: int, token_dtype: str) -> str:
    """The dtype of the token files: uint16 when the vocabulary fits and ``auto``, else as asked."""
    if token_dtype == "auto":
        return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"
    if token_dtype == "uint16" and vocab_size > UINT16_MAX_VOCAB:
        raise ValueError(f"the tokenizer's vocabulary ({vocab_size:,}) does not fit token_dtype uint16 "
                         f"(at most {UINT16_MAX_VOCAB:,}): use --token-dtype uint32 or auto")
    return token_dtype
