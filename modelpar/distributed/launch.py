"""Start N real processes on this machine, joined in one torch.distributed process group.

``LocalCluster`` starts the ranks once and runs many functions in them (tests spawn one per
module; starting processes costs seconds on a small CPU). ``launch`` is the one-shot form.
A child's exception is re-raised in the parent with its rank and original message; a rank that
dies or hangs ends the whole group within ``timeout`` seconds with a clear error. Under
``torchrun`` the launcher's processes are used instead: see ``init_from_env``.

No rank outlives its launcher: each holds the read end of a pipe only the launching process
writes to, and exits the moment it reads end-of-file there, which happens when the launcher dies
for any reason, ``kill -9`` included. Ctrl-C in the launcher ends every rank at once.

While a function runs, a rank may send messages to the launcher (``to_launcher``: a training run's
progress events) through the queue that carries its result; the cluster hands each to its
``on_message`` as it arrives, in the order the rank sent them and before that rank's result.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from modelpar._validate import check_choice, check_int, check_number
from modelpar.distributed.devices import rank_device, require_gpus
from modelpar.distributed.lifeline import SCHEDULER_SIGNALS, exit_when_closed, name_process

__all__ = ["LocalCluster", "RankError", "free_port", "init_from_env", "is_torchrun", "launch", "preload", "to_launcher"]

# Imported once by the forkserver, before it forks any rank: a rank starts with them in memory instead of
# importing them itself (about 1.3 s of CPU per rank for the training stack, docs/processes.md).
# torch._dynamo: a rank imports it anyway when it builds its optimizer (AdamW's add_param_group does), 1-2 s of CPU
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "modelpar.distributed.launch", "modelpar.distributed._forkserver"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_OUTBOX: list[Any] = []  # in a rank of a LocalCluster: (its rank, the queue its results go back on)


class RankError(RuntimeError):
    """A rank failed (raised, died or hung); ``rank`` says which one (None: several hung), ``exitcode``
    how a dead one ended (negative: killed by that signal; None: it did not die), ``hung`` whether it stopped
    answering while alive (frozen, stopped, or stuck)."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None, hung: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.hung = hung  # the rank stopped answering (a peer's collective timed out waiting for it)


class _RemoteTraceback(Exception):
    """Carries a child's formatted traceback as the ``__cause__`` of the re-raised error."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_torchrun() -> bool:
    """True when this process was started by torchrun (its environment variables are set)."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def init_from_env(backend: str | None = None, timeout: float = 300.0) -> None:
    """Join the process group described by torchrun's variables (RANK, WORLD_SIZE, MASTER_*).

    The backend defaults to NCCL when CUDA is available, gloo otherwise; LOCAL_RANK picks the GPU
    (``devices.rank_device``: the current device, and the group's ``device_id``).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = rank_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
    limit = datetime.timedelta(seconds=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and attempt is not None:
        # torchrun's agent keeps one store across `--max-restarts` restarts, and a restarted group
        # would read the previous attempt's addresses from it (gloo fails to connect): each attempt gets its own keys.
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=limit)
        store = dist.PrefixStore(f"modelpar/attempt_{attempt}", agent)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=limit, device_id=device)
    else:
        dist.init_process_group(backend, timeout=limit, device_id=device)


def _rebuild_error(rank: int, payload: tuple[str, str, str, Any]) -> BaseException:
    """The child's exception, with '[rank r]' in its message and its traceback chained."""
    type_name, message, tb_text, exc_type = payload
    text = f"[rank {rank}] {message}"
    err: BaseException
    try:
        err = exc_type(text) if exc_type is not None else RankError(f"{type_name}: {text}", rank)
    except Exception:  # an exception type whose constructor wants other arguments
        err = RankError(f"{type_name}: {text}", rank)
    err.rank = rank
    err.__cause__ = _RemoteTraceback(tb_text)
    return err


