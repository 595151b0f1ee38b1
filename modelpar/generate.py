"""Sample a continuation from a single-process model (CPU or GPU), with a KV cache.

The prompt is run once (prefill); every new token then runs one position through the model,
attending to the cached keys and values of the ones before it. The model sees at most
``seq_len`` tokens: when the context would grow past that, it restarts from its last
``seq_len // 2`` tokens (one prefill), so a long generation still costs one position per token
on average. ``use_cache=False`` recomputes the whole context for every token — the same
windows, the same tokens, s times the work (the tests compare the two).

Sampling: logits / ``temperature`` (0: greedy), the ``top_k`` largest kept, then one draw from a
CPU generator seeded with ``seed``: the same tokens on every device for a seed. Padded vocabulary
ids are never sampled. ``stream`` yields each token as it is sampled (``modelpar generate`` prints
them as they come); ``generate`` is its list. There is no length limit: the window slides.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from modelpar._validate import check_int, check_number
from modelpar.model import Transformer
from modelpar.tensor_parallel import KVCache

__all__ = ["NonFiniteLogits", "generate", "sample_next", "stream"]


class NonFiniteLogits(ValueError):
    """The model's first logits hold NaN or inf: its weights are not finite (checked once, on the prompt)."""


def sample_next(logits: torch.Tensor, vocab_size: int, temperature: float, top_k: int | None,
                generator: torch.Generator) -> int:
    """One token id from the last position's logits [V_pad]: ids ≥ ``vocab_size`` (padding) excluded."""
    logits = logits[:vocab_size].double().cpu()
    if temperature == 0.0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < vocab_size:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def generate(model: Transformer, prompt: Sequence[int] | torch.Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> list[int]:
    """``max_new_tokens`` token ids following ``prompt`` (ids), sampled from a whole single-process model."""
    return list(stream(model, prompt, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                       use_cache=use_cache))


def stream(model: Transformer, prompt: Sequence[int] | torch.Tensor, max_new_tokens: int, *,
           temperature: float = 1.0, top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> Iterator[int]:
    """``generate``'s tokens one by one, each as soon as it is sampled (the arguments checked at the call, before
    any token): a long generation shows its text as it comes, and a consumer may stop early."""
    cfg = model.cfg
    if model.embed is None or model.head is None or len(model.layers) != cfg.layers or model.head.tp_world != 1:
        raise ValueError("generate needs the whole model on one process (build_stage(cfg) with no group)")
    tokens = [int(t) for t in (prompt.flatten().tolist() if isinstance(prompt, torch.Tensor) else prompt)]
    if not tokens:
        raise ValueError("prompt must hold at least one token, got none")
    bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt ids must be in [0, {cfg.vocab_size}), got {bad[0]}")
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    temperature = check_number("temperature", temperature)
    if top_k is not None:
        check_int("top_k", top_k, minimum=1)
    check_int("seed", seed, minimum=0)
    return _sampled(model, tokens, max_new_tokens, temperature, top_k, seed, use_cache)


@torch.no_grad()
def _sampled(model: Transformer, tokens: list[int], max_new_tokens: int, temperature: float, top_k: int | None,
             seed: int, use_cache: bool) -> Iterator[int]:
    """The sampling loop of ``stream`` (arguments checked); the model is back in its mode when it ends or is closed."""
    cfg = model.cfg
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    keep = max(1, cfg.seq_len // 2)
    start = max(0, len(tokens) - cfg.seq_len)  # the context window is tokens[start:]
    cache = KVCache(cfg.seq_len) if use_cache else None
    was_training = model.training
    model.eval()
    try:
        for i in range(max_new_tokens):
            if len(tokens) - start > cfg.seq_len:  # the window is full: restart from its last tokens
                start = len(tokens) - keep
                if cache is not None:
                    cache.reset()
            fed = start + (cache.pos if cache is not None else 0)
            ids = torch.tensor([tokens[fed:]], device=device)
            logits = model(ids, cache)[0, -1]
            if i == 0 and not bool(torch.isfinite(logits[:cfg.vocab_size]).all()):
                raise NonFiniteLogits("the model's logits are not finite (NaN or inf): its weights are not finite")
            tokens.append(sample_next(logits, cfg.vocab_size, temperature, top_k, generator))
            yield tokens[-1]
    finally:
        model.train(was_training)
