"""The GPT arch against an independent definition: nanoGPT's modules, written here in plain PyTorch.

``tests/oracle.py`` checks every parallel split against one process, but builds that process's model
with the package's own ``build_stage``, ``lr_at`` and ``param_groups``. This module checks them: the
one-process model's logits, loss and every gradient equal nanoGPT's (Karpathy's ``model.py``: learned
positions, pre-LayerNorm blocks, GELU MLP, causal attention, optionally tied embeddings) with the
weights copied by name, in float64; and three AdamW steps of the oracle's loop equal three steps of
nanoGPT with its own optimizer groups and the documented learning-rate schedule.
"""

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
from oracle import plain_loop
from torch import nn

from modelpar.corpus import load_corpus
from modelpar.model import LMLoss, ModelConfig, build_stage
from modelpar.training import TrainConfig

pytestmark = pytest.mark.numerics  # float64 against an independent definition at 1e-12

CFG = ModelConfig(vocab_size=50, seq_len=12, hidden=16, heads=4, layers=3)  # 50 ids padded to 64 rows


# --- nanoGPT, as its model.py writes it (dropout 0) -----------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # q, k, v for all heads, in a batch
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.tril(torch.ones(T, T, dtype=torch.bool)).logical_not(), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_embd: int, n_head: int, n_layer: int, tied: bool) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.transformer.wte.weight  # weight tying

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1))
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# nanoGPT's names for modelpar's
_NAMES = [(r"embed\.word\.weight", "transformer.wte.weight"), (r"embed\.pos", "transformer.wpe.weight"),
          (r"layers\.(\d+)\.ln1\.", r"transformer.h.\1.ln_1."), (r"layers\.(\d+)\.ln2\.", r"transformer.h.\1.ln_2."),
          (r"layers\.(\d+)\.attn\.qkv\.", r"transformer.h.\1.attn.c_attn."),
          (r"layers\.(\d+)\.attn\.proj\.", r"transformer.h.\1.attn.c_proj."),
          (r"layers\.(\d+)\.mlp\.fc1\.", r"transformer.h.\1.mlp.c_fc."),
          (r"layers\.(\d+)\.mlp\.fc2\.", r"transformer.h.\1.mlp.c_proj."),
          (r"norm\.", "transformer.ln_f."), (r"head\.weight", "lm_head.weight")]


def nano_name(name: str) -> str:
    for pattern, replacement in _NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name, count=1)
    raise KeyError(f"no nanoGPT name for {name}")


def nano_copy(cfg: ModelConfig, seed: int) -> tuple[nn.Module, NanoGPT]:
    """modelpar's one-process model and nanoGPT with the same weights (the padded vocabulary rows dropped)."""
    assert cfg.arch == "gpt" and cfg.ffn_hidden == 4 * cfg.hidden and cfg.norm_eps == 1e-5  # nanoGPT's fixed choices
    ours = build_stage(cfg, seed=seed, dtype=torch.float64)
    nano = NanoGPT(cfg.vocab_size, cfg.seq_len, cfg.hidden, cfg.heads, cfg.layers, cfg.tie_embeddings).double()
    theirs = dict(nano.named_parameters())
    mine = dict(ours.named_parameters())
    assert sorted(map(nano_name, mine)) == sorted(theirs)  # the same parameters, no more, no fewer
    with torch.no_grad():
        for name, p in mine.items():
            q = theirs[nano_name(name)]
            if name in ("embed.word.weight", "head.weight"):
                assert not p[cfg.vocab_size:].any()  # padding rows are zero
                p = p[:cfg.vocab_size]
            q.copy_(p)
    return ours, nano


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_loss_and_every_gradient_equal_nanogpt(tied):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    ours, nano = nano_copy(cfg, seed=4)
    gen = torch.Generator().manual_seed(0)
    ids, targets = (torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=gen) for _ in range(2))
    logits = ours(ids)
    loss = LMLoss(cfg.vocab_size)(logits, targets)
    want_logits, want_loss = nano(ids, targets)
    torch.testing.assert_close(logits[..., :cfg.vocab_size], want_logits, rtol=0, atol=1e-12)
    assert not logits[..., cfg.vocab_size:].any()  # the padded columns: zero rows of the head
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-14)
    loss.backward()
    want_loss.backward()
    theirs = dict(nano.named_parameters())
    for name, p in ours.named_parameters():
        grad = p.grad[:cfg.vocab_size] if name in ("embed.word.weight", "head.weight") else p.grad
        torch.testing.assert_close(grad, theirs[nano_name(name)].grad, rtol=0, atol=1e-12, msg=name)


def test_the_oracle_loop_equals_nanogpt_trained_by_hand():
    """Three steps of ``plain_loop`` against nanoGPT with its optimizer groups (decay on parameters of
    2 or more dims, none on biases and LayerNorms) and the schedule docs/training.md states."""
    cfg = TrainConfig(model=dataclasses.replace(CFG, vocab_size=256, seq_len=16), steps=3, batch_size=8, microbatches=1,
                      precision="fp64", warmup=1, lr=1e-2, clip=0.5, tp=1, pp=1, dp=1, eval_every=0, eval_batches=1)
    _, nano = nano_copy(cfg.model, seed=cfg.seed)  # plain_loop builds the same weights from the same seed
    decay = [p for p in nano.parameters() if p.dim() >= 2]
    no_decay = [p for p in nano.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr(step: int) -> float:  # linear warm-up over `warmup` steps, then cosine decay to lr/10 at `steps`
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / (cfg.steps - cfg.warmup)
        return cfg.lr / 10 + (cfg.lr - cfg.lr / 10) * 0.5 * (1 + math.cos(math.pi * progress))

    corpus, losses = load_corpus(), []
    for step in range(cfg.steps):
        x, y = corpus.batch("train", step, cfg.batch_size, cfg.model.seq_len, cfg.seed)
        for group in opt.param_groups:
            group["lr"] = lr(step)
        opt.zero_grad()
        _, loss = nano(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(nano.parameters(), cfg.clip)
        opt.step()
        losses.append(loss.item())
    run = plain_loop(cfg, corpus)
    assert run.losses == pytest.approx(losses, abs=1e-12, rel=0) and losses[-1] < losses[0]
    theirs = dict(nano.named_parameters())
    for name, p in run.params.items():
        p = p[:cfg.model.vocab_size] if name in ("embed.word.weight", "head.weight") else p
        torch.testing.assert_close(p, theirs[nano_name(name)].detach(), rtol=0, atol=1e-12, msg=name)