def _worker(rank: int, world_size: int, port: int, backend: str, timeout: float,
            tasks: Any, results: Any, lifeline: Any) -> None:
    """A rank's main loop: join the group, then run tasks until told to stop (None)."""
    import torch
    import torch.distributed as dist

    threading.Thread(target=exit_when_closed, args=(lifeline,), name="modelpar-lifeline", daemon=True).start()
    name_process(f"modelpar-rank{rank}")  # in ps and top: which rank is which (a kill names its rank)
    try:  # from here on a Ctrl-C may land at any line: the launcher got it too and says what it means
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the forkserver ignores these (and so did
        for sig in SCHEDULER_SIGNALS:                              # this rank until now): back to Python's defaults
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, *SCHEDULER_SIGNALS))  # held while forkserver was born
        if "OMP_NUM_THREADS" not in os.environ:  # N ranks share the cores: no oversubscription
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        device = rank_device(backend, rank)  # one machine: the local rank is the rank
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout), device_id=device)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # leaving: see _reporting_an_error
        return
    except Exception as exc:  # report the failure to join like any other error
        results.put((rank, "error", _describe(exc)))
        return
    _OUTBOX.append((rank, results))
    try:
        while (task := _next_task(tasks)) is not None:
            try:  # unpickling imports the task's modules: a Ctrl-C may land there too, reported like one in fn
                fn, args, kwargs = pickle.loads(task)
                results.put((rank, "ok", fn(*args, **kwargs)))
            except BaseException as exc:
                with _reporting_an_error():
                    results.put((rank, "error", _describe(exc)))
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # leaving: see _reporting_an_error
        dist.destroy_process_group()


@contextlib.contextmanager
def _reporting_an_error() -> Iterator[None]:
    """Ctrl-C ignored inside: a Ctrl-C to the process group reaches a rank twice (directly, and relayed by
    the launcher), and the second, landing while the first is reported, printed a traceback."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def to_launcher() -> Callable[[Any], None] | None:
    """In a rank of a ``LocalCluster``: a function sending a (picklable) message to the launcher's
    ``on_message``; None in any other process."""
    if not _OUTBOX:
        return None
    rank, results = _OUTBOX[0]
    return lambda message: results.put((rank, "message", message))


def _next_task(tasks: Any) -> Any:
    """The next task; None when told to stop, or when a Ctrl-C finds this rank idle between tasks
    (the launcher decides what the interrupt means; a rank has nothing of its own to stop)."""
    try:
        return tasks.get()
    except KeyboardInterrupt:
        return None


_DEATH_GRACE = 1.0  # s a failed run waits to see whether a rank died (the cause of its peers' errors)


_TIMED_OUT = re.compile(r"time(d)?[ _-]?out", re.IGNORECASE)  # gloo's and NCCL's words for a collective that waited


def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, T stopped, Z, ...); "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _ended(proc: Any) -> bool:
    """True once ``proc`` has exited: in /proc a zombie not yet reaped, or gone; without /proc, as it reports."""
    state = _state(proc.pid)
    if state:
        return state in ("Z", "X")
    return os.path.isdir("/proc/self") or not proc.is_alive()


def _death(rank: int, proc: Any, killed_by_us: set[int]) -> RankError:
    """The one line for a rank that died: its pid, and the signal that killed it or its exit code."""
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        text = f"rank {rank} (pid {proc.pid}) was killed by signal {-code}{name}"
        if -code == signal.SIGKILL and proc.pid not in killed_by_us:
            text += " (not sent by modelpar: out of memory? The kernel's OOM killer sends SIGKILL; `dmesg` names its victims)"
        return RankError(text, rank, code)
    return RankError(f"rank {rank} died (exit code {code}) before finishing (pid {proc.pid})", rank, code)


def _describe(exc: BaseException) -> tuple[str, str, str, Any]:
    exc_type: Any = type(exc)
    try:  # only send the type if the parent can unpickle it
        pickle.loads(pickle.dumps(exc_type))
    except Exception:
        exc_type = None
    return type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)), exc_type


_REAPING: list[bool] = []


def _reap_helpers_at_exit() -> None:
    """Once per process: at exit, stop the forkserver and resource tracker and wait for them, so that
    nothing of a run outlives its launcher (they would exit on their own a moment later)."""
    if not _REAPING:
        from modelpar._compat import stop_multiprocessing_helpers

        _REAPING.append(True)
        atexit.register(stop_multiprocessing_helpers)


@contextlib.contextmanager
def _blocked(*signals: int) -> Any:
    """Hold ``signals`` in this thread inside the block (a process it starts inherits the mask).

    Python does the same when it starts its resource tracker: a Ctrl-C while the forkserver is
    still importing torch would otherwise print its KeyboardInterrupt traceback.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def preload(*modules: str) -> None:
    """Have the forkserver import ``modules`` too, so ranks are born with them (a module that runs on ranks
    registers itself when imported). Takes effect if no cluster of this process has started yet."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context() -> mp.context.BaseContext:
    """forkserver with torch (and what ``preload`` named) imported: children start in a fraction of a spawn's time."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        return ctx
    return mp.get_context("spawn")


