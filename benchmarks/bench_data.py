"""Your own text: the same GPT trained on the same real text with byte tokens and with a BPE.

The text is this Python's standard library, its top-level ``.py`` files (found at run time,
~4.7 MB for Python 3.11, not the shipped corpus), split 95/5 by document. Both runs use the same
model, steps, batch and context length (in tokens, so the BPE run sees ~3-4× more text per step);
validation is compared in bits per byte, which does not depend on the tokenizer, beside each
tokenizer's unigram baseline in the same units. Tokenizing time: a fresh cache (BPE training
included), then a second start, which finds the cache and reads no text.

    python benchmarks/bench_data.py [--steps 300] [--vocab-size 4096] [--tp 1 --pp 1 --dp 1]
"""

from __future__ import annotations

import argparse
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from modelpar.text import DataConfig, open_corpus, prepare_data
from modelpar.text.cache import read_tokens
from modelpar.training import TrainConfig
from modelpar.training.start import run_local


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = tuple(str(p) for p in sorted(stdlib.glob("*.py")))
    base = TrainConfig(tp=args.tp, pp=args.pp, dp=args.dp, steps=args.steps, eval_every=0, eval_batches=16)
    rows = []
    with tempfile.TemporaryDirectory(prefix="modelpar-bench-data-") as cache:  # a fresh cache: tokenizing is timed
        for tokenizer, vocab in (("bytes", None), ("bpe", args.vocab_size)):
            cfg = replace(base, data=DataConfig(paths=files, tokenizer=tokenizer, vocab_size=vocab,
                                                val_fraction=args.val_fraction, cache_dir=cache))
            t0 = time.perf_counter()
            cfg = prepare_data(cfg)
            fresh = time.perf_counter() - t0
            t0 = time.perf_counter()
            prepare_data(replace(cfg, data=replace(cfg.data, prepared=None)))
            again = time.perf_counter() - t0
            corpus = open_corpus(cfg.data)
            entry = read_tokens(cfg.data.prepared) if cfg.data.prepared else None  # read now: the cache is temporary
            tokenize = entry.seconds if entry else 0.0
            t0 = time.perf_counter()
            result = run_local(cfg)
            wall = time.perf_counter() - t0
            rows.append((tokenizer, cfg, corpus, fresh, tokenize, again, result, wall))
            print(f"  ran {tokenizer}: {result.tokens_per_s:,.0f} tokens/s, {wall:.0f} s", flush=True)
    text_mb = sum(Path(f).stat().st_size for f in files) / 1e6
    m = base.model
    print(f"\n{len(files)} top-level .py files of {stdlib} ({text_mb:.1f} MB), val fraction {args.val_fraction}, "
          f"GPT h={m.hidden} L={m.layers} s={m.seq_len}, batch {base.batch_size}, {args.steps} steps, "
          f"(t, p, d) = ({args.tp}, {args.pp}, {args.dp})\n")
    print(f"{'tokenizer':>10} {'V':>5} {'bytes/token':>11} {'prepare s':>9} {'tokenize s':>10} {'again s':>7} {'params':>9} "
          f"{'val nats/tok':>12} {'val bits/byte':>13} {'unigram bits/byte':>17} {'tokens/s':>9} {'bytes/s':>8} "
          f"{'train s':>7}")
    for tokenizer, cfg, corpus, fresh, tokenize, again, r, wall in rows:
        val = r.val[-1][1]
        print(f"{tokenizer:>10} {cfg.model.vocab_size:>5} {1 / corpus.tokens_per_byte:>11.2f} {fresh:>9.1f} "
              f"{tokenize:>10.1f} "
              f"{again:>7.2f} {r.num_parameters:>9,} {val:>12.4f} {r.bits_per_byte(val):>13.4f} "
              f"{r.bits_per_byte(r.unigram_baseline):>17.4f} {r.tokens_per_s:>9,.0f} "
              f"{r.tokens_per_s / corpus.tokens_per_byte:>8,.0f} {wall:>7.0f}")


if __name__ == "__main__":
    main()
