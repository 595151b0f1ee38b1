"""A trained model out of a checkpoint, for use on one process without torch.distributed.

    model.safetensors   the single-process model's state dict: names as ``build_stage(cfg)`` gives
                        them on one process (a tied output weight once, as the embedding), metadata
                        {"format": "modelpar", "config": <ModelConfig as JSON>}
    model.json          the same config, beside it
    tokenizer.json      copied from the checkpoint directory when the run saved one there

``export_checkpoint`` reads the full tensors from the DCP files in this process (whatever split
wrote them); ``load_model`` builds the model from the file alone.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelpar.checkpoint import CheckpointManager, read_full_tensors, read_meta, read_newest
from modelpar.checkpoint.store import MARKER
from modelpar.model import ModelConfig, build_stage

__all__ = ["EXPORT_FORMAT", "checkpoint_path", "export_checkpoint", "load_model", "save_safetensors"]

EXPORT_FORMAT = "modelpar"  # the safetensors metadata "format"
CONFIG = "model.json"
TOKENIZER = "tokenizer.json"


def checkpoint_path(path: str | os.PathLike) -> Path:
    """``path`` if it is a complete checkpoint (``step_N``), else the newest valid one inside it; ValueError if none."""
    path = Path(path)
    return path if (path / MARKER).is_file() else CheckpointManager(path).newest_or_error()


def save_safetensors(tensors: dict[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``out`` atomically (a temporary file renamed), readable as any new file.

    safetensors creates its files private (mode 0600); an exported model is meant to be shared,
    so it gets the permissions the user's umask gives new files.
    """
    from safetensors.torch import save_file

    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike) -> list[Path]:
    """Write the whole model of ``checkpoint`` (a checkpoint directory or one ``step_N`` in it) to ``out``.

    Returns the files written: ``out``, ``model.json`` beside it, and ``tokenizer.json`` if the
    checkpoint directory holds one. Nothing is written if the checkpoint cannot be read.
    """
    out = Path(out)
    path, config, tensors = read_newest(checkpoint, _read_model)
    save_safetensors(tensors, out, {"format": EXPORT_FORMAT, "config": json.dumps(config, sort_keys=True)})
    written = [out, out.with_name(CONFIG)]
    written[1].write_text(json.dumps(config, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tokenizer = path.parent / TOKENIZER
    if tokenizer.is_file():
        written.append(out.with_name(TOKENIZER))
        shutil.copyfile(tokenizer, written[-1])
    return written


def _read_model(path: Path) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """The model config and full ``model.*`` tensors of checkpoint ``path``."""
    config = read_meta(path)["config"]["model"]
    ModelConfig(**config).check()
    return path, config, {name: t.contiguous() for name, t in read_full_tensors(path, "model.").items()}


def _config(path: Path) -> ModelConfig:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta: dict[str, Any] = f.metadata() or {}
    except Exception as err:  # not a safetensors file, or a damaged one
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {err}") from None
    if meta.get("format") != EXPORT_FORMAT or "config" not in meta:
        raise ValueError(f"{str(path)!r} is not a modelpar export (its metadata has format "
                         f"{meta.get('format')!r}, expected {EXPORT_FORMAT!r} and a config)")
    try:
        config = json.loads(meta["config"])
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
        return ModelConfig.from_dict(config).check()
    except ValueError as err:  # json's errors are ValueErrors too
        raise ValueError(f"{str(path)!r}: its safetensors metadata field 'config' is not a model config "
                         f"as JSON ({err})") from None


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> nn.Module:
    """The single-process model of an export (eval mode), on ``device``, in ``dtype`` (default: as saved)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = _config(path)
    tensors = load_file(str(path), device=str(device))
    dtype = dtype or next(iter(tensors.values())).dtype
    model = build_stage(cfg, dtype=dtype, device=device)
    names: dict[int, list[str]] = {}  # a tied weight has two names and one Parameter
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    missing = [n[0] for n in names.values() if not any(name in tensors for name in n)]
    own = {name for n in names.values() for name in n} | set(model.state_dict())
    extra = sorted(set(tensors) - own)
    if missing or extra:
        raise ValueError(f"{str(path)!r} does not hold the model of its config {asdict(cfg)}: "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            if name in tensors:
                if tuple(tensors[name].shape) != tuple(value.shape):
                    raise ValueError(f"{str(path)!r}: {name!r} has shape {tuple(tensors[name].shape)}, "
                                     f"the model of its config {tuple(value.shape)}")
                value.copy_(tensors[name])
    return model.eval()
