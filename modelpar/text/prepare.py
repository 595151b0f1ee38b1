"""Prepare a run's data once, before training: check the input, train or load the tokenizer, tokenize.

    prepare_data(cfg)        in the launching process (``modelpar train`` locally: the parent,
                             before any rank starts), or on global rank 0 (``prepare_on_rank0``)
      find_source            missing path, empty file, folder without matching files  → ValueError
      tokenizer              bytes | bpe: cached, or trained on the training documents | a tokenizer.json
      tokens-<key> cached?   yes: nothing is read; no: read every document once (binary file, JSONL
                             without the field → ValueError, nothing written), then tokenize
      → cfg with data.prepared (the cache entry), data.fingerprint and model.vocab_size set
    open_corpus(cfg.data)    on every rank: memory-map the entry (or load the shipped corpus)

A BPE tokenizer is saved as ``tokenizer.json`` in the checkpoint directory; a resumed run uses
that one rather than training again.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import numpy as np

from modelpar.text.batches import Corpus
from modelpar.text.cache import DamagedCache, TokenFiles, cache_key, discard_tokens, read_tokens, verify_tokens, write_tokens
from modelpar.text.config import DataConfig, token_dtype_for
from modelpar.text.sources import Source, find_source
from modelpar.text.tokenizer import TOKENIZER_FILE, ByteTokenizer, Tokenizer, describe, load_tokenizer, train_bpe

if TYPE_CHECKING:
    from rich.console import Console


class RunConfig(Protocol):
    """What data preparation reads of a run's config (``modelpar.training.TrainConfig`` is one)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass: prepared with dataclasses.replace

    @property
    def data(self) -> DataConfig: ...
    @property
    def model(self) -> Any: ...
    @property
    def seed(self) -> int: ...
    @property
    def checkpoint_dir(self) -> str | None: ...
    @property
    def resume(self) -> bool: ...


Config = TypeVar("Config", bound=RunConfig)  # the caller's config type, returned with its data prepared

__all__ = ["cache_root", "open_corpus", "prepare_data", "prepare_on_rank0"]

_FORMAT = 2  # bump when the token files' layout changes: old cache entries are then ignored (2: per-file sha256)
_RANK0_WAIT = timedelta(days=1)  # how long the other ranks wait for rank 0 to prepare (tokenizing is slow)


def cache_root(cfg: Config) -> Path:
    """``--cache-dir``, else ``modelpar-cache`` beside the checkpoint directory, else ``./modelpar-cache``."""
    if cfg.data.cache_dir:
        return Path(cfg.data.cache_dir).expanduser()
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir).expanduser().resolve().parent / "modelpar-cache"
    return Path("modelpar-cache")


def prepare_data(cfg: Config, console: Console | None = None, progress: bool = False,
                 check: Callable[[Config], None] | None = None) -> Config:
    """``cfg`` with its data prepared (see the module docstring); ValueError for bad input, before writing.

    ``console``: where to say what was done (None: silent); ``progress``: progress bars on it.
    ``check(prepared)``: the run's own refusal (a checkpoint to resume from that does not fit), made
    before anything is written to the checkpoint directory (only the token cache is filled before it).
    """
    data = cfg.data.check()
    if data.prepared is not None:
        return cfg
    if data.is_shipped_bytes:
        _check_checkpoint_tokenizer(cfg, ByteTokenizer())
        if check is not None:
            check(cfg)
        _save_checkpoint_tokenizer(cfg, ByteTokenizer())
        return cfg
    source = find_source(data.paths, data.glob, data.text_field)
    split = {"source": source.fingerprint(), "val_fraction": data.val_fraction, "seed": cfg.seed}
    with _bars(console, progress) as bar:
        masks: list[np.ndarray] = []

        def mask() -> np.ndarray:  # the validation documents: one reading pass, at most once
            if not masks:
                masks.append(source.val_mask(data.val_fraction, cfg.seed, bar("checking documents")))
            return masks[0]

        tokenizer = _tokenizer(cfg, source, split, mask, bar)
        dtype = token_dtype_for(tokenizer.vocab_size, data.token_dtype)
        _check_checkpoint_tokenizer(cfg, tokenizer)
        key = cache_key({**split, "tokenizer": tokenizer.digest, "dtype": dtype, "format": _FORMAT})
        entry_path = cache_root(cfg).resolve() / f"tokens-{key}"  # absolute: ranks may start elsewhere
        entry, cached = _cached_tokens(entry_path, console), True
        if entry is None:
            is_val = mask()
            documents = zip(source.documents(), is_val.tolist())
            entry, cached = write_tokens(entry_path, documents, tokenizer, dtype, bar("tokenizing documents", len(is_val))), False
    _check_length(entry, cfg.model.seq_len, source)
    fingerprint = f"tokens {entry.digest[:16]} ({entry.train_tokens:,} + {entry.val_tokens:,}), tokenizer {tokenizer.digest}"
    prepared = replace(cfg, model=replace(cfg.model, vocab_size=tokenizer.vocab_size),
                       data=replace(data, prepared=entry.path, fingerprint=fingerprint))
    if check is not None:
        check(prepared)
    _save_checkpoint_tokenizer(cfg, tokenizer)
    if console is not None:
        console.print(_report(source, tokenizer, entry, cached))
    return prepared


