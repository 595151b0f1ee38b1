"""``modelpar generate``: sample a continuation from a trained model on one process (CPU or GPU).

The model comes from a checkpoint directory, an export (``modelpar export``: model.safetensors,
or the folder holding it) or a Hugging Face Llama directory (config.json + safetensors); text goes
in and out through the tokenizer.json beside it, or bytes when there is none.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="sample a continuation of a prompt from a trained model (KV cache)",
                              description=__doc__.splitlines()[0])
    p.add_argument("model", metavar="CHECKPOINT_DIR_OR_EXPORT",
                   help="a --checkpoint-dir (its newest checkpoint) or one step_N in it, an export "
                        "(model.safetensors or its folder), or a Hugging Face Llama directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100, help="tokens to sample, printed as they come; past "
                                                                   "the model's seq_len the window slides (default "
                                                                   "%(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0: greedy (default 1)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws: the same seed, the same text")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.set_defaults(func=run)


def _load(path: Path, device: Any) -> tuple[Any, Path]:
    """The model at ``path`` and the folder where its tokenizer.json would be (an export's: the one it recorded)."""
    import sys
    import tempfile

    from modelpar import hf
    from modelpar.export import check_tokenizer, checkpoint_path, export_checkpoint, load_model

    if path.is_file() or ((path / "model.safetensors").is_file() and not (path / hf.CONFIG).is_file()):
        file = path if path.is_file() else path / "model.safetensors"
        check_tokenizer(file)
        return load_model(file, device=device), file.parent
    if (path / hf.CONFIG).is_file():
        return hf.load_hf(path, device=device).eval(), path
    checkpoint = checkpoint_path(path)  # a ValueError if it is not one either
    with tempfile.TemporaryDirectory(prefix="modelpar-generate-") as tmp:
        export_checkpoint(path, Path(tmp) / "model.safetensors",  # the directory: read again if pruned meanwhile
                          note=lambda text: print(f"modelpar generate: {text}", file=sys.stderr, flush=True))
        return load_model(Path(tmp) / "model.safetensors", device=device), checkpoint.parent


def _device(text: str) -> Any:
    """``--device``'s torch.device; ValueError for a name torch does not know or a GPU this machine lacks."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {text!r}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(f"--device {text}: this machine has no CUDA device (torch.cuda.is_available() is "
                             "False); use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {text}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
                             f"(cuda:0 ... cuda:{count - 1})")
    return device


def run(args: argparse.Namespace) -> int:
    import torch

    from modelpar._validate import check_int, check_number
    from modelpar.generate import NonFiniteLogits, stream
    from modelpar.text import load_tokenizer

    check_int("--max-new-tokens", args.max_new_tokens, minimum=0)
    check_number("--temperature", args.temperature)
    if args.top_k is not None:
        check_int("--top-k", args.top_k, minimum=1)
    check_int("--seed", args.seed, minimum=0)
    if not args.prompt:
        raise ValueError("--prompt must not be empty")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else _device(args.device)
    path = Path(args.model)
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist")
    model, folder = _load(path, device)
    tokenizer = load_tokenizer(folder)  # the tokenizer.json beside the model, or bytes
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens")
    tokens = stream(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    seed=args.seed)
    try:
        _print_stream(args.prompt, tokens, tokenizer)
    except NonFiniteLogits:  # raised at the first token, before any text is printed
        raise ValueError(f"{str(path)!r} holds non-finite weights (NaN or inf): its logits are not finite") from None
    return 0


def _print_stream(prompt: str, tokens: Iterator[int], tokenizer: Any) -> None:
    """Print the prompt, then the text of each token as it is sampled (flushed), up to the end of a document
    (the tokenizer's end id); Ctrl-C ends the line and says how many tokens came (exit 130)."""
    pending: list[int] = []  # tokens whose text is not whole yet (a character cut across byte tokens)
    last: list[int] = []  # the token printed last: context for decoders that treat a text's start apart
    count = 0
    try:
        for token in tokens:
            if token == tokenizer.eos_id:  # the end of a document: stop there
                break
            if count == 0:
                print(prompt, end="", flush=True)
            count += 1
            pending.append(token)
            text = _text(tokenizer, last, pending)
            if not text.endswith("\ufffd") or len(pending) >= _HOLD:  # U+FFFD: wait for the character's other bytes
                print(text, end="", flush=True)
                last, pending = pending[-1:], []
    except KeyboardInterrupt:
        print(_text(tokenizer, last, pending), flush=True)
        raise KeyboardInterrupt(f"generation stopped after {count} new tokens (Ctrl-C)") from None
    print(("" if count else prompt) + _text(tokenizer, last, pending), flush=True)


_HOLD = 16  # tokens held at most while their text ends in a cut character (one is at most 4 bytes)


def _text(tokenizer: Any, last: list[int], pending: list[int]) -> str:
    """The text ``pending`` adds after ``last``: what it adds to their joint decoding where that extends
    ``last``'s own (a decoder may treat a text's first token apart), else its own decoding."""
    if not pending:
        return ""
    before, joint = tokenizer.decode(last), tokenizer.decode(last + pending)
    return joint[len(before):] if last and joint.startswith(before) else tokenizer.decode(pending)
