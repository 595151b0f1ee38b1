"""Where the text comes from: the files and folders given with ``--data``, or the shipped corpus.

A *document* is the unit of the train/validation split:

- a UTF-8 text file is cut at line breaks into documents of about 64 k characters (a smaller
  file is one document), so a single large file still splits;
- a JSONL file (``.jsonl``, ``.ndjson``) holds one document per line, in its ``text_field``;
- a Parquet or Arrow file (``.parquet``, ``.arrow``; the ``data`` extra) one per row, read
  through ``datasets`` in streaming mode from the local file only.

``find_source`` checks what the file system alone can tell (a missing path, an empty file, a
folder without matching files); ``Source.val_mask`` then reads everything once and checks the
rest (a binary file, JSONL without the field) before anything is written.
"""

from __future__ import annotations

import fnmatch
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from modelpar._validate import json_error

__all__ = ["DOC_CHARS", "FileSource", "ShippedSource", "Source", "SourceFile", "find_source", "val_mask"]

DOC_CHARS = 64 * 1024  # a text file is cut into documents of this many characters, up to the next line break
_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}  # else text
_SPLIT_SALT = 0x5A11  # keeps the split's random stream apart from the batches' (same seed)


@dataclass(frozen=True)
class SourceFile:
    """One input file, as the file system describes it (what the cache key is made of)."""

    path: Path
    kind: str  # text, jsonl, parquet or arrow
    size: int
    mtime_ns: int


def val_mask(num_documents: int, val_fraction: float, seed: int, described: str, unsplit: str = "") -> np.ndarray:
    """Which documents are validation: ``max(1, round(n · fraction))`` of them, drawn with ``seed``.

    ``unsplit``: a text file larger than a document that gave one (no line break to cut at), for the message.
    """
    k = max(1, round(num_documents * val_fraction))
    if k >= num_documents:
        why = (f"; {unsplit} has no line break to cut at: add line breaks, or give the text as more files or as "
               "JSONL" if unsplit else "")
        raise ValueError(f"data {described} has {num_documents} document(s): too few to hold out "
                         f"{k} for validation and train on the rest (documents are whole files, JSONL lines or "
                         f"table rows; text files are cut at line breaks every {DOC_CHARS // 1024} k characters{why})")
    mask = np.zeros(num_documents, dtype=bool)
    mask[np.random.default_rng([seed, _SPLIT_SALT]).choice(num_documents, size=k, replace=False)] = True
    return mask


class FileSource:
    """Documents from files, in a fixed order (the paths as given, folders sorted)."""

    def __init__(self, files: list[SourceFile], text_field: str, given: tuple[str, ...] = ()) -> None:
        self.files, self.text_field, self.given = files, text_field, given

    def describe(self) -> str:
        size = sum(f.size for f in self.files)
        named = ", ".join(self.given[:2]) + (f" and {len(self.given) - 2} more" if len(self.given) > 2 else "")
        return f"{named} ({len(self.files)} file(s), {size / 1e6:.1f} MB)"

    def fingerprint(self) -> dict[str, Any]:
        return {"files": [(str(f.path), f.kind, f.size, f.mtime_ns) for f in self.files],
                "text_field": self.text_field if any(f.kind != "text" for f in self.files) else None}

    def documents(self) -> Iterator[str]:
        for f in self.files:
            yield from (text for text in _READERS[f.kind](f.path, self.text_field) if text)

    def val_mask(self, val_fraction: float, seed: int, advance: Callable[[int], None] | None = None) -> np.ndarray:
        """Read every document once (this checks them all) and draw the validation ones."""
        count, unsplit = 0, ""
        for f in self.files:
            here, longest = 0, 0
            for text in _READERS[f.kind](f.path, self.text_field):
                if text:
                    here, longest = here + 1, max(longest, len(text))
                    if advance:
                        advance(1)
            count += here
            if f.kind == "text" and here == 1 and longest > DOC_CHARS:  # one line longer than a document
                unsplit = unsplit or f"{str(f.path)!r} ({longest:,} characters)"
        if count == 0:
            raise ValueError(f"data {self.describe()} holds no text")
        return val_mask(count, val_fraction, seed, self.describe(), unsplit)


