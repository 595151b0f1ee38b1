"""Training on your own text, in one process: input forms, the split, tokenizers, the token cache,
batches from the memory-mapped tokens, bits per byte, and bad input (one line, exit 2, nothing written)."""

import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import modelpar.text.prepare as prepare_module
from modelpar.cli import main
from modelpar.corpus import load_corpus
from modelpar.model import ModelConfig
from modelpar.text import ByteTokenizer, Corpus, DataConfig, load_tokenizer, open_corpus, prepare_data, train_bpe
from modelpar.text.sources import DOC_CHARS, find_source, val_mask
from modelpar.training import TrainConfig
from modelpar.training.state import check_meta, run_meta

TEXT = bytes(load_corpus().train).decode()  # real English and code, not generated
UNICODE = "Grüße, 世界! naïve café — ½ ∑ 🙂 ありがとう\r\n\ttabs and  spaces\n"


def write_texts(folder: Path, n: int = 30, size: int = 3000) -> list[str]:
    """``n`` text files of real text in ``folder`` and a subfolder; return their texts in file order."""
    texts = []
    for i in range(n):
        text = TEXT[i * size:(i + 1) * size] + (UNICODE if i % 7 == 0 else "")
        path = folder / ("sub" if i % 2 else "") / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="")
        texts.append((path, text))
    return [t for _, t in sorted(texts)]


def config(tmp_path: Path, **data) -> TrainConfig:
    return TrainConfig(model=ModelConfig(hidden=32, seq_len=16), tp=1, pp=1, seed=3,
                       data=DataConfig(cache_dir=str(tmp_path / "cache"), **data))


