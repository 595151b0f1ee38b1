"""``--compile``: ``torch.compile`` each transformer block (torchtitan's granularity), or each stage whole.

One block is one graph: every block of a model has the same code and shapes, so torch compiles it
once and the blocks share it (guards are on the modules' types and tensor metadata, not their
identity). What happens between blocks (the embedding, the head and loss, the pipeline's sends,
the gradient buckets' hooks, ZeRO-3's gathers around each block) stays eager. The block's
``forward`` is compiled, not its ``__call__``, so hooks on the block itself run outside the graph;
ZeRO-3 gathers per block under ``--compile`` for that reason (``gather_units``). Tensor- and
sequence-parallel collectives and the experts' all-to-all inside a block are autograd Functions that
call ``torch.distributed``: torch runs them between graphs (a graph break), so they stay exactly as in
eager mode. Context parallelism's attention and the experts' routing run eagerly whole
(``_eager_under_compile``): dynamo would otherwise compile their pieces apart, again for every ring step.

A zero-bubble schedule's split backward (I now, W later) restarts autograd from inside a stage;
a compiled block is one autograd node, so its W re-runs the block's backward (correct, the
weight-gradient half's saving lost inside compiled blocks; docs/performance.md).

``--compile-scope stage`` compiles a stage's whole forward instead (the embedding, every block and the final
norm; the chunked head and loss stay eager), as a hand-written model compiles whole: one graph call per
microbatch instead of one per block, and fusion across blocks (a block's residual add with the next one's
norm). It needs a stage whose forward is one autograd node no schedule splits and no hook enters: no ZeRO-3
(gathers around modules inside the graph), no split backward (W would re-run the whole stage's backward),
no recomputation or offload (their own autograd functions and saved-tensor hooks around each layer). The stage
runs eagerly until its layers stop reading the host (the first call's token-id check, the first step's
cross-rank shape checks), then compiles once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from modelpar._compat import CompileClock, keep_compiled_backward_buffers

__all__ = ["COMPILE_BACKENDS", "COMPILE_SCOPES", "check_compile_backend", "check_compile_scope", "compile_block",
           "compile_blocks", "compile_stages", "compiled_blocks", "gather_units"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # inductor generates kernels; the others check the tracing
COMPILE_SCOPES = ("block", "stage")  # what one graph covers: a transformer block, or a stage's whole forward


def check_compile_backend(backend: str) -> str:
    """``backend`` if torch.compile knows it; a one-line ValueError naming the choices otherwise."""
    from torch._dynamo import list_backends

    known = sorted(set(list_backends(exclude_tags=())) | set(COMPILE_BACKENDS))
    if backend not in known:
        raise ValueError(f"compile_backend must be one of {', '.join(known)}, got {backend!r}")
    return backend


def check_compile_scope(scope: str, *, zero: int, split_backward: bool, recompute: str, offload: str) -> None:
    """A one-line ValueError if ``scope`` is unknown, or is "stage" with what a whole-stage graph cannot hold."""
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope must be one of {', '.join(COMPILE_SCOPES)}, got {scope!r}")
    if scope == "block":
        return
    clash = ("zero 3 (its gathers wrap modules inside the stage)" if zero >= 3 else
             "a split-backward schedule (W would re-run the whole stage's backward)" if split_backward else
             f"recompute {recompute} (its checkpoints wrap layers inside the stage)" if recompute != "none" else
             f"offload_activations {offload} (its hooks wrap layers inside the stage)" if offload != "none" else "")
    if clash:
        raise ValueError(f"compile_scope stage compiles a stage's forward whole and cannot run with {clash}; "
                         "use compile_scope block")


def compiled_blocks(module: nn.Module) -> Iterator[nn.Module]:
    """The transformer blocks of a stage (``Transformer.layers``), the units ``compile_blocks`` compiles."""
    layers = getattr(module, "layers", None)
    yield from layers.values() if isinstance(layers, nn.ModuleDict) else ()


def _eager_under_compile() -> None:
    """What must run eagerly inside a compiled forward: the experts' routing (data-dependent sizes, host reads) and
    context parallelism's attention (the ring's sends break the graph, and dynamo compiled the pieces apart, the
    attention again for each ring step's chunk ids, Python ints: 9 entries a rank at cp = 2). Marked here, the
    first time anything is compiled, not where they are defined: ``torch.compiler.disable`` imports dynamo,
    seconds of CPU in every process that imports the model."""
    from modelpar.model.moe import MoE
    from modelpar.tensor_parallel.context_parallel import ContextParallel

    for owner, name in ((MoE, "forward"), (ContextParallel, "attend")):
        method = getattr(owner, name)
        if not getattr(method, "_modelpar_eager", False):
            eager = torch.compiler.disable(method)
            eager._modelpar_eager = True
            setattr(owner, name, eager)


def compile_blocks(modules: Mapping[int, nn.Module], backend: str = "inductor",
                   split_backward: bool = False) -> CompileClock:
    """Compile the forward of every block of ``modules`` in place (names, parameters and hooks unchanged);
    return the clock that counts the seconds spent compiling from now on. ``split_backward``: the schedule
    runs I and W apart, so a block's compiled backward may run twice."""
    _eager_under_compile()
    if split_backward:
        keep_compiled_backward_buffers()
    clock = CompileClock()
    clock.start()
    for module in modules.values():
        for block in compiled_blocks(module):
            compile_block(block, backend)
    return clock


