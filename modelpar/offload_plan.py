"""Which layers of a stage offload their saved activations to host memory: pure Python, no torch.

The one offload vocabulary (the library, ``modelpar train --offload-activations``, the cost model and
``--plan auto``):

    "none"     nothing leaves the device
    "all"      every layer of every stage
    n (int)    the first n layers of each stage: those whose activations are held longest (the forward
               saves them first, the backward needs them last), so each moved byte is off the device longest
    "every-k"  every k-th layer of a stage (positions k-1, 2k-1, ...), as recomputation's every-k

Only what a layer's own forward saves is moved (its input as the first norm keeps it, its intermediates).
With recomputation a chosen layer moves what it saves in the forward: "selective" keeps the layer's
tensors but the attention core's (those move); "full" and k keep only a segment's input, which the
layers do not save, so there is nothing of theirs to move. The re-run in the backward is never moved.
"""

from __future__ import annotations

from modelpar._validate import check_int

__all__ = ["OFFLOAD_NAMES", "offload_layers", "parse_offload"]

OFFLOAD_NAMES = ("none", "all")
_EVERY = "every-"


def parse_offload(text: object) -> str:
    """A command-line or config value in canonical form: ``none``, ``all``, ``"3"`` or ``every-2``; a bad one is
    a one-line ValueError naming the allowed values."""
    value = "none" if text is None else str(text).strip().lower()
    if value in OFFLOAD_NAMES:
        return value
    if value.isdigit() and int(value) >= 1:
        return str(int(value))
    if value.startswith(_EVERY) and value[len(_EVERY):].isdigit() and int(value[len(_EVERY):]) >= 1:
        return f"{_EVERY}{int(value[len(_EVERY):])}"
    raise ValueError(f"offload_activations must be none, all, n (the first n layers of each stage, n >= 1) or "
                     f"every-k (every k-th layer, k >= 1), got {text!r}")


def offload_layers(n: int, offload: str) -> tuple[int, ...]:
    """Positions (0 .. n-1) of the layers of an ``n``-layer stage whose saved activations go to host memory.

    A count larger than ``n`` is every layer (stages of an uneven split may be shorter than others)."""
    n = check_int("layers of the stage", n, minimum=0)
    value = parse_offload(offload)
    if value == "none":
        return ()
    if value == "all":
        return tuple(range(n))
    if value.startswith(_EVERY):
        k = int(value[len(_EVERY):])
        return tuple(range(k - 1, n, k))
    return tuple(range(min(int(value), n)))