class ShippedSource:
    """The shipped corpus (``modelpar.text.shipped``) as two documents: its training text and its validation text.

    Its block split is kept, so a BPE run on it validates on the same text as a byte run.
    """

    def describe(self) -> str:
        return "the shipped corpus (Python documentation topics)"

    def fingerprint(self) -> dict[str, Any]:
        return {"shipped": "pydoc_topics"}

    def documents(self) -> Iterator[str]:
        from modelpar.text.shipped import load_corpus

        corpus = load_corpus()
        yield bytes(corpus.train).decode("utf-8")
        yield bytes(corpus.val).decode("utf-8")

    def val_mask(self, val_fraction: float, seed: int, advance: Callable[[int], None] | None = None) -> np.ndarray:
        return np.array([False, True])


Source = FileSource | ShippedSource


def find_source(paths: tuple[str, ...], glob: str, text_field: str) -> Source:
    """The source ``paths`` name (the shipped corpus when empty); ValueError for a path that cannot be used."""
    if not paths:
        return ShippedSource()
    files: dict[Path, SourceFile] = {}
    for given in paths:
        path = Path(given).expanduser()
        if not path.exists():
            raise ValueError(f"data path {given!r} does not exist")
        if path.is_dir():
            found = _folder_files(path, glob)
            if not found:
                raise ValueError(f"data folder {given!r} has no non-empty files matching --data-glob {glob!r} "
                                 "(searched recursively, hidden files skipped)")
        else:
            found = [path]
            if path.stat().st_size == 0:
                raise ValueError(f"data file {given!r} is empty")
        for p in found:
            stat = p.stat()
            kind = _KINDS.get(p.suffix.lower(), "text")
            files.setdefault(p.resolve(), SourceFile(p.resolve(), kind, stat.st_size, stat.st_mtime_ns))
    return FileSource(list(files.values()), text_field, paths)


def _folder_files(folder: Path, glob: str) -> list[Path]:
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).parts
        if any(part.startswith(".") for part in rel) or not fnmatch.fnmatch(p.name, glob):
            continue
        if p.is_file() and p.stat().st_size > 0:  # a folder's empty files (__init__.py) are skipped
            out.append(p)
    return out


def _text_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8", newline="") as f:  # newline="": \r\n stays as it is
            while chunk := f.read(DOC_CHARS):
                doc = chunk + f.readline()
                if "\x00" in doc:
                    raise ValueError(f"data file {str(path)!r} contains NUL bytes: is it a binary file? "
                                     "(pick the text files with --data-glob)")
                yield doc
    except UnicodeDecodeError as err:
        raise ValueError(f"data file {str(path)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x}): "
                         "is it a binary file? (pick the text files with --data-glob)") from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"data file {str(path)!r} line {number} is not JSON ({json_error(err)})") from None
                yield _field(record, text_field, f"data file {str(path)!r} line {number}")
    except UnicodeDecodeError:
        raise ValueError(f"data file {str(path)!r} is not UTF-8 text: is it a binary file?") from None


def _table_documents(path: Path, text_field: str) -> Iterator[str]:
    kind = _KINDS[path.suffix.lower()]
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data file {str(path)!r}: reading {kind} files needs the data extra "
                         "(pip install -e '.[data]')") from None
    with tempfile.TemporaryDirectory(prefix="modelpar-datasets-") as tmp:  # datasets' lock files go here
        try:
            table = datasets.load_dataset(kind, data_files=[str(path)], split="train", streaming=True, cache_dir=tmp)
            columns = list(table.features or {})
        except Exception as err:  # a file that is not what its suffix says: pyarrow's message, one line
            raise ValueError(f"data file {str(path)!r} cannot be read as {kind}: "
                             f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        if text_field not in columns:
            raise ValueError(f"data file {str(path)!r} has no column {text_field!r} (--text-field); "
                             f"its columns: {', '.join(columns)}")
        for number, row in enumerate(table, 1):
            yield _field(row, text_field, f"data file {str(path)!r} row {number}")


def _field(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where} has no field {text_field!r} (--text-field); it has: {fields}")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} must be a string, got {type(text).__name__}")
    return text


_READERS = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _table_documents,
            "arrow": _table_documents}
