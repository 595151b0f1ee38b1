"""Every private torch (and multiprocessing) API modelpar uses, in one place, each with why and since when.

The rest of the package imports these names from here and never reaches into a private API
itself, so a torch release that moves one breaks one function here (tested on torch 2.13 on
CPUs; written to run on 2.11 as well, where a GPU machine runs it). Where a public API exists it
is used instead: ``dist.ProcessGroupGloo.Options`` (gloo options), ``init_process_group(device_id=)``,
``torch.autograd.graph.Node.next_functions`` / ``register_prehook`` / ``GradientEdge``.
docs/gpu.md lists what remains and why.

Imports torch: the launcher imports it lazily (``modelpar.distributed.launch``).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# ``TorchDispatchMode`` (torch.utils._python_dispatch, torch >= 1.13, unchanged since): the hook on every ATen op
# that ``training.dispatch`` counts a model's dispatched ops with; torch has no public name for it.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "AfterApply",
    "CompileClock",
    "TorchDispatchMode",
    "all_gather_single",
    "backend_device",
    "backend_options",
    "dumps_for_children",
    "grad_accumulator_variable",
    "group_timeout",
    "in_backward",
    "keep_compiled_backward_buffers",
    "read_items_for_chunks",
    "reduce_scatter_single",
    "stop_multiprocessing_helpers",
    "tensor_version",
]


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_gather_single`` (the name in recent torch) or ``all_gather_into_tensor`` (the same call under
    its older name, torch ≥ 2.0): rank order along dim 0 of ``output``. Public on both; only the name moved."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.reduce_scatter_single`` or, before the rename, ``reduce_scatter_tensor`` (a sum)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def backend_options(backend: str, timeout: float) -> Any:
    """Process-group options for ``backend`` ("gloo" or "nccl") whose operations time out after ``timeout`` s.

    gloo: ``dist.ProcessGroupGloo.Options`` (public, an alias of the backends' common options; the private
    ``torch._C._distributed_c10d.Backend.Options`` where a release lacks the alias). NCCL: ``ProcessGroupNCCL.Options``
    is public but its timeout is only settable as the private ``_timeout`` (torch ≥ 2.0, unchanged
    through 2.13); a DeviceMesh's subgroups take their timeout from these options alone.
    """
    limit = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit  # private: no public setter on the options
        return options
    options_class = getattr(dist.ProcessGroupGloo, "Options", None)
    if options_class is None:
        from torch._C._distributed_c10d import Backend

        options_class = Backend.Options
    return options_class(backend, limit)


def group_timeout(group: Any) -> float:
    """The timeout (s) of ``group``'s backend for its own device: CUDA for NCCL, the CPU for gloo.

    Private: ``ProcessGroup._get_backend(device)`` and ``Options._timeout`` (torch ≥ 2.0); torch has
    no public getter. A group has a backend only for its own device type, so asking an NCCL group
    for its CPU backend raises: ``backend_device`` picks the one it has.
    """
    backend = group._get_backend(backend_device(group))
    return float(backend.options._timeout.total_seconds())


def backend_device(group: Any) -> torch.device:
    """The device type whose backend ``group`` runs its operations on: ``cuda`` for NCCL, else ``cpu``.

    A mixed "cpu:gloo,cuda:nccl" group counts as NCCL (its GPU tensors go there)."""
    return torch.device("cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")


def tensor_version(x: torch.Tensor) -> int:
    """The counter torch bumps on every in-place change of ``x`` (private ``Tensor._version``, torch ≥ 1.0):
    the only way to see that a layer modified its input in place."""
    return int(x._version)


def in_backward() -> bool:
    """True while autograd runs a backward on this thread (private ``torch._C._current_graph_task_id``,
    torch >= 1.13): a forward run there is a recomputation (the MoE layers count their tokens once)."""
    return bool(torch._C._current_graph_task_id() != -1)


def grad_accumulator_variable(node: Any) -> torch.Tensor | None:
    """The leaf tensor of an ``AccumulateGrad`` autograd node, None for any other node.

    ``Node.variable`` is not documented (torch ≥ 1.0, unchanged through 2.13); ``next_functions``,
    ``register_prehook`` and ``GradientEdge`` (torch.autograd.graph) are public.
    """
    return getattr(node, "variable", None)


class AfterApply(nn.Module):
    """An ``nn.Module`` whose ``_after_apply()`` runs after ``to()``, ``cuda()``, ``to_empty()``...

    Overrides the private ``nn.Module._apply`` (torch ≥ 1.0; its ``recurse`` argument, since 2.1,
    is passed through): those calls may replace a Parameter by a new object (CPU → CUDA), which
    loses the attributes set on the old one, and no public hook runs there.
    """

    def _after_apply(self) -> None:
        """Called after every ``_apply`` (override it)."""

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        out = super()._apply(fn, *args, **kwargs)
        self._after_apply()
        return out


def read_items_for_chunks(name: str, stored: Any, chunks: list[Any]) -> list[Any]:
    """DCP read items that fill ``chunks`` of checkpoint entry ``name`` from whatever was saved.

    ``torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list`` is not in
    torch's documented API (torch ≥ 2.1, unchanged through 2.13), but it is what DCP's own
    planners use for this.
    """
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    return create_read_items_for_chunk_list(name, stored, chunks)


def dumps_for_children(obj: Any) -> bytes:
    """``obj`` pickled as multiprocessing pickles for a child process (tensors by torch's shared-memory reductions).

    ``multiprocessing.reduction.ForkingPickler`` is undocumented in Python (3.4+) but is where
    ``torch.multiprocessing`` registers its reductions.
    """
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(obj))


def stop_multiprocessing_helpers() -> list[int]:
    """Stop this process's forkserver and resource tracker, if running, and wait for them; their pids.

    Otherwise they exit on their own a fraction of a second after this process does, outliving
    it. Python has no public call for it: ``ForkServer._stop`` and ``ResourceTracker._stop``
    (Python ≥ 3.8; what CPython's own tests use). For use at exit: multiprocessing's own exit
    work runs first (``util._exit_function``, idempotent: it releases the queues' semaphores, which
    a stopped tracker would otherwise report as leaked and unlink under their finalizers).
    """
    from multiprocessing import forkserver, resource_tracker, util

    with _signals_ignored():  # a late Ctrl-C or SIGTERM here (the run is over) must not leave them behind
        util._exit_function()  # type: ignore[attr-defined]
        return _stop_helpers(forkserver, resource_tracker)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 ignored inside (main thread only; elsewhere nothing changes): for
    the short work at exit, which a signal would cut with a traceback, leaving helper processes behind."""
    import signal
    import threading

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs} if main else {}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def _stop_helpers(forkserver: Any, resource_tracker: Any) -> list[int]:
    """Stop the forkserver and the resource tracker, if running, and wait for them; their pids."""
    stopped = []
    for helper, pid_attr in ((getattr(forkserver, "_forkserver", None), "_forkserver_pid"),
                             (getattr(resource_tracker, "_resource_tracker", None), "_pid")):
        pid = getattr(helper, pid_attr, None)
        stop = getattr(helper, "_stop", None)
        if pid is None or stop is None:
            continue
        with contextlib.suppress(OSError, ChildProcessError):
            stop()
            stopped.append(pid)
    return stopped


class CompileClock:
    """Seconds torch.compile spent compiling (dynamo, AOT autograd and the backend, the lazily compiled
    backward included) since ``start``: ``torch._dynamo.callback``'s start/end callbacks, private (2.4+),
    which torch calls around every compilation. Used by ``--compile`` to report its compile time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def _start(self, *args: Any) -> None:  # torch >= 2.7 passes CallbackArgs, earlier releases nothing
        import time

        self._began = time.perf_counter()

    def _end(self, *args: Any) -> None:
        import time

        self.seconds += time.perf_counter() - self._began

    def start(self) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def stop(self) -> None:
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._start)
        callback_handler.remove_end_callback(self._end)


def keep_compiled_backward_buffers() -> None:
    """Let a compiled graph's backward run more than once (``retain_graph=True``): a split backward (I, then W)
    restarts autograd inside it. AOT autograd donates buffers to its backward by default, which then refuses a
    second call; ``torch._functorch.config.donated_buffer`` (private, 2.6+) turns that off."""
    from torch._functorch import config

    config.donated_buffer = False