def tokens_of(cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    c = open_corpus(cfg.data)
    return np.asarray(c.train), np.asarray(c.val)


# --- input forms ------------------------------------------------------------------------------------
def test_a_folder_of_text_files_bytes_tokens_are_the_documents(tmp_path):
    texts = write_texts(tmp_path / "in")
    (tmp_path / "in" / ".hidden").mkdir()
    (tmp_path / "in" / ".hidden" / "skip.txt").write_text("never read")
    (tmp_path / "in" / "empty.txt").write_text("")  # a folder's empty files are skipped
    (tmp_path / "in" / "notes.md").write_text("not matched by the glob")
    cfg = prepare_data(config(tmp_path, paths=(str(tmp_path / "in"),), glob="*.txt"))
    train, val = tokens_of(cfg)
    is_val = val_mask(30, 0.01, 3, "")
    assert is_val.sum() == 1  # max(1, round(30 * 0.01))
    assert train.dtype == np.uint16 and cfg.model.vocab_size == 256
    assert bytes(train.astype(np.uint8)) == "".join(t for t, v in zip(texts, is_val) if not v).encode()
    assert bytes(val.astype(np.uint8)) == "".join(t for t, v in zip(texts, is_val) if v).encode()


def test_a_large_text_file_is_cut_into_documents_at_line_breaks(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text(TEXT[:200_000], encoding="utf-8")
    docs = list(find_source((str(path),), "*", "text").documents())
    assert len(docs) == 4 and "".join(docs) == TEXT[:200_000]
    assert all(len(d) >= DOC_CHARS and d.endswith("\n") for d in docs[:-1])


def test_jsonl_with_a_text_field(tmp_path):
    records = [{"id": i, "body": TEXT[i * 500:(i + 1) * 500]} for i in range(40)]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")  # a blank line is skipped
    cfg = prepare_data(config(tmp_path, paths=(str(path),), text_field="body", val_fraction=0.05))
    train, val = tokens_of(cfg)
    is_val = val_mask(40, 0.05, 3, "")
    assert is_val.sum() == 2
    assert bytes(val.astype(np.uint8)) == "".join(r["body"] for r, v in zip(records, is_val) if v).encode()
    assert len(train) + len(val) == sum(len(r["body"].encode()) for r in records)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_parquet_and_arrow_through_datasets(tmp_path, kind):
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("datasets")
    table = pa.table({"text": [TEXT[i * 400:(i + 1) * 400] for i in range(20)], "n": list(range(20))})
    path = tmp_path / f"data.{kind}"
    if kind == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
    docs = list(find_source((str(path),), "*", "text").documents())
    assert docs == table.column("text").to_pylist()
    with pytest.raises(ValueError, match=r"has no column 'body' \(--text-field\); its columns: text, n"):
        list(find_source((str(path),), "*", "body").documents())


def test_the_split_is_by_document_and_follows_the_seed():
    masks = {seed: val_mask(1000, 0.01, seed, "") for seed in range(3)}
    assert all(m.sum() == 10 for m in masks.values())
    assert np.array_equal(masks[0], val_mask(1000, 0.01, 0, "")) and not np.array_equal(masks[0], masks[1])
    assert val_mask(3, 0.01, 0, "").sum() == 1
    with pytest.raises(ValueError, match="has 1 document"):
        val_mask(1, 0.01, 0, "x")


# --- tokenizers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bpe():
    return train_bpe([TEXT[:100_000], UNICODE * 20], vocab_size=400)


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_decode_encode_is_the_identity_on_unicode_text(bpe, text):
    for tokenizer in (bpe, ByteTokenizer()):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_bpe_shortens_text_and_saves_and_loads(bpe, tmp_path):
    assert bpe.vocab_size == 400 and bpe.eos_id == 0
    assert len(bpe.encode(TEXT[200_000:210_000])) < 10_000 / 1.5  # 144 merges: > 1.5 bytes per token on unseen text
    assert bpe.decode(bpe.encode(UNICODE)) == UNICODE
    bpe.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path)  # a folder with a tokenizer.json
    assert again.digest == bpe.digest and again.encode(UNICODE) == bpe.encode(UNICODE)
    (tmp_path / "bytes-run").mkdir()
    assert isinstance(load_tokenizer(tmp_path / "bytes-run"), ByteTokenizer)  # no tokenizer.json: bytes
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a tokenizer.json file"):
        load_tokenizer(tmp_path / "bad.json")


def test_bpe_run_saves_its_tokenizer_and_encodes_each_document_then_eos(tmp_path):
    texts = write_texts(tmp_path / "in", n=12, size=6000)
    cfg = config(tmp_path, paths=(str(tmp_path / "in"),), tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    cfg = prepare_data(replace(cfg, checkpoint_dir=str(tmp_path / "ck")))
    tok = load_tokenizer(tmp_path / "ck")
    assert tok.vocab_size == cfg.model.vocab_size == 300
    train, val = tokens_of(cfg)
    is_val = val_mask(12, 0.1, 3, "")
    docs = [tok.decode(d.tolist()) for d in np.split(train, np.flatnonzero(train == tok.eos_id) + 1)[:-1]]
    assert docs == [t for t, v in zip(texts, is_val) if not v]
    assert val[-1] == tok.eos_id and tok.decode(val.tolist()) == "".join(t for t, v in zip(texts, is_val) if v)


def test_a_given_tokenizer_file_is_used(tmp_path, bpe):
    write_texts(tmp_path / "in", n=5)
    bpe.save(tmp_path / "tok.json")
    cfg = prepare_data(config(tmp_path, paths=(str(tmp_path / "in"),), tokenizer=str(tmp_path / "tok.json"),
                              val_fraction=0.2))
    assert cfg.model.vocab_size == 400 and bpe.digest in cfg.data.fingerprint


# --- the cache --------------------------------------------------------------------------------------
def test_a_second_start_reuses_the_tokens_and_a_changed_file_tokenizes_again(tmp_path, monkeypatch):
    write_texts(tmp_path / "in", n=10)
    writes, trainings = [], []
    real_write, real_train = prepare_module.write_tokens, prepare_module.train_bpe
    monkeypatch.setattr(prepare_module, "write_tokens", lambda *a, **k: writes.append(1) or real_write(*a, **k))
    monkeypatch.setattr(prepare_module, "train_bpe", lambda *a, **k: trainings.append(1) or real_train(*a, **k))
    cfg = config(tmp_path, paths=(str(tmp_path / "in"),), tokenizer="bpe", vocab_size=300, val_fraction=0.1)
    first = prepare_data(cfg)
    second = prepare_data(cfg)
    assert (len(writes), len(trainings)) == (1, 1) and second == first
    path = tmp_path / "in" / "sub" / "doc03.txt"
    path.write_text(path.read_text() + "one more line\n")
    third = prepare_data(cfg)
    assert (len(writes), len(trainings)) == (2, 2) and third.data.prepared != first.data.prepared
    assert third.data.fingerprint != first.data.fingerprint
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touched, same text
    fourth = prepare_data(cfg)
    assert len(writes) == 3 and fourth.data.fingerprint == third.data.fingerprint  # the same tokens: resumable
    assert not any(p.name.startswith(".") for p in (tmp_path / "cache").iterdir())  # no temporary leftovers


def _zero(path):
    path.write_bytes(bytes(path.stat().st_size))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-6])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_meta(change):
    def edit(path):
        meta = json.loads(path.read_text())
        change(meta)
        path.write_text(json.dumps(meta))
    return edit