def prepare_on_rank0(cfg: Config, check: Callable[[Config], None] | None = None) -> Config:
    """Under a launcher that did not prepare (torchrun): global rank 0 prepares while the others wait
    (``check``: as ``prepare_data``'s, on rank 0).

    The others block in a broadcast on a gloo group of its own with a long timeout (tokenizing may
    take longer than a collective's), then receive the prepared config, or rank 0's error, which
    they all raise: bad input is the same ValueError on every rank.
    """
    import torch.distributed as dist

    if cfg.data.prepared is not None or cfg.data.is_shipped_bytes:
        return cfg
    group = dist.new_group(backend="gloo", timeout=_RANK0_WAIT)
    box: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        from rich.console import Console

        try:
            box[0] = prepare_data(cfg, Console(stderr=True), progress=sys.stderr.isatty(), check=check)
        except Exception as err:
            failure, box[0] = err, (type(err).__name__, str(err))
    dist.broadcast_object_list(box, src=0, group=group)
    dist.destroy_process_group(group)
    if failure is not None:
        raise failure
    if isinstance(box[0], tuple):
        kind, message = box[0]
        raise ValueError(message) if kind == "ValueError" else RuntimeError(f"rank 0 failed preparing the data: {message}")
    return box[0]


def open_corpus(data: DataConfig) -> Corpus:
    """The run's tokens on a rank: the prepared cache entry memory-mapped, or the shipped corpus."""
    if data.prepared is None:
        if not data.is_shipped_bytes:
            raise ValueError("data is not prepared: call modelpar.text.prepare_data(cfg) in the launching process "
                             "first (modelpar train and run_local do)")
        from modelpar.text.shipped import load_corpus

        return load_corpus()
    entry = read_tokens(data.prepared)
    if entry is None:
        raise ValueError(f"the prepared tokens {data.prepared!r} are gone (cache deleted?): start the run again")
    return entry.corpus()


def _cached_tokens(path: Path, console: Console | None) -> TokenFiles | None:
    """The verified entry at ``path``; None if there is none, or if it was damaged: then it is removed
    (the source is at hand to tokenize again) and ``console`` says which file was wrong."""
    try:
        entry = read_tokens(path)
        return None if entry is None else verify_tokens(entry)
    except DamagedCache as err:
        discard_tokens(path)
        if console is not None:
            console.print(f"modelpar train: warning: {err}; tokenizing the data again", highlight=False,
                          markup=False, soft_wrap=True)
        return None


