"""Hugging Face interop: modelpar's Llama ⇄ ``LlamaForCausalLM`` (fp32 logits within 1e-5 both ways),
including a Hugging Face directory loaded shard by shard at t = 2, p = 2 on real processes."""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from modelpar import hf
from modelpar.corpus import load_corpus
from modelpar.model import ModelConfig, build_stage

# 300 ids (padded to 320 inside modelpar), 2 kv heads for 4 query heads
CFG = ModelConfig(arch="llama", vocab_size=300, seq_len=16, hidden=32, heads=4, kv_heads=2, layers=4, ffn=96,
                  norm_eps=1e-6, rope_theta=500.0, init_std=0.1)
TOL = 1e-5


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def transformers():
    """The optional test dependency, imported here only: the ranks of the c4 never load it."""
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, transformers):
    """A random LlamaForCausalLM (transformers' own init) saved as Hugging Face does, in several
    safetensors files with an index (as larger checkpoints are)."""
    config = transformers.LlamaConfig(**{k: v for k, v in hf.hf_config(CFG).items() if k not in ("dtype", "torch_dtype")})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    with torch.no_grad():
        logits = model(_ids(300)).logits
    return path, logits


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, kv_heads=1, tie_embeddings=True)], ids=["gqa", "mqa-tied"])
def test_modelpar_to_hugging_face_gives_the_same_logits(transformers, cfg, tmp_path):
    model = build_stage(cfg, seed=4).eval()
    (tmp_path / "tok.json").write_text("{}")
    hf.save_hf(model, cfg, tmp_path / "out", tokenizer=tmp_path / "tok.json")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert theirs.config.num_key_value_heads == cfg.num_kv_heads and theirs.config.vocab_size == 300
    ids = _ids(300, 1)
    with torch.no_grad():
        ours, want = model(ids)[..., :300], theirs(ids).logits
    torch.testing.assert_close(ours, want, rtol=0, atol=TOL)
    assert want.abs().max() > 0.1  # not a vacuous comparison
    assert hf.read_hf_config(tmp_path / "out") == cfg


def test_hugging_face_to_modelpar_on_one_process(hf_dir):
    path, want = hf_dir
    model = hf.load_hf(path).eval()
    assert model.cfg == CFG
    with torch.no_grad():
        torch.testing.assert_close(model(_ids(300))[..., :300], want, rtol=0, atol=TOL)
    assert not model.embed.word.weight[300:].any()  # the padded rows
    sd = hf.from_hf_state_dict(hf.to_hf_state_dict(model.state_dict(), model.cfg), model.cfg)
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


# --- t = 2, p = 2 on four processes ------------------------------------------------------------------
def _stage_logits(path: str) -> torch.Tensor | None:
    """Ranks 2·pp + tp: each builds its stage and shard from the directory; the last stage's logits."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    pp, tp = divmod(rank, 2)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cfg = hf.read_hf_config(path)
    stage = build_stage(cfg, pp, 2, group=groups[pp]).eval()
    hf.load_hf_shards(stage, path)
    with torch.no_grad():
        if pp == 0:
            dist.send(stage(_ids(300)).contiguous(), dst=rank + 2)
            return None
        x = torch.empty(2, 16, cfg.hidden)
        dist.recv(x, src=rank - 2)
        shard = stage(x)
        parts = [torch.empty_like(shard) for _ in range(2)]
        dist.all_gather(parts, shard, group=groups[1])
        return torch.cat(parts, -1)[..., :300]


def _train_first_loss(path: str, checkpoint_dir: str) -> float:
    from modelpar.training import TrainConfig, train

    torch.set_num_threads(1)
    cfg = TrainConfig(model=hf.read_hf_config(path), init_from=str(path), tp=2, pp=2, dp=1, steps=1, batch_size=4,
                      microbatches=2, eval_every=0, eval_batches=1, precision="fp32", checkpoint_dir=checkpoint_dir)
    return train(cfg).losses[0]


def test_hugging_face_directory_at_t2_p2_gives_the_same_logits(c4, hf_dir):
    path, want = hf_dir
    results = c4.run(_stage_logits, str(path))
    assert results[0] is None and results[1] is None
    for logits in results[2:]:
        torch.testing.assert_close(logits, want, rtol=0, atol=TOL)


def test_init_from_at_t2_p2_and_export_back_to_hugging_face(transformers, c4, hf_dir, tmp_path, capsys):
    from modelpar.cli import main
    from modelpar.export import load_model

    path, _ = hf_dir
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    x, y = load_corpus().batch("train", 0, 4, 16, 0)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
    losses = c4.run(_train_first_loss, str(path), str(tmp_path / "ckpt"))
    assert losses == pytest.approx([want] * 4, abs=TOL, rel=0)  # the run started from the directory's weights
    # the trained run back to the Hugging Face layout: modelpar export --format hf
    assert main(["export", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "model.safetensors")]) == 0
    capsys.readouterr()
    trained = load_model(tmp_path / "model.safetensors")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = _ids(300, 2)
    with torch.no_grad():
        ours, exported = trained(ids)[..., :300], theirs(ids).logits
        torch.testing.assert_close(exported, ours, rtol=0, atol=TOL)
        assert (exported - model(ids).logits).abs().max() > 1e-4  # one optimizer step moved the weights
    # and sampled from, straight from the checkpoint directory (bytes: the run had no tokenizer.json)
    from modelpar.generate import generate

    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "ab", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    tokens = generate(trained, list(b"ab"), 5, temperature=0.0)
    assert capsys.readouterr().out == "ab" + bytes(tokens).decode("utf-8", errors="replace") + "\n"


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, r"model_type must be 'llama' \(LlamaForCausalLM\) or 'mixtral' .*, got 'mistral'"),
    ({"attention_bias": True}, r"unsupported Llama settings \['attention_bias'\]"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, r"unsupported Llama settings \['rope scaling'\]"),
    ({"hidden_act": "gelu", "head_dim": 4}, r"unsupported Llama settings \['hidden_act', 'head_dim'\]"),
])
def test_other_layouts_are_refused(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**hf.hf_config(CFG), **change}))
    with pytest.raises(ValueError, match=message):
        hf.read_hf_config(tmp_path)


def test_init_from_checks_the_shape_and_the_directory(hf_dir, tmp_path):
    path, _ = hf_dir
    with pytest.raises(ValueError, match=r"seq_len \(32\) must be <= max_position_embeddings .* \(16\)"):
        hf.read_hf_config(path, seq_len=32)
    with pytest.raises(ValueError, match=r"hidden = 64 differs from .*config.json \(32\)"):
        hf.check_init_from(dataclasses.replace(CFG, hidden=64, heads=8), path)
    with pytest.raises(ValueError, match=r"no config.json"):
        hf.read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf.hf_config(CFG)))
    with pytest.raises(ValueError, match=r"no model.safetensors or model.safetensors.index.json"):
        hf.check_init_from(CFG, tmp_path)
    with pytest.raises(ValueError, match=r"arch 'llama'"):
        hf.save_hf(build_stage(ModelConfig()), ModelConfig(), tmp_path / "gpt")


def test_export_hf_to_a_bad_out_is_one_line(tmp_path, capsys):
    from modelpar.cli import main

    assert main(["export", str(tmp_path), "--format", "hf", "--out", str(tmp_path / "x" / "y")]) == 2
    assert "--out must name a directory" in capsys.readouterr().err