@pytest.mark.parametrize("name, damage, why", [
    ("train.bin", _zero, "{file!r} does not match its sha256 in meta.json: it is damaged"),
    ("val.bin", _truncate, "{file!r} has {size:,} bytes, meta.json says {expected:,} (uint16 tokens): it is damaged"),
    ("counts.npy", _flip, "{file!r} does not match its sha256 in meta.json: it is damaged"),
    ("meta.json", lambda p: p.write_text("{garbage"),
     "{file!r} cannot be read (Expecting property name enclosed in double quotes at column 2)"),
    ("meta.json", _edit_meta(lambda m: m.pop("dtype")),
     "{file!r} has no 'dtype' (meta.json was not written by this modelpar, or was damaged)"),
    ("meta.json", _edit_meta(lambda m: m.update(train_tokens="many")),
     "{file!r} has a bad 'train_tokens' (meta.json was not written by this modelpar, or was damaged)"),
    ("meta.json", _edit_meta(lambda m: m.update(digest="0" * 64)),
     "{file!r} gives digest 0000000000000000..., its token files {digest}...: it is damaged"),
    ("meta.json", lambda p: p.unlink(), None),
])
def test_a_damaged_cache_entry_is_named_and_tokenized_again(tmp_path, name, damage, why):
    """Issue 35 #7, #13: the cache is checked against meta.json's sizes and sha256 when it is used; a damaged
    entry is named in one line and rebuilt from the source, so the run trains on the real tokens and its
    fingerprint (for resume) is the tokens' own, not meta.json's claim."""
    from io import StringIO

    from rich.console import Console

    write_texts(tmp_path / "in", n=10)
    cfg = config(tmp_path, paths=(str(tmp_path / "in"),), val_fraction=0.2)
    first = prepare_data(cfg)
    entry = Path(first.data.prepared)
    tokens = [np.array(t) for t in tokens_of(first)]  # copies: the maps would show the damage
    file = entry / name
    size, expected = file.stat().st_size - 6, file.stat().st_size
    damage(file)
    if why is not None and "cannot be read" in why:  # the ranks only map the entry: one line there too
        with pytest.raises(ValueError, match=f"token cache file {re.escape(repr(str(file)))} cannot be read"):
            open_corpus(first.data)
    said = StringIO()
    again = prepare_data(cfg, Console(file=said, width=400))
    digest = first.data.fingerprint.split()[1]
    message = (f"token cache entry {str(entry)!r} has no meta.json" if why is None else
               "token cache file " + why.format(file=str(file), size=size, expected=expected, digest=digest))
    assert said.getvalue().splitlines()[0] == f"modelpar train: warning: {message}; tokenizing the data again"
    assert again == first and all(np.array_equal(a, b) for a, b in zip(tokens_of(again), tokens))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [entry.name]  # no leftovers


