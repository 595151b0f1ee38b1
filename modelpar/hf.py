"""Hugging Face interop: modelpar's Llama-style model ⇄ a ``LlamaForCausalLM`` directory
(``MixtralForCausalLM`` for a mixture of experts in every layer, plain top-k softmax routing).

A directory holds ``config.json`` and ``model.safetensors`` (or, for larger models, several
safetensors files listed in ``model.safetensors.index.json``), plus ``tokenizer.json`` when there
is one, as ``save_pretrained`` writes them. The two layouts already agree on the numerics —
rotary embedding on the two halves of each head (HF's ``rotate_half``), key/value head j serving
query heads j·a/g … (j+1)·a/g − 1 (HF's ``repeat_kv``), RMSNorm as HF computes it — so the
conversion is renaming, splitting our fused blocks ([Wk; Wv], [W_gate; W_up]) and dropping or
adding the padded vocabulary rows:

    modelpar                          Hugging Face
    embed.word.weight [V_pad, h]      model.embed_tokens.weight [V, h]
    layers.i.ln1.weight               model.layers.i.input_layernorm.weight
    layers.i.attn.q.weight            model.layers.i.self_attn.q_proj.weight
    layers.i.attn.kv.weight           model.layers.i.self_attn.{k_proj, v_proj}.weight
    layers.i.attn.proj.weight         model.layers.i.self_attn.o_proj.weight
    layers.i.ln2.weight               model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.fc1.weight           model.layers.i.mlp.{gate_proj, up_proj}.weight
    layers.i.mlp.fc2.weight           model.layers.i.mlp.down_proj.weight
    norm.weight                       model.norm.weight
    head.weight [V_pad, h]            lm_head.weight [V, h] (absent when tied)
    layers.i.mlp.router.weight        model.layers.i.block_sparse_moe.gate.weight [E, h]              (Mixtral)
    layers.i.mlp.experts.gate_up      ….block_sparse_moe.experts.{e}.{w1 (gate), w3 (up)}.weight [F, h]
      [E, 2F, h]                      for e = 0 … E-1, in that order
    layers.i.mlp.experts.down         ….block_sparse_moe.experts.{e}.w2.weight [h, F]
      [E, h, F]

The Mixtral names are those of the published checkpoints, which ``save_pretrained`` still writes
(``transformers`` 5 stacks the experts in memory, as modelpar does, and converts on load and save).
A stacked [E, n, m] tensor is its E·(blocks) Hugging Face tensors concatenated along dim 0, viewed.

``load_hf_shards`` fills one rank's pipeline stage and tensor-parallel shards reading only the
slices it holds (``safe_open(...).get_slice``), so `modelpar train --init-from DIR` works at any split.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelpar.model import ModelConfig, Transformer, build_stage
from modelpar.tensor_parallel import param_layout

__all__ = ["check_init_from", "from_hf_state_dict", "hf_config", "hf_names", "load_hf", "load_hf_shards",
           "read_hf_config", "save_hf", "to_hf_state_dict"]

CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER_NAMES = {  # modelpar name inside a layer -> its Hugging Face tensors, one per fused block
    "ln1.weight": ["input_layernorm.weight"],
    "attn.q.weight": ["self_attn.q_proj.weight"],
    "attn.kv.weight": ["self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.proj.weight": ["self_attn.o_proj.weight"],
    "ln2.weight": ["post_attention_layernorm.weight"],
    "mlp.fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.fc2.weight": ["mlp.down_proj.weight"],
    "mlp.router.weight": ["block_sparse_moe.gate.weight"],
}
_EXPERT_NAMES = {"mlp.experts.gate_up": ("w1", "w3"), "mlp.experts.down": ("w2",)}  # per expert, in block order
_VOCAB = {"embed.word.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}


def hf_names(name: str, cfg: ModelConfig) -> list[str]:
    """The Hugging Face tensors behind modelpar parameter ``name``, in fused-block order."""
    if name == "head.weight" and cfg.tie_embeddings:
        return [_VOCAB["embed.word.weight"]]
    if name in _VOCAB:
        return [_VOCAB[name]]
    if name == "norm.weight":
        return ["model.norm.weight"]
    match = _LAYER.fullmatch(name)
    if match is not None and match.group(2) in _EXPERT_NAMES:
        return [f"model.layers.{match.group(1)}.block_sparse_moe.experts.{e}.{w}.weight"
                for e in range(cfg.experts) for w in _EXPERT_NAMES[match.group(2)]]
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"parameter {name!r} has no Hugging Face Llama counterpart (is the model arch 'llama'?)")
    return [f"model.layers.{match.group(1)}.{leaf}" for leaf in _LAYER_NAMES[match.group(2)]]


# --- config -----------------------------------------------------------------------------------
def _mixtral(cfg: ModelConfig) -> dict[str, Any]:
    """The Mixtral keys of a mixture-of-experts config (only the variant Mixtral has: every layer,
    softmax top-k, no shared experts, dropless); {} for a dense model."""
    if not cfg.experts:
        return {}
    other = {"shared_experts": cfg.shared_experts != 0, "moe_every": cfg.moe_every != 1,
             "router": cfg.router != "softmax", "capacity_factor": cfg.capacity_factor is not None}
    bad = [name for name, flag in other.items() if flag]
    if bad:
        raise ValueError(f"the Hugging Face Mixtral layout has no {bad[0]} (it needs shared_experts 0, moe_every 1, "
                         "router softmax, capacity_factor none)")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": cfg.experts,
            "num_experts_per_tok": cfg.top_k, "intermediate_size": cfg.expert_ffn_hidden,
            "router_aux_loss_coef": cfg.aux_loss_coef, "router_jitter_noise": 0.0, "output_router_logits": False,
            "sliding_window": None}


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` (``MixtralForCausalLM`` with experts) for a ``arch="llama"`` ModelConfig."""
    if cfg.arch != "llama":
        raise ValueError(f"the Hugging Face Llama layout needs arch 'llama', got {cfg.arch!r}")
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": cfg.init_std, "dtype": dtype_name, "torch_dtype": dtype_name, **_mixtral(cfg),
    }


