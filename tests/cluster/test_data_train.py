"""Training on prepared text with real gloo processes: every split and a resumed run draw the same
batches from the memory-mapped tokens (losses equal a plain single-process loop, float64); under a
launcher that did not prepare (torchrun), rank 0 prepares and every rank gets its result or its error."""

import dataclasses
import re

import pytest
import torch
from oracle import plain_loop

from modelpar.corpus import load_corpus
from modelpar.model import ModelConfig
from modelpar.text import DataConfig, open_corpus, prepare_data
from modelpar.training import TrainConfig, train

pytestmark = pytest.mark.timeout(600)  # several whole runs per case: over 200 s seen on a crowded 2-core machine

TOL = 1e-9


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """24 files of real text (the shipped corpus cut into pieces: any text would do)."""
    root = tmp_path_factory.mktemp("text")
    text = bytes(load_corpus().train).decode()
    for i in range(24):
        (root / f"part{i:02d}.txt").write_text(text[i * 8000:(i + 1) * 8000], encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def base(folder, tmp_path_factory):
    """A prepared float64 run with a BPE tokenizer of 320 tokens (trained here, in the launching process)."""
    data = DataConfig(paths=(str(folder),), tokenizer="bpe", vocab_size=320, val_fraction=0.1,
                      cache_dir=str(tmp_path_factory.mktemp("cache")))
    cfg = TrainConfig(model=ModelConfig(hidden=32, heads=4, layers=2, seq_len=16), data=data, steps=3, batch_size=8,
                      microbatches=2, precision="fp64", warmup=1, lr=1e-2, eval_every=0, eval_batches=1, tp=1, pp=1,
                      dp=1, seed=1)
    return prepare_data(cfg)


def reference(cfg: TrainConfig) -> tuple[list[float], float]:
    """Losses and final validation loss of a plain loop over the memory-mapped corpus, one process."""
    run = plain_loop(cfg, open_corpus(cfg.data))
    return run.losses, run.val


def _train(cfg):
    torch.set_num_threads(1)
    r = train(cfg)
    return r.losses, r.val[-1][1], r.start_step, r.tokens_per_byte, r.unigram_baseline


def _try_train(cfg):
    try:
        return "ok", _train(cfg)
    except ValueError as err:
        return "error", str(err)


def test_every_split_and_a_resumed_run_train_on_the_same_batches(c2, base, tmp_path):
    assert base.model.vocab_size == 320
    want_losses, want_val = reference(base)
    for changes in ({"tp": 2}, {"pp": 2}, {"dp": 2}):
        for losses, val, *_ in c2.run(_train, dataclasses.replace(base, **changes)):
            assert losses == pytest.approx(want_losses, abs=TOL, rel=0)
            assert val == pytest.approx(want_val, abs=TOL, rel=0)
    stopped = dataclasses.replace(base, pp=2, checkpoint_dir=str(tmp_path), exit_after=2)
    assert c2.run(_train, stopped)[0][0] == pytest.approx(want_losses[:2], abs=TOL, rel=0)
    losses, val, start, tokens_per_byte, unigram = c2.run(_train, dataclasses.replace(stopped, exit_after=0,
                                                                                       resume=True))[0]
    assert start == 2 and losses == pytest.approx(want_losses, abs=TOL, rel=0)
    corpus = open_corpus(base.data)
    assert 0.3 < tokens_per_byte == corpus.tokens_per_byte < 0.7 and unigram == corpus.unigram_baseline()


def test_without_a_launcher_rank_0_prepares_and_every_rank_gets_the_result_or_the_error(c2, base, tmp_path):
    fresh = dataclasses.replace(base, pp=2, data=dataclasses.replace(base.data, prepared=None, cache_dir=str(tmp_path)),
                                model=dataclasses.replace(base.model, vocab_size=256))
    results = c2.run(_train, fresh)  # rank 0 trains the tokenizer and tokenizes again, into tmp_path
    assert results[0][0] == results[1][0] == pytest.approx(reference(base)[0], abs=TOL, rel=0)
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["bpe", "tokens"]
    missing = dataclasses.replace(fresh, data=dataclasses.replace(fresh.data, paths=(str(tmp_path / "nope"),)))
    results = c2.run(_try_train, missing)
    assert all(kind == "error" and re.search(r"data path '.*nope' does not exist", text) for kind, text in results)
