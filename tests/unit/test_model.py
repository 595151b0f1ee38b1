"""The model on one process: against hand-written reference forwards (GPT and Llama), its split,
init, padding, the cost model's counts and the shape checks."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from modelpar.model import LMLoss, ModelConfig, Transformer, build_stage, init_parameters, layers_of_stage, split_stage

CFG = ModelConfig(vocab_size=64, seq_len=12, hidden=16, heads=4, layers=4)
LLAMA = ModelConfig(arch="llama", vocab_size=50, seq_len=12, hidden=32, heads=4, kv_heads=2, layers=2, init_std=0.1)


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


def _llama_reference_logits(sd: dict, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Llama written from the paper: RMSNorm, RoPE on (x_i, x_{i+d/2}) pairs, GQA, SwiGLU, no biases."""
    b, s = ids.shape
    h, a, g, d = cfg.hidden, cfg.heads, cfg.num_kv_heads, cfg.head_dim
    rms = lambda x, w: w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)  # noqa: E731
    angle = torch.arange(s, dtype=torch.float64)[:, None] / cfg.rope_theta ** (torch.arange(d // 2) * 2 / d)

    def rope(u):  # rotate each pair (u_i, u_{i+d/2}) by its angle
        u1, u2 = u[..., : d // 2], u[..., d // 2:]
        return torch.cat([u1 * angle.cos() - u2 * angle.sin(), u2 * angle.cos() + u1 * angle.sin()], -1)

    x = sd["embed.word.weight"][ids]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(cfg.layers):
        p = lambda n: sd[f"layers.{i}.{n}"]  # noqa: E731
        y = rms(x, p("ln1.weight"))
        wk, wv = p("attn.kv.weight").chunk(2)
        q = rope((y @ p("attn.q.weight").T).view(b, s, a, d).transpose(1, 2))
        k = rope((y @ wk.T).view(b, s, g, d).transpose(1, 2))
        v = (y @ wv.T).view(b, s, g, d).transpose(1, 2)
        k, v = (u[:, [j // (a // g) for j in range(a)]] for u in (k, v))  # query head j uses kv head j // (a/g)
        att = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(b, s, h) @ p("attn.proj.weight").T
        gate, up = (rms(x, p("ln2.weight")) @ p("mlp.fc1.weight").T).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ p("mlp.fc2.weight").T
    head = sd["embed.word.weight"] if cfg.tie_embeddings else sd["head.weight"]
    return rms(x, sd["norm.weight"]) @ head.T


def _ids(cfg: ModelConfig, seed: int = 0, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.numerics
@pytest.mark.parametrize("cfg, reference", [
    (CFG, _reference_logits), (dataclasses.replace(CFG, tie_embeddings=True), _reference_logits),
    (LLAMA, _llama_reference_logits), (dataclasses.replace(LLAMA, kv_heads=1, tie_embeddings=True), _llama_reference_logits),
    (dataclasses.replace(LLAMA, kv_heads=0), _llama_reference_logits),
], ids=["gpt", "gpt-tied", "llama-gqa", "llama-mqa-tied", "llama-mha"])
def test_forward_equals_the_definition(cfg, reference):
    model = build_stage(cfg, seed=3, dtype=torch.float64)
    ids = _ids(cfg)
    sd = dict(model.named_parameters())
    torch.testing.assert_close(model(ids), reference(sd, cfg, ids), rtol=0, atol=1e-12)
    assert len(sd) == len(dict(model.named_parameters(remove_duplicate=False))) - cfg.tie_embeddings
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_llama_has_no_biases_no_positions_and_untied_head():
    names = dict(build_stage(LLAMA).named_parameters())
    assert not any(n.endswith("bias") for n in names) and "embed.pos" not in names
    assert names["head.weight"] is not names["embed.word.weight"]
    assert names["layers.0.attn.kv.weight"].shape == (2 * 2 * 8, 32)  # [Wk; Wv], 2 kv heads of 8
    assert names["layers.0.mlp.fc1.weight"].shape == (2 * 128, 32)  # [W_gate; W_up], ffn = 8·32/3 → 128
    assert ModelConfig(arch="llama", hidden=4096).ffn_hidden == 10944  # 8·4096/3 = 10922.7 (Llama-7B rounds to 256: 11008)
    assert ModelConfig(arch="llama").ffn_hidden == 384 and ModelConfig(arch="llama", ffn=100).ffn_hidden == 100


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt", "llama"])
def test_attention_is_causal(cfg):
    model = build_stage(cfg, seed=0, dtype=torch.float64)
    ids = _ids(cfg, 1, batch=1)
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % cfg.vocab_size
    a, b = model(ids), model(changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.numerics
def test_padded_vocabulary_rows_are_zero_and_get_no_probability():
    assert (LLAMA.padded_vocab_size, CFG.padded_vocab_size, ModelConfig().padded_vocab_size) == (64, 64, 256)
    assert ModelConfig(vocab_size=50257).padded_vocab_size == 50304  # GPT-2's, as Megatron pads it
    model = build_stage(LLAMA, seed=2, dtype=torch.float64)
    assert model.embed.word.weight.shape == (64, 32) and not model.head.weight[50:].any()
    assert model.embed.word.weight[:50].abs().min() > 0
    ids = _ids(LLAMA)
    logits = model(ids)
    loss = LMLoss(LLAMA.vocab_size)(logits, ids)
    torch.testing.assert_close(loss, F.cross_entropy(logits[..., :50].flatten(0, 1), ids.flatten()), rtol=0, atol=1e-14)
    grad, = torch.autograd.grad(loss, logits)
    assert not grad[..., 50:].any() and grad[..., :50].abs().min() > 0  # softmax of a padded id is exactly 0
    with pytest.raises(ValueError, match=r"ids must be in \[0, 50\), got 60"):  # a fresh model checks its first call
        build_stage(LLAMA, seed=2, dtype=torch.float64)(torch.full((1, 4), 60))
    model(torch.full((1, 4), 49))  # later calls of one rank's model are not checked (a device sync): the data side is


def test_initial_loss_is_log_vocab_and_init_follows_gpt2():
    model = build_stage(ModelConfig(), seed=0, dtype=torch.float64)
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))
    loss = LMLoss(256)(model(ids), ids).item()
    assert abs(loss - math.log(256)) < 0.1  # near-uniform predictions at init
    p = dict(model.named_parameters())
    assert abs(p["layers.0.mlp.fc1.weight"].std().item() - 0.02) < 1e-3
    assert abs(p["layers.0.mlp.fc2.weight"].std().item() - 0.02 / math.sqrt(8)) < 5e-4  # 1/√(2L)
    assert torch.equal(p["layers.1.ln2.weight"], torch.ones(128, dtype=torch.float64))
    assert not p["layers.3.attn.qkv.bias"].any()


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt", "llama"])
def test_stages_hold_their_parts_and_the_same_weights_as_the_whole(cfg):
    whole = dict(build_stage(cfg, seed=5).named_parameters())
    seen = {}
    for s in range(cfg.layers):
        stage = build_stage(cfg, s, cfg.layers, seed=5)
        assert list(stage.layers) == [str(s)]
        assert (stage.embed is not None) == (s == 0) and (stage.head is not None) == (s == cfg.layers - 1)
        seen.update(dict(stage.named_parameters()))
    assert seen.keys() == whole.keys()
    for name, p in whole.items():
        assert torch.equal(seen[name], p), name


def test_tied_head_on_a_later_stage_starts_as_the_embedding():
    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    first, last = build_stage(cfg, 0, 2, seed=1), build_stage(cfg, 1, 2, seed=1)
    whole = build_stage(cfg, seed=1)
    assert whole.head.weight is whole.embed.word.weight
    assert torch.equal(first.embed.word.weight, last.head.weight)
    assert torch.equal(whole.embed.word.weight, last.head.weight)
    assert first.head is None and last.embed is None


def test_split_is_done_on_meta_without_memory():
    with torch.device("meta"):
        model = Transformer(ModelConfig(hidden=4096, heads=32, layers=48, vocab_size=50304, seq_len=2048))
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


# --- the cost model counts what the model computes ----------------------------------------------
@pytest.mark.parametrize("cfg", [
    ModelConfig(), LLAMA, dataclasses.replace(LLAMA, kv_heads=1, tie_embeddings=True, ffn=96),
    ModelConfig(arch="llama", vocab_size=1000, hidden=64, heads=8, kv_heads=2, layers=3, seq_len=16),
], ids=["gpt-default", "llama-gqa", "llama-mqa-tied", "llama-padded-vocab"])
def test_parameter_and_flop_counts_equal_the_cost_model(cfg):
    model = build_stage(cfg, dtype=torch.float64)
    spec = cfg.spec()
    final_norm = model.norm.weight.numel() + (model.norm.bias.numel() if cfg.arch == "gpt" else 0)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters() == spec.params + final_norm
    ids = _ids(cfg, batch=2)
    # torch's count of every matmul, forward and backward (the math kernel: CPU flash attention is not counted)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        LMLoss(cfg.vocab_size)(model(ids), ids).backward()
    tokens = ids.numel()
    assert counter.get_total_flops() == spec.model_flops(tokens) == cfg.flops_per_token() * tokens


# --- bad shapes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, kwargs, message", [
    ({"hidden": 24, "heads": 6}, {"tp": 4}, r"heads \(6\) must be divisible by tp \(4\)"),
    ({"hidden": 18, "heads": 4}, {}, r"hidden \(18\) must be divisible by heads \(4\)"),
    ({"vocab_size": 250}, {"tp": 3, "stages": 1}, r"heads \(4\) must be divisible by tp \(3\)"),
    ({"vocab_size": 250, "heads": 6, "hidden": 24}, {"tp": 3},
     r"padded vocabulary \(vocab_size 250 rounded up to a multiple of 64\) \(256\) must be divisible by tp \(3\)"),
    ({"layers": 6}, {"stages": 4}, None),  # uneven: 1, 2, 2, 1 (modelpar.layer_split)
    ({"layers": 2}, {"stages": 5}, r"p·v = 5 chunks need at least 3 layers, the model has 2"),
    ({"seq_len": 10}, {"tp": 4, "sequence_parallel": True}, r"seq_len \(sequence parallel\) \(10\)"),
    ({"ffn": -1}, {}, r"ffn must be >= 0, got -1"),
    ({"arch": "t5"}, {}, r"arch must be one of \{gpt, llama\}, got 't5'"),
    ({"kv_heads": 2}, {}, r"kv_heads \(2\) needs arch 'llama'"),
    ({"arch": "llama", "kv_heads": 3}, {}, r"heads \(4\) must be divisible by kv_heads \(3\)"),
    ({"arch": "llama", "heads": 8, "hidden": 48, "kv_heads": 2}, {"tp": 8, "stages": 4}, None),
    ({"arch": "llama", "heads": 12, "hidden": 48, "kv_heads": 6}, {"tp": 4},
     r"kv_heads \(6\) and tp \(4\) must divide one another"),
    ({"arch": "llama", "hidden": 12, "heads": 4}, {}, r"head dimension .* \(3\) must be divisible by 2"),
    ({"arch": "llama", "ffn": 100}, {"tp": 8, "stages": 2, "sequence_parallel": False},
     r"heads \(4\) must be divisible by tp \(8\)"),
    ({"norm_eps": 0.0}, {}, r"norm_eps must be > 0.0, got 0.0"),
])
def test_bad_shapes_are_named(change, kwargs, message):
    cfg = dataclasses.replace(CFG, **change)
    if message is None:
        assert cfg.check(**kwargs) is cfg
        return
    with pytest.raises(ValueError, match=message):
        cfg.check(**kwargs)


def test_stage_layers_and_bad_stage():
    assert list(layers_of_stage(CFG, 1, 2)) == [2, 3]
    six = dataclasses.replace(CFG, layers=6)  # the planner's uneven default, and a pinned split
    assert [list(layers_of_stage(six, s, 4)) for s in range(4)] == [[0], [1, 2], [3, 4], [5]]
    assert [list(layers_of_stage(six, s, 3, (0, 4, 2))) for s in range(3)] == [[], [0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match=r"stage_layers 3,0,3: only the first and last chunk may be empty"):
        layers_of_stage(six, 0, 3, (3, 0, 3))
    with pytest.raises(ValueError, match=r"stage_layers 3,2: sums to 5, not the model's 6 layers"):
        layers_of_stage(six, 0, 2, (3, 2))
    with pytest.raises(ValueError, match="stage must be <= 1, got 2"):
        layers_of_stage(CFG, 2, 2)


def test_bad_token_ids_and_lengths():
    model = build_stage(CFG)
    with pytest.raises(ValueError, match=r"seq <= seq_len \(12\)"):
        model(torch.zeros(1, 13, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ids must be in \[0, 64\), got 64"):
        model(torch.full((1, 4), 64))
    with pytest.raises(ValueError, match=r"model config: unknown key 'ffn_mult'; allowed: vocab_size, seq_len, hidden"):
        ModelConfig.from_dict({"ffn_mult": 4})
    assert ModelConfig.from_dict(LLAMA.to_dict()) == LLAMA