def read_hf_config(path: str | Path, seq_len: int | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face Llama directory (or its config.json); ``seq_len`` defaults
    to its ``max_position_embeddings`` and may not exceed it. Other layouts are a ValueError."""
    path = Path(path)
    file = path / CONFIG if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path}: no {CONFIG} (expected a Hugging Face model directory)")
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if hf.get("model_type") not in ("llama", "mixtral"):
        raise ValueError(f"{file}: model_type must be 'llama' (LlamaForCausalLM) or 'mixtral' (MixtralForCausalLM), "
                         f"got {hf.get('model_type')!r}")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if not isinstance(hf.get(k), int)]
    if missing:
        raise ValueError(f"{file}: {missing[0]} is missing or not an integer")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    unsupported = {"hidden_act": hf.get("hidden_act", "silu") != "silu", "attention_bias": hf.get("attention_bias"),
                   "mlp_bias": hf.get("mlp_bias"), "rope scaling": rope.get("rope_type", "default") != "default",
                   "head_dim": hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
                   != hf["hidden_size"] // hf["num_attention_heads"],
                   "sliding_window": hf.get("sliding_window") is not None}
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"{file}: unsupported Llama settings {bad} (modelpar builds SiLU MLPs without biases, "
                         "default rotary embedding, head_dim = hidden_size / num_attention_heads)")
    experts: dict[str, Any] = {"experts": int(hf["num_local_experts"]), "top_k": int(hf.get("num_experts_per_tok", 2)),
               "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.01))} if hf["model_type"] == "mixtral" else {}
    positions = int(hf.get("max_position_embeddings", 2048))
    if seq_len is not None and seq_len > positions:
        raise ValueError(f"seq_len ({seq_len}) must be <= max_position_embeddings of {file} ({positions})")
    return ModelConfig(
        arch="llama", vocab_size=int(hf["vocab_size"]), seq_len=seq_len or positions, hidden=int(hf["hidden_size"]),
        heads=int(hf["num_attention_heads"]), kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        layers=int(hf["num_hidden_layers"]), ffn=int(hf["intermediate_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        init_std=float(hf.get("initializer_range", 0.02)), **experts).check()


def check_init_from(cfg: ModelConfig, path: str | Path) -> None:
    """ValueError naming the first field where ``cfg`` differs from the directory's model (seq_len may be
    shorter), or if the directory has no weights: checked before any rank starts."""
    theirs = read_hf_config(path, seq_len=cfg.seq_len)
    _weight_files(Path(path))
    for field in ("arch", "vocab_size", "hidden", "heads", "num_kv_heads", "layers", "ffn_hidden",
                  "tie_embeddings", "norm_eps", "rope_theta", "experts", "top_k", "expert_ffn_hidden", "moe_every",
                  "shared_experts", "router", "capacity_factor"):
        if getattr(cfg, field) != getattr(theirs, field):
            raise ValueError(f"{field} = {getattr(cfg, field)!r} differs from {path}/{CONFIG} "
                             f"({getattr(theirs, field)!r}); --init-from takes the model shape from the directory")


# --- whole state dicts (one process) -------------------------------------------------------------
def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A single-process modelpar state dict in the Hugging Face layout (padded rows dropped)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "head.weight" and cfg.tie_embeddings:
            continue
        names = hf_names(name, cfg)
        rows = tensor[: cfg.vocab_size] if name in _VOCAB else tensor.flatten(0, 1) if tensor.dim() == 3 else tensor
        for hf_name, block in zip(names, rows.chunk(len(names), dim=0)):
            out[hf_name] = block.detach().contiguous().clone()
    return out


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The single-process modelpar state dict of Hugging Face tensors (padded rows zero)."""
    out = {}
    with torch.device("meta"):
        shapes = Transformer(cfg).state_dict()
    for name, param in shapes.items():
        tensor = torch.cat([_tensor(hf, n) for n in hf_names(name, cfg)], dim=0).view(-1, *param.shape[1:])
        if name in _VOCAB:
            tensor = torch.cat([tensor, tensor.new_zeros(param.shape[0] - tensor.shape[0], *tensor.shape[1:])])
        out[name] = tensor
    return out


