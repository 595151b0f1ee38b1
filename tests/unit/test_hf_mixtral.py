"""Hugging Face interop for mixtures of experts: modelpar ⇄ ``MixtralForCausalLM``, fp32 logits within 1e-5 both ways."""

import dataclasses

import pytest
import torch

from modelpar import hf
from modelpar.model import ModelConfig, build_stage

CFG = ModelConfig(arch="llama", vocab_size=300, seq_len=16, hidden=32, heads=4, kv_heads=2, layers=2, ffn=48,
                  norm_eps=1e-6, rope_theta=500.0, init_std=0.1, experts=4, top_k=2)
TOL = 1e-5


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_modelpar_to_mixtral_gives_the_same_logits(transformers, tmp_path):
    model = build_stage(CFG, seed=4).eval()
    hf.save_hf(model, CFG, tmp_path)
    theirs = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    assert theirs.config.num_local_experts == 4 and theirs.config.num_experts_per_tok == 2
    with torch.no_grad():
        ours, want = model(_ids(1))[..., :300], theirs(_ids(1)).logits
    torch.testing.assert_close(ours, want, rtol=0, atol=TOL)
    assert want.abs().max() > 0.1
    assert hf.read_hf_config(tmp_path) == CFG


def test_mixtral_to_modelpar_gives_the_same_logits(transformers, tmp_path):
    config = transformers.MixtralConfig(**{k: v for k, v in hf.hf_config(CFG).items() if k not in ("dtype", "torch_dtype")})
    torch.manual_seed(0)
    theirs = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # transformers' init leaves the stacked experts small; make them count
        for name, p in theirs.named_parameters():
            if "experts" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    theirs.save_pretrained(tmp_path)
    model = hf.load_hf(tmp_path).eval()
    assert model.cfg == CFG
    with torch.no_grad():
        torch.testing.assert_close(model(_ids(2))[..., :300], theirs(_ids(2)).logits, rtol=0, atol=TOL)


@pytest.mark.parametrize("change", [{"shared_experts": 1}, {"moe_every": 2}, {"router": "sigmoid"},
                                    {"capacity_factor": 1.0}])
def test_variants_without_a_mixtral_layout_are_refused(change):
    with pytest.raises(ValueError, match=f"Mixtral layout has no {next(iter(change))}"):
        hf.hf_config(dataclasses.replace(CFG, **change))
