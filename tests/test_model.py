"""The GPT on one process: against a hand-written reference forward, its split, init and checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from modelpar.model import GPT, GPTLoss, ModelConfig, build_stage, init_parameters, split_stage, stage_layers

CFG = ModelConfig(vocab_size=64, seq_len=12, hidden=16, heads=4, layers=4)


def _reference_logits(sd: dict, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """nanoGPT-style forward written from the definition: pre-LN, causal attention, learned positions."""
    b, s = ids.shape
    h, a = cfg.hidden, cfg.heads
    x = sd["embed.word.weight"][ids] + sd["embed.pos"][:s]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.layers):
        p = lambda n: sd[f"layers.{i}.{n}"]  # noqa: E731
        y = F.layer_norm(x, (h,), p("ln1.weight"), p("ln1.bias"))
        q, k, v = (y @ p("attn.qkv.weight").T + p("attn.qkv.bias")).split(h, dim=-1)
        q, k, v = (u.view(b, s, a, h // a).transpose(1, 2) for u in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(h // a)).masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + y @ p("attn.proj.weight").T + p("attn.proj.bias")
        y = F.layer_norm(x, (h,), p("ln2.weight"), p("ln2.bias"))
        y = F.gelu(y @ p("mlp.fc1.weight").T + p("mlp.fc1.bias"))
        x = x + y @ p("mlp.fc2.weight").T + p("mlp.fc2.bias")
    x = F.layer_norm(x, (h,), sd["norm.weight"], sd["norm.bias"])
    head = sd["embed.word.weight"] if cfg.tie_embeddings else sd["head.weight"]
    return x @ head.T


@pytest.mark.parametrize("tie", [False, True])
def test_forward_equals_the_definition(tie):
    cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": tie})
    model = build_stage(cfg, seed=3, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    sd = dict(model.named_parameters())
    torch.testing.assert_close(model(ids), _reference_logits(sd, cfg, ids), rtol=0, atol=1e-12)
    assert len(sd) == len(dict(model.named_parameters(remove_duplicate=False))) - tie
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_attention_is_causal():
    model = build_stage(CFG, seed=0, dtype=torch.float64)
    ids = torch.randint(0, CFG.vocab_size, (1, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % CFG.vocab_size
    a, b = model(ids), model(changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_initial_loss_is_log_vocab_and_init_follows_gpt2():
    model = build_stage(ModelConfig(), seed=0, dtype=torch.float64)
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))
    loss = GPTLoss()(model(ids), ids).item()
    assert abs(loss - math.log(256)) < 0.1  # near-uniform predictions at init
    p = dict(model.named_parameters())
    assert abs(p["layers.0.mlp.fc1.weight"].std().item() - 0.02) < 1e-3
    assert abs(p["layers.0.mlp.fc2.weight"].std().item() - 0.02 / math.sqrt(8)) < 5e-4  # 1/√(2L)
    assert torch.equal(p["layers.1.ln2.weight"], torch.ones(128, dtype=torch.float64))
    assert not p["layers.3.attn.qkv.bias"].any()


def test_stages_hold_their_parts_and_the_same_weights_as_the_whole():
    whole = dict(build_stage(CFG, seed=5).named_parameters())
    seen = {}
    for s in range(4):
        stage = build_stage(CFG, s, 4, seed=5)
        assert list(stage.layers) == [str(s)]
        assert (stage.embed is not None) == (s == 0) and (stage.head is not None) == (s == 3)
        seen.update(dict(stage.named_parameters()))
    assert seen.keys() == whole.keys()
    for name, p in whole.items():
        assert torch.equal(seen[name], p), name


def test_tied_head_on_a_later_stage_starts_as_the_embedding():
    cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": True})
    first, last = build_stage(cfg, 0, 2, seed=1), build_stage(cfg, 1, 2, seed=1)
    whole = build_stage(cfg, seed=1)
    assert whole.head.weight is whole.embed.word.weight
    assert torch.equal(first.embed.word.weight, last.head.weight)
    assert torch.equal(whole.embed.word.weight, last.head.weight)
    assert first.head is None and last.embed is None


def test_split_is_done_on_meta_without_memory():
    with torch.device("meta"):
        model = GPT(ModelConfig(hidden=4096, heads=32, layers=48, vocab_size=50304, seq_len=2048))
    stage = split_stage(model, 1, 4)
    assert list(stage.layers) == [str(i) for i in range(12, 24)]
    assert all(p.is_meta for p in stage.parameters())


def test_init_does_not_depend_on_dtype_beyond_rounding():
    a = build_stage(CFG, seed=9, dtype=torch.float64)
    b = build_stage(CFG, seed=9, dtype=torch.float32)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa.float(), pb), n
    c = init_parameters(build_stage(CFG, seed=10, dtype=torch.float64), seed=9)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("change, kwargs, message", [
    ({"hidden": 24, "heads": 6}, {"tp": 4}, r"heads \(6\) must be divisible by tp \(4\)"),
    ({"hidden": 18, "heads": 4}, {}, r"hidden \(18\) must be divisible by heads \(4\)"),
    ({"vocab_size": 250}, {"tp": 4}, r"vocab_size \(250\) must be divisible by tp \(4\)"),
    ({"layers": 6}, {"stages": 4}, r"layers \(6\) must be divisible by the number of pipeline stages"),
    ({"seq_len": 10}, {"tp": 4, "sequence_parallel": True}, r"seq_len \(sequence parallel\) \(10\)"),
    ({"ffn_mult": 0}, {}, r"ffn_mult must be >= 1, got 0"),
])
def test_bad_shapes_are_named(change, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**CFG.__dict__, **change}).check(**kwargs)


def test_stage_layers_and_bad_stage():
    assert list(stage_layers(CFG, 1, 2)) == [2, 3]
    with pytest.raises(ValueError, match="stage must be <= 1, got 2"):
        stage_layers(CFG, 2, 2)


def test_bad_token_ids_and_lengths():
    model = build_stage(CFG)
    with pytest.raises(ValueError, match=r"seq <= seq_len \(12\)"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids must be in \[0, 64\), got 64"):
        model(torch.full((1, 4), 64))