def _tensor(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise ValueError(f"Hugging Face state dict has no {name!r}")
    return hf[name]


def save_hf(model: nn.Module | Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
            tokenizer: str | Path | None = None) -> Path:
    """Write ``out_dir`` with config.json and model.safetensors that ``LlamaForCausalLM.from_pretrained``
    loads (and a copy of ``tokenizer``, a tokenizer.json). ``model``: a single-process model or its state dict."""
    from modelpar.export import save_safetensors

    state = model.state_dict() if isinstance(model, nn.Module) else model
    tensors = to_hf_state_dict(state, cfg)
    dtype = next(iter(tensors.values())).dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n", encoding="utf-8")
    save_safetensors(tensors, out / WEIGHTS, {"format": "pt"})
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER)
    return out


def load_hf(path: str | Path, seq_len: int | None = None, dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu") -> Transformer:
    """A single-process modelpar model with a Hugging Face Llama directory's weights."""
    cfg = read_hf_config(path, seq_len)
    model = build_stage(cfg, dtype=dtype, device=device)
    load_hf_shards(model, path)
    return model


# --- one rank's shards ----------------------------------------------------------------------------
def _weight_files(path: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it (one file, or an index of several)."""
    from safetensors import safe_open

    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text(encoding="utf-8")).get("weight_map", {})
        return {name: path / file for name, file in weight_map.items()}
    if not (path / WEIGHTS).is_file():
        raise ValueError(f"{path}: no {WEIGHTS} or {INDEX} (expected a Hugging Face model directory)")
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        return dict.fromkeys(f.keys(), path / WEIGHTS)


@torch.no_grad()
def load_hf_shards(module: nn.Module, path: str | Path) -> None:
    """Fill a stage built by ``build_stage`` (any stage, any tensor-parallel rank) from a Hugging Face
    directory, reading from its safetensors files only the slices this rank holds."""
    from safetensors import safe_open

    files = _weight_files(Path(path))
    cfg: ModelConfig = module.cfg  # type: ignore[assignment]
    with contextlib.ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for name, param in module.named_parameters():
            names = hf_names(name, cfg)
            missing = [n for n in names if n not in files]
            if missing:
                raise ValueError(f"{path} has no tensor {missing[0]!r} (needed for {name})")
            if param.dim() == 3:  # stacked experts: this rank's experts' tensors, whole
                layout, each = param_layout(param), len(names) // cfg.experts
                names = names[layout.shard * param.shape[0] * each:(layout.shard + 1) * param.shape[0] * each]
            handles = []
            for n in names:
                if files[n] not in opened:
                    opened[files[n]] = stack.enter_context(safe_open(str(files[n]), framework="pt"))
                handles.append(opened[files[n]].get_slice(n))
            if param.dim() == 3:
                param.copy_(torch.cat([h[:] for h in handles]).view(param.shape))
            else:
                param.copy_(_read_shard(handles, param))


def _read_shard(pieces: list[Any], param: torch.Tensor) -> torch.Tensor:
    """This rank's part of the parameter made of the Hugging Face tensors ``pieces`` (safetensors
    slices, one per fused block); rows past them, the padded vocabulary, stay zero."""
    layout = param_layout(param)
    out = torch.zeros(param.shape, dtype=param.dtype)
    if layout.dim is None:
        return out.copy_(pieces[0][:])
    full = layout.full_shape(param.shape)[layout.dim]
    block = full // len(pieces)
    for b, ((local, start, length), piece) in enumerate(zip(layout.pieces(full), pieces)):
        lo = start - b * block
        hi = min(lo + length, piece.get_shape()[layout.dim])
        if hi > lo:
            index = (slice(lo, hi),) if layout.dim == 0 else (slice(None), slice(lo, hi))
            out.narrow(layout.dim, local, hi - lo).copy_(piece[index])
    return out
