"""A trained model out of a checkpoint, for use on one process without torch.distributed.

    model.safetensors   the single-process model's state dict: names as ``build_stage(cfg)`` gives
                        them on one process (a tied output weight once, as the embedding), metadata
                        {"format": "modelpar", "config": <ModelConfig as JSON>}
    model.json          the same config, beside it
    tokenizer.json      copied from the checkpoint directory when the run saved one there

The companions beside the file are the export's: its metadata also records the tokenizer's
SHA-256 ("" for bytes), an export replacing an earlier one at the same path replaces or removes
that one's companions, and a companion that belongs to neither (another export's in the same
folder, a user's file) is never overwritten: the export is refused, naming it
(``check_companions``), and ``modelpar generate`` refuses a tokenizer.json the export did not record.

``export_checkpoint`` reads the full tensors from the DCP files in this process (whatever split
wrote them); ``load_model`` builds the model from the file alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelpar.checkpoint import read_full_tensors, read_meta, read_newest
from modelpar.checkpoint.manager import checkpoint_at
from modelpar.model import ModelConfig, build_stage

__all__ = ["EXPORT_FORMAT", "check_companions", "check_tokenizer", "checkpoint_path", "export_checkpoint",
           "load_model", "save_safetensors"]

EXPORT_FORMAT = "modelpar"  # the safetensors metadata "format"
CONFIG = "model.json"
TOKENIZER = "tokenizer.json"


def checkpoint_path(path: str | os.PathLike) -> Path:
    """``path`` if it is a valid checkpoint (``step_N``), else the newest valid one inside it; ValueError if
    a named one is damaged or there is none (``checkpoint.manager.checkpoint_at``)."""
    return checkpoint_at(path)


def save_safetensors(tensors: dict[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``out`` atomically (a temporary file renamed), readable as any new file.

    safetensors creates its files private (mode 0600); an exported model is meant to be shared,
    so it gets the permissions the user's umask gives new files.
    """
    from safetensors.torch import save_file

    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except Exception as err:  # safetensors' own error type wraps the OS error (a full disk): it names ``out``
            code = getattr(err, "errno", None) or int((re.findall(r"os error (\d+)", str(err)) or [0])[0])
            if not code:
                raise
            raise OSError(code, os.strerror(code), str(out)) from None
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)
        tmp.replace(out)
    finally:
        if os.path.lexists(tmp):  # (unlinking a missing file on a read-only file system fails otherwise)
            tmp.unlink()


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike,
                      note: Callable[[str], None] | None = None) -> list[Path]:
    """Write the whole model of ``checkpoint`` (a checkpoint directory or one ``step_N`` in it) to ``out``.

    Returns the files written: ``out``, ``model.json`` beside it, and ``tokenizer.json`` if the
    checkpoint directory holds one (a stale one of the export replaced is removed). Nothing is
    written if the checkpoint cannot be read or a file beside ``out`` is not the export's
    (``check_companions``). ``note``: told which checkpoint was taken when newer ones were damaged.
    """
    out = Path(out)
    path, config, tensors = read_newest(checkpoint, _read_model, note)
    source = path.parent / TOKENIZER
    tokenizer = source.read_bytes() if source.is_file() else None
    companions = {CONFIG: (json.dumps(config, indent=1, sort_keys=True) + "\n").encode(), TOKENIZER: tokenizer}
    check_companions(out, companions)
    save_safetensors(tensors, out, {"format": EXPORT_FORMAT, "config": json.dumps(config, sort_keys=True),
                                    TOKENIZER_SHA: _sha(tokenizer)})
    written = [out]
    for name, data in companions.items():
        if data is None:
            out.with_name(name).unlink(missing_ok=True)  # the replaced export's (check_companions)
        else:
            written.append(out.with_name(name))
            written[-1].write_bytes(data)
    return written


TOKENIZER_SHA = "tokenizer_sha256"  # the safetensors metadata field: the tokenizer.json beside it ("" for bytes)


def _sha(data: bytes | None) -> str:
    return hashlib.sha256(data).hexdigest() if data is not None else ""


def check_companions(out: Path, companions: dict[str, bytes | None]) -> None:
    """ValueError if a file beside ``out`` that the export would write or remove (``companions``: name ->
    its new bytes, None: none) holds something else and is not the companion of the export at ``out``
    it replaces: another export's in the same folder, or a user's file, is never overwritten."""
    try:
        replaced = _metadata(out) if out.is_file() else {}
    except ValueError:  # not an export: it owns no companions
        replaced = {}
    for name, data in companions.items():
        file = out.with_name(name)
        if not file.is_file() or file.read_bytes() == data:
            continue
        held = file.read_bytes()
        if replaced.get("format") == EXPORT_FORMAT and _belongs(name, held, replaced):
            continue
        raise ValueError(f"--out: {str(file)!r} is not the {name} of this export nor of the earlier export to "
                         f"{str(out)!r} (another export's in the same folder, or a file of yours), and modelpar "
                         f"reads it with the model beside it: export to a folder of its own, or move it away")


def _belongs(name: str, held: bytes, metadata: dict[str, str]) -> bool:
    """Whether companion ``name`` holding ``held`` is the one written with the export of ``metadata``."""
    if name == TOKENIZER:
        return metadata.get(TOKENIZER_SHA) == _sha(held)
    try:
        return json.loads(held) == json.loads(metadata.get("config", ""))
    except ValueError:
        return False


def check_tokenizer(path: Path) -> None:
    """ValueError if the tokenizer.json beside export ``path`` (or its absence) is not the one it was exported
    with (exports that predate the record are not checked)."""
    recorded = _metadata(path).get(TOKENIZER_SHA)
    file = path.with_name(TOKENIZER)
    found = _sha(file.read_bytes()) if file.is_file() else ""
    if recorded is None or recorded == found:
        return
    if not recorded:
        raise ValueError(f"{str(file)!r} is not the tokenizer of {str(path)!r}, which was exported with byte "
                         "tokens (no tokenizer.json): it is another export's; move it away, or export again")
    raise ValueError(f"{str(path)!r} was exported with a tokenizer.json " + (
        "that is not beside it" if not found else f"other than {str(file)!r} (another export's)") + ": export again")


def _read_model(path: Path) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """The model config and full ``model.*`` tensors of checkpoint ``path``."""
    config = read_meta(path)["config"]["model"]
    ModelConfig(**config).check()
    return path, config, {name: t.contiguous() for name, t in read_full_tensors(path, "model.").items()}


def _metadata(path: Path) -> dict[str, str]:
    """The safetensors metadata of file ``path``; ValueError if it is not a readable safetensors file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as err:  # not a safetensors file, or a damaged one
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {err}") from None


def _config(path: Path) -> ModelConfig:
    meta = _metadata(path)
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