def _tokenizer(cfg: Config, source: Source, split: dict[str, Any], mask: Callable[[], np.ndarray],
               bar: Callable[..., Any]) -> Tokenizer:
    """bytes; the given tokenizer.json; or for bpe: the checkpoint's (resume), the cached one, or a new one."""
    data = cfg.data
    if data.tokenizer == "bytes":
        return ByteTokenizer()
    if data.tokenizer != "bpe":
        path = Path(data.tokenizer).expanduser()
        if path.is_dir() and not (path / TOKENIZER_FILE).is_file():
            raise ValueError(f"tokenizer {data.tokenizer!r} is a folder without {TOKENIZER_FILE}")
        return load_tokenizer(path)
    saved = Path(cfg.checkpoint_dir) / TOKENIZER_FILE if cfg.checkpoint_dir else None
    if cfg.resume and saved is not None and saved.is_file():
        return load_tokenizer(saved)  # the one this run trained, even if the cache is gone
    path = cache_root(cfg) / f"bpe-{cache_key({**split, 'vocab_size': data.vocab_size})}" / TOKENIZER_FILE
    if path.is_file():
        return load_tokenizer(path)
    is_val = mask()
    train_docs = (text for text, v in zip(source.documents(), is_val.tolist()) if not v)
    assert data.vocab_size is not None
    bar("training the BPE tokenizer")
    tokenizer = train_bpe(train_docs, data.vocab_size, length=int((~is_val).sum()))
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_save(tokenizer, path)
    return tokenizer


def _check_checkpoint_tokenizer(cfg: Config, tokenizer: Tokenizer) -> None:
    """A resumed run must use the tokenizer saved with its checkpoints."""
    saved = Path(cfg.checkpoint_dir) / TOKENIZER_FILE if cfg.checkpoint_dir else None
    if not (cfg.resume and saved is not None and saved.is_file()):
        return
    theirs = load_tokenizer(saved)
    if theirs.digest != tokenizer.digest:
        raise ValueError(f"checkpoint_dir {cfg.checkpoint_dir!r} was trained with the tokenizer in {str(saved)!r} "
                         f"({describe(theirs)}), this run has {describe(tokenizer)}: resume with the same --tokenizer")


def _save_checkpoint_tokenizer(cfg: Config, tokenizer: Tokenizer) -> None:
    """``tokenizer.json`` in the checkpoint directory (none for bytes; a stale one there is removed)."""
    if not cfg.checkpoint_dir:
        return
    saved = Path(cfg.checkpoint_dir) / TOKENIZER_FILE
    if saved.is_file() and load_tokenizer(saved).digest != tokenizer.digest:
        saved.unlink()  # a fresh run's (a resumed one was checked to match)
    if tokenizer.name != "bytes" and not saved.is_file():
        saved.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(tokenizer, saved)


def _atomic_save(tokenizer: Tokenizer, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tokenizer.save(tmp)
    os.replace(tmp, path)


def _check_length(entry: TokenFiles, seq_len: int, source: Source) -> None:
    for split, n in (("training", entry.train_tokens), ("validation", entry.val_tokens)):
        if n <= seq_len:
            raise ValueError(f"data {source.describe()}: the {split} split has {n} tokens, fewer than seq_len + 1 "
                             f"({seq_len + 1}): give more text{', or raise --val-fraction' if split == 'validation' else ''}")


def _report(source: Source, tokenizer: Tokenizer, entry: TokenFiles, cached: bool) -> str:
    done = "cached" if cached else f"tokenized in {entry.seconds:.1f} s"
    total_bytes = entry.train_bytes + entry.val_bytes
    tokens = entry.train_tokens + entry.val_tokens
    return (f"data: {source.describe()}: {entry.documents:,} documents ({entry.val_documents:,} for validation), "
            f"{entry.train_tokens:,} + {entry.val_tokens:,} tokens, {describe(tokenizer)}, "
            f"{total_bytes / tokens:.2f} bytes/token, {done} ({entry.path})")


@contextmanager
def _bars(console: Console | None, enabled: bool) -> Iterator[Callable[..., Callable[[int], None] | None]]:
    """``bar(description, total=None)`` → an ``advance(n)`` for a new rich progress bar (None when disabled)."""
    if console is None or not enabled:
        yield lambda description, total=None: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:

        def bar(description: str, total: int | None = None) -> Callable[[int], None]:
            task = progress.add_task(description, total=total)
            return lambda n: progress.advance(task, n)

        yield bar