def test_a_damaged_cache_is_retrained_on_the_command_line(tmp_path, capsys):
    """The issue's case: a same-size zeroed train.bin; the second run warns and gets the first's losses."""
    write_texts(tmp_path / "in", n=6)
    flags = ["train", "--data", str(tmp_path / "in"), "--tp", "1", "--pp", "1", "--hidden", "32", "--heads", "2",
             "--layers", "1", "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--precision", "fp64",
             "--eval-batches", "1", "--no-progress", "--cache-dir", str(tmp_path / "cache"), "--val-fraction", "0.5"]
    assert main([*flags, "--out", str(tmp_path / "a")]) == 0
    (train,) = (tmp_path / "cache").glob("tokens-*/train.bin")
    _zero(train)
    capsys.readouterr()
    assert main([*flags, "--out", str(tmp_path / "b")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"modelpar train: warning: token cache file {str(train)!r} does not match its sha256 in "
                        "meta.json: it is damaged; tokenizing the data again"]
    a, b = (json.loads((tmp_path / out / "summary.json").read_text()) for out in "ab")
    assert b["losses"] == a["losses"] and b["config"]["data"]["fingerprint"] == a["config"]["data"]["fingerprint"]


# --- batches, bits per byte, the unigram baseline -----------------------------------------------------
def test_batches_from_the_memory_map_equal_batches_from_memory(tmp_path):
    write_texts(tmp_path / "in", n=10)
    cfg = prepare_data(config(tmp_path, paths=(str(tmp_path / "in"),), val_fraction=0.2))
    mapped = open_corpus(cfg.data)
    assert isinstance(mapped.train, np.memmap)
    loaded = Corpus(train=np.array(mapped.train), val=np.array(mapped.val))
    for split, step in (("train", 0), ("train", 5), ("val", 2)):
        for a, b in zip(mapped.batch(split, step, 8, 16, seed=3), loaded.batch(split, step, 8, 16, seed=3)):
            assert torch.equal(a, b)
    assert mapped.unigram_baseline() == pytest.approx(loaded.unigram_baseline(), rel=1e-12)


def test_the_shipped_corpus_is_the_default_source():
    cfg = TrainConfig()
    assert prepare_data(cfg) is cfg and open_corpus(cfg.data) is load_corpus()
    assert cfg.data.fingerprint == "shipped corpus, bytes"


def test_bits_per_byte_hand_checked():
    c = Corpus(train=np.zeros(10, np.uint16), val=np.zeros(30, np.uint16), vocab_size=300, val_bytes=120)
    assert c.tokens_per_byte == 0.25
    assert c.bits_per_byte(2.0) == pytest.approx(2.0 * 0.25 / math.log(2))
    counts = np.zeros((2, 300), np.int64)
    counts[0, :2], counts[1, 1] = (6, 2), 30
    c = replace(c, counts=counts)  # train: id 0 six times, id 1 twice; val: id 1 only
    assert c.unigram_baseline() == pytest.approx(-math.log(3 / (8 + 300)))  # add-one smoothing over V = 300


def test_resume_is_refused_on_other_data():
    cfg = TrainConfig()
    other = replace(cfg, data=replace(cfg.data, fingerprint="tokens 0123456789abcdef (10 + 2), tokenizer bytes"))
    with pytest.raises(ValueError, match=r"written with data='shipped corpus, bytes', this run has data='tokens 0123"):
        check_meta(run_meta(cfg, 5, []), other, "ck")


# --- bad input: one line, exit code 2, nothing written, no rank started --------------------------------
def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "empty.txt").write_text("")
    (tmp / "nothing").mkdir()
    (tmp / "nothing" / "a.md").write_text("text, but not *.txt")
    (tmp / "image.txt").write_bytes(bytes(range(256)) * 4)
    (tmp / "nul.txt").write_bytes(b"text\x00more")
    (tmp / "rows.jsonl").write_text('{"content": "hello"}\n')
    (tmp / "ok.txt").write_text(TEXT[:5000])
    return [
        (["--data", str(tmp / "missing")], "data path '.*missing' does not exist"),
        (["--data", str(tmp / "empty.txt")], "data file '.*empty.txt' is empty"),
        (["--data", str(tmp / "nothing"), "--data-glob", "*.txt"], "has no non-empty files matching --data-glob '\\*.txt'"),
        (["--data", str(tmp / "image.txt")], "is not UTF-8 text .*binary file"),
        (["--data", str(tmp / "nul.txt")], "contains NUL bytes"),
        (["--data", str(tmp / "rows.jsonl")], "line 1 has no field 'text' \\(--text-field\\); it has: content"),
        (["--data", str(tmp / "ok.txt"), "--tokenizer", "bpe", "--vocab-size", "255"], "vocab_size must be >= 257, got 255"),
        (["--data", str(tmp / "ok.txt"), "--tokenizer", "bpe", "--vocab-size", "65536", "--token-dtype", "uint16"],
         "vocab_size \\(token_dtype uint16\\) must be <= 65535, got 65536"),
        (["--tokenizer", "bpe"], "tokenizer bpe needs vocab_size"),
        (["--vocab-size", "512"], "vocab_size is for tokenizer bpe"),
        (["--tokenizer", str(tmp / "none.json")], "tokenizer '.*none.json' does not exist"),
        (["--data", str(tmp / "ok.txt"), "--val-fraction", "0"], "val_fraction must be > 0.0, got 0.0"),
    ]


def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch):
    import modelpar.training.start as launch_module

    monkeypatch.setattr(launch_module, "LocalCluster", lambda *a, **k: pytest.fail("a rank was started"))
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    cases = _bad_inputs(inputs)
    before = sorted(inputs.rglob("*"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for flags, message in cases:
        code = main(["train", *flags, "--tp", "1", "--pp", "1", "--checkpoint-dir", str(work / "ck"),
                     "--out", str(work / "out"), "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert code == 2, (flags, err)
        assert err.startswith("modelpar train: error: ") and "\n" not in err, err
        import re

        assert re.search(message, err), (message, err)
    assert sorted(inputs.rglob("*")) == before and list(work.iterdir()) == []  # no cache, checkpoint or output


def test_a_bpe_run_is_priced_with_the_vocabulary_it_trained(tmp_path):
    """The summary's prediction uses the config the ranks trained: a BPE vocabulary is known only once the data
    is prepared (it was priced with the byte vocabulary of 256: parameters -53% at --vocab-size 4096)."""
    write_texts(tmp_path / "in", n=6)
    assert main(["train", "--data", str(tmp_path / "in"), "--tokenizer", "bpe", "--vocab-size", "320", "--tp", "1",
                 "--pp", "1", "--hidden", "32", "--heads", "2", "--layers", "1", "--seq-len", "16", "--batch-size", "4",
                 "--steps", "1", "--eval-batches", "1", "--no-progress", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    params = summary["prediction"]["parameters_bytes"]
    assert summary["config"]["model"]["vocab_size"] == 320 and params["predicted"] == params["measured"]