def compile_block(block: nn.Module, backend: str = "inductor", dynamic: bool | None = None) -> nn.Module:
    """``block`` with its forward compiled in place (its ``__call__`` and hooks stay eager), as ``--compile`` compiles
    each transformer block; ``dynamic`` as ``torch.compile``'s (calibrate measures one static shape per graph)."""
    _eager_under_compile()
    block.forward = torch.compile(block.forward, backend=backend, dynamic=dynamic)
    return block


def compile_stages(modules: Mapping[int, nn.Module], backend: str = "inductor") -> CompileClock:
    """Compile the forward of every stage of ``modules`` whole, in place (names, parameters and hooks unchanged);
    return the clock that counts the seconds spent compiling from now on."""
    _eager_under_compile()
    clock = CompileClock()
    clock.start()
    for module in modules.values():
        module.forward = _compiled_once_checked(module, backend)
    return clock


def _compiled_once_checked(module: nn.Module, backend: str) -> Callable[..., Any]:
    """``module.forward`` eager while a layer of it still reads the host (``TensorParallelModule.reads_host``: the
    token ids' check on the first call, the cross-rank shape checks over t > 1 during the first step): traced,
    each read would split the stage's graph, and that graph, compiled once, would be compiled again without them.
    Compiled from the first call with every check off."""
    from modelpar.tensor_parallel.sharding import TensorParallelModule

    forward = module.forward
    compiled = torch.compile(forward, backend=backend)
    layers = [m for m in module.modules() if isinstance(m, TensorParallelModule)]
    checked = False

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal checked
        checked = checked or not any(m.reads_host for m in layers)
        return (compiled if checked else forward)(*args, **kwargs)

    return call


def gather_units(module: nn.Module, compiled: bool) -> list[nn.Module]:
    """The modules ZeRO-3 gathers parameters around, in forward order: every module with parameters of its
    own, or, with compiled blocks, each block whole (its hooks must stay outside its graph) and the modules
    with parameters of their own outside the blocks."""
    blocks = list(compiled_blocks(module)) if compiled else []
    inside = {id(m) for b in blocks for m in b.modules()}
    units: list[nn.Module] = []
    for m in module.modules():
        if any(m is b for b in blocks) or (id(m) not in inside and next(m.parameters(recurse=False), None) is not None):
            units.append(m)
    return units