class LocalCluster:
    """``world_size`` local processes in one process group, reused for many ``run`` calls.

    >>> with LocalCluster(2) as cluster:          # doctest: +SKIP
    ...     cluster.run(all_reduce_ones)           # -> [result of rank 0, result of rank 1]

    Functions must be importable (module level) since they are pickled to the children.
    After a failed run the ranks may be stuck in a collective, so the cluster ends them and starts
    again on the next ``run``.

    ``timeout`` bounds each collective inside the ranks (torch.distributed's process-group
    timeout). ``run_timeout`` bounds each whole ``run``: a backstop for a hang no collective
    notices (a rank in an endless loop); ``None``: no limit, for long jobs (training), where a rank
    that dies is still noticed at once and a hung collective fails after ``timeout``.
    ``on_message`` receives, in ``run``'s thread, what the ranks send with ``to_launcher``.
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout: float = 60.0,
                 run_timeout: float | None = 600.0, on_message: Callable[[Any], None] | None = None) -> None:
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.backend = check_choice("backend", backend, ["gloo", "nccl"])
        self.timeout = check_number("timeout", timeout, minimum=0.0, strict=True)
        self.run_timeout = None if run_timeout is None else check_number(
            "run_timeout", run_timeout, minimum=0.0, strict=True)
        if self.backend == "nccl":  # one GPU per rank, cuda:r for rank r (devices.rank_device)
            require_gpus(self.world_size, f"LocalCluster(backend='nccl') with {self.world_size} ranks")
        self.on_message = on_message
        self._procs: list[Any] = []
        self._lifeline: Any = None  # the write end of the pipe whose closing ends every rank
        self._lock = threading.Lock()
        self._starting: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._killed: set[int] = set()  # pids this launcher sent SIGKILL to (kill())

    def start(self) -> LocalCluster:
        """Begin starting the ranks in the background and return at once; ``run`` waits for them.

        Lets a caller overlap the few seconds of process start-up with its own work.
        """
        if not self._procs and self._starting is None:
            self._starting = threading.Thread(target=self._start_in_background, daemon=True)
            self._starting.start()
        return self

    def _start_in_background(self) -> None:
        try:
            self._start()
        except BaseException as err:
            self._start_error = err

    def _wait_started(self) -> None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if self._start_error is not None:
            err, self._start_error = self._start_error, None
            raise err

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the block failed (or Ctrl-C): the ranks may be anywhere, end them now
            with contextlib.suppress(BaseException):
                self._wait_started()
            self.kill()

    def _start(self) -> None:
        _reap_helpers_at_exit()
        ctx = _context()
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        lifeline, self._lifeline = ctx.Pipe(duplex=False)
        self._procs = [
            ctx.Process(target=_worker, daemon=True, name=f"modelpar-rank{r}",  # type: ignore[attr-defined]
                        args=(r, self.world_size, port, self.backend, self.timeout,
                              self._tasks[r], self._results, lifeline))
            for r in range(self.world_size)
        ]
        try:
            with _blocked(signal.SIGINT):  # the forkserver, started here, is born with Ctrl-C held (see _forkserver)
                for p in self._procs:
                    p.start()
        except BaseException:
            self.kill()  # e.g. a script without an `if __name__ == "__main__":` guard
            raise
        finally:
            lifeline.close()  # the ranks hold the read end; the launcher keeps only the write end

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids in rank order (empty until they start)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every rank still running (what the ranks make of it is up to ``fn``)."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        from modelpar._compat import dumps_for_children

        try:  # pickle once, here: a failure is raised now, not lost in the queue's feeder thread
            task = dumps_for_children((fn, args, kwargs))
        except Exception as err:
            raise ValueError(
                f"fn and its arguments must be picklable (a module-level function, importable by the "
                f"child processes), got {getattr(fn, '__qualname__', fn)!r}: {err}"
            ) from None
        self._wait_started()
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put(task)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.run_timeout if self.run_timeout is not None else float("inf")
        try:
            while len(results) < self.world_size:
                try:
                    rank, status, value = self._results.get(timeout=0.1)
                except queue.Empty:
                    self._check_alive(results, deadline)
                    continue
                if status == "message":
                    if self.on_message is not None:
                        self.on_message(value)
                    continue
                if status == "error":  # a rank that died is the cause, and its peers' errors follow from it
                    self._raise_if_died(_DEATH_GRACE)
                    self._raise_if_silent(rank, value, results)
                    raise _rebuild_error(rank, value)
                results[rank] = value
        except BaseException:  # a rank failed, or Ctrl-C here: no rank outlives the run
            self.kill()
            raise
        return [results[r] for r in range(self.world_size)]

    def _check_alive(self, done: dict[int, Any], deadline: float) -> None:
        if not self._procs:
            raise RankError("the ranks were ended while running (LocalCluster.kill)")
        dead = [(rank, p) for rank, p in enumerate(self._procs) if rank not in done and not p.is_alive()]
        if dead:
            raise _death(*dead[0], self._killed)
        if time.monotonic() > deadline:
            waiting = [r for r in range(self.world_size) if r not in done]
            raise RankError(
                f"ranks {waiting} did not finish within run_timeout={self.run_timeout:g} s "
                "(a hang: a collective or a receive that nobody answers?)"
            )

    def _raise_if_died(self, grace: float) -> None:
        """Raise the death of a rank (lowest rank first) if one is seen within ``grace`` seconds.

        A dead rank is seen at once in /proc (a zombie, or gone); how it died comes from the
        forkserver, which reports it when it has reaped the rank, a moment later.
        """
        end = time.monotonic() + grace
        while True:
            dead = [(rank, p) for rank, p in enumerate(self._procs) if p.pid is not None and _ended(p)]
            if dead:
                rank, p = dead[0]
                p.join(_DEATH_GRACE * 5)  # the exit status, once the forkserver has it
                if p.exitcode is not None and p.exitcode != 0:
                    raise _death(rank, p, self._killed)
            if time.monotonic() > end:
                return
            time.sleep(0.02)

    def _raise_if_silent(self, rank: int, error: tuple[str, str, str, Any], done: dict[int, Any]) -> None:
        """After ``rank``'s collective or receive timed out (``error``: a TimeoutError, or gloo's or NCCL's words),
        raise a hung ``RankError`` naming the rank it waited for: one that has neither answered nor failed, a
        stopped one (SIGSTOP, state T) first."""
        if error[0] != "TimeoutError" and not _TIMED_OUT.search(error[1]):
            return
        silent = [r for r, p in enumerate(self._procs) if r != rank and r not in done and p.pid is not None]
        if not silent:
            return
        stopped = [r for r in silent if _state(self._procs[r].pid) in ("T", "t")]
        r = (stopped or silent)[0]
        how = " (it is stopped: SIGSTOP or a debugger)" if stopped else ""
        raise RankError(f"rank {r} (pid {self._procs[r].pid}) stopped answering{how}: rank {rank} waited the "
                        f"collective timeout of {self.timeout:g} s (--timeout) for it; every rank was ended", r,
                        hung=True)

    def kill(self) -> None:
        """End every rank at once (SIGKILL) and wait for them; the next ``run`` starts new ones.

        SIGKILL rather than SIGTERM: a rank may give SIGTERM a meaning of its own (a training
        run saves a checkpoint on it).
        """
        with self._lock:
            procs, self._procs = [p for p in self._procs if p.pid is not None], []
            for p in procs:
                if p.is_alive():
                    self._killed.add(p.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
            if self._lifeline is not None:  # also ends a rank whose status the forkserver could not tell
                self._lifeline.close()
                self._lifeline = None
            for p in procs:
                p.join()

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and wait for them."""
        with contextlib.suppress(BaseException):  # a failed start leaves nothing to stop
            self._wait_started()
        if not self._procs:
            return
        try:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                if p.pid is not None:
                    p.join(timeout=10)
        finally:  # also when a signal cuts the wait short: no rank outlives the cluster
            self.kill()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
           timeout: float = 60.0, run_timeout: float | None = 600.0, **kwargs: Any) -> list[Any]:
    """Run ``fn`` once on ``world_size`` fresh local processes; return each rank's result."""
    with LocalCluster(world_size, backend=backend, timeout=timeout, run_timeout=run_timeout) as cluster:
        return cluster.run(fn, *args, **kwargs)
