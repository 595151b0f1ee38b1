"""The rules of a checkpoint directory, in one place: who writes, what counts, what is pruned, what resumes.

    ours       a ``step_<n>`` holding the marker, ``meta.json`` or DCP's ``.metadata`` (``store.is_checkpoint``);
               any other ``step_<n>`` folder is foreign: a run that would write the directory is
               refused naming it (it is never read, replaced or removed)
    valid      one of ours with its marker whose files all have the size and CRC-32 it recorded
               and whose metadata parse (``store.checkpoint_problem``); anything else is damaged:
               never resumed from, never counted, never pruned (a warning names it)
    newest     the valid one with the highest step: what ``--resume``, ``export`` and ``generate`` take;
               ``--resume`` where checkpoints exist but none is valid is refused, naming them
    keep-N     after a new checkpoint is complete (sealed and renamed), the valid ones beyond the
               newest N are removed; the new one and the newest valid one always stay
    fresh run  a run without --resume into a directory holding checkpoints is refused, unless
               --overwrite, which removes ours (valid or damaged; under the lock) before the run starts
    launcher   a rank whose launcher has died (``lifeline.launcher_gone``) ends before sealing,
               publishing or pruning: nothing more is written after the launcher's ``kill -9``
    async      ``save_async``: the state is copied to host memory, then written, sealed, published and
               pruned in the background, exactly as ``save`` does it (the same ``_complete``, on a group of
               its own): until every rank's files are written and checksummed it is a hidden temporary
               directory, and the previous checkpoints are untouched; the next ``finish`` (the next save,
               a stop, the run's end) waits for it and raises its error on every rank; ``close`` waits
               for a write in flight (at most its timeout) and starts nothing more
    lock       ``LOCK``, held by the writing run's rank 0 (``lock.py``); readers take no lock:
               a checkpoint is removed by one rename, so a reader sees it whole or not at all, and
               ``read_newest`` tries again once if it was pruned while being read

``CheckpointManager`` owns save, load, keep-N, the lock and the choice of the checkpoint to
resume from for one run; its collective methods decide on the group's rank 0 and share the
outcome, so a refusal is the same ValueError on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from modelpar.checkpoint import store
from modelpar.checkpoint.lock import DirLock
from modelpar.checkpoint.shards import ShardedState, ShardSavePlanner
from modelpar.distributed.lifeline import end_if_orphaned

__all__ = ["CheckpointManager", "check_fresh", "latest_checkpoint", "load_checkpoint", "read_newest",
           "save_checkpoint"]

Note = Callable[[str], None]
T = TypeVar("T")


def latest_checkpoint(root: str | os.PathLike, skipped: list[tuple[Path, str]] | None = None, *,
                      checksums: bool = True) -> Path | None:
    """The newest valid checkpoint under ``root`` (None if there is none).

    Newer ones that fail ``checkpoint_problem`` are passed over and appended to ``skipped``
    as (path, reason). ``checksums=False``: sizes and metadata only (no byte read), for messages.
    """
    return CheckpointManager(root).latest(skipped, checksums=checksums)


def checkpoint_at(path: str | os.PathLike, skipped: list[tuple[Path, str]] | None = None) -> Path:
    """``path`` itself if it is a checkpoint (``step_N``; ValueError if it is damaged, as a directory's
    damaged ones are skipped), else the newest valid one inside it (``CheckpointManager.newest_or_error``)."""
    path = Path(path)
    if not store.is_checkpoint(path):
        return CheckpointManager(path).newest_or_error(skipped)
    why = store.checkpoint_problem(path)
    if why:
        raise ValueError(f"checkpoint {str(path)!r} is damaged ({why}): give another step, or the directory "
                         f"{str(path.parent)!r} for its newest valid checkpoint")
    return path


def read_newest(root: str | os.PathLike, read: Callable[[Path], T], note: Note | None = None) -> T:
    """``read(path)`` of ``checkpoint_at(root)``, tried again once with the then newest if the checkpoint was
    pruned underneath (a run writing beside). ``note``: told in one line which checkpoint was read when
    damaged newer ones were skipped. A checkpoint that cannot be read is a ValueError naming it."""
    root = Path(root)
    for attempt in (0, 1):
        skipped: list[tuple[Path, str]] = []
        path = checkpoint_at(root, skipped)
        try:
            value = read(path)
        except (OSError, ValueError, RuntimeError, CheckpointException) as err:
            if path.exists():  # not pruned: a real error
                if isinstance(err, ValueError):
                    raise
                raise ValueError(f"checkpoint {str(path)!r} cannot be read ({_first_line(err)})") from None
            if attempt or path == root:
                raise ValueError(f"checkpoint {str(path)!r} was removed while it was read (a run writing "
                                 f"{str(path.parent)!r} pruned it): try again") from None
            continue
        if skipped and note is not None:
            note(f"warning: took {str(path)!r} (step {store.checkpoint_step(path)}), the newest valid checkpoint; "
                 "skipped damaged " + "; ".join(f"{str(p)!r} ({why})" for p, why in skipped))
        return value
    raise AssertionError("unreachable")


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def check_fresh(root: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
    """ValueError if a run would write ``root`` while it holds a foreign ``step_<n>`` folder (the run
    might replace it; ``--overwrite`` would remove it), or if a run without ``resume`` would start
    there while it holds checkpoints (and ``overwrite`` does not ask to remove them)."""
    strangers = store.foreign(root)
    if strangers:
        more = f" (and {len(strangers) - 1} more)" if len(strangers) > 1 else ""
        raise ValueError(f"checkpoint directory {str(root)!r} holds {strangers[0].name}{more}, which is not a modelpar "
                         f"checkpoint (no {store.MARKER}, {store.META} or {store.DCP_METADATA} in it): modelpar "
                         "writes and removes only its own checkpoints; move it out, or choose another --checkpoint-dir")
    found = store.step_dirs(root)
    if found and not resume and not overwrite:
        raise ValueError(f"checkpoint directory {str(root)!r} holds checkpoints of an earlier run (newest "
                         f"{found[0].name}): add --resume to continue it, --overwrite to delete them and start "
                         "over, or choose another --checkpoint-dir")


def _agree(group: Any, decide: Callable[[], T]) -> T:
    """``decide()`` on the group's rank 0, its result (or its ValueError / OSError) on every rank."""
    outcome: tuple[Any, str] = (None, "")
    if dist.get_rank(group) == 0:
        try:
            outcome = (decide(), "")
        except (ValueError, OSError) as err:  # OSError: e.g. a directory this user may not write
            outcome = (None, str(err))
    box = [outcome]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    value, error = box[0]
    if error:
        raise ValueError(error)
    return value


def _no_space(err: BaseException | None, where: Path) -> bool:
    """Whether a failed write ran out of space: ENOSPC in the error chain, or (DCP wraps torch's
    writer errors in its own text) a file system with less than a block left."""
    seen = err
    while seen is not None:
        if getattr(seen, "errno", None) == errno.ENOSPC or "No space left" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(where).free < (1 << 20)
    except OSError:
        return False


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else 0


@dataclass
class _Pending:
    """A save written, then sealed, in the background (``save_async``)."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    nbytes: int
    started: float  # time.perf_counter() when it was started
    done: Future[tuple[str, float]] = field(default_factory=Future)  # (its path, seconds from start to COMPLETE)


def _failed(err: BaseException) -> Future[dict[str, int]]:
    future: Future[dict[str, int]] = Future()
    future.set_exception(err)
    return future


class CheckpointManager:
    """The checkpoint directory ``root`` of one run (or of a reader: no group needed to read).

    ``group``: the process group of the collective methods (``open``, ``choose``, ``load``, ``save``);
    ``keep``: valid checkpoints kept (0: all); ``note``: where rank 0's notes and warnings go.
    """

    def __init__(self, root: str | os.PathLike, *, group: Any = None, keep: int = 2, note: Note | None = None) -> None:
        self.root, self.group, self.keep, self.note = Path(root), group, keep, note
        self.lock: DirLock | None = None
        self._valid: set[tuple[str, int, int]] = set()  # checkpoints verified in this process (marker identity)
        self._pending: _Pending | None = None  # the save being written in the background (save_async)
        self._writers: Any = None  # the process group of background writes (their collectives run in DCP's thread)
        self._planner = ShardSavePlanner()  # kept from save to save: an unchanged plan is not made again
        self.write_seconds = 0.0  # how long the last save took from its start to its completion
        self._sealing = threading.Lock()  # held by rank 0 while it seals, publishes and prunes (``_finish``)
        self._given_up = False  # ``close`` stopped waiting for a background save: it must not seal any more

    # --- what counts -------------------------------------------------------------------------------
    def problem(self, path: Path, checksums: bool = True) -> str:
        """``store.checkpoint_problem``, each checkpoint's checksums read once in this process."""
        try:
            st = (path / store.MARKER).stat()
        except OSError:
            return f"no {store.MARKER} marker"
        key = (str(path), st.st_ino, st.st_mtime_ns)
        if key in self._valid:
            return ""
        found = store.checkpoint_problem(path, checksums)
        if not found and checksums:
            self._valid.add(key)
        return found

    def valid(self) -> list[Path]:
        """The valid checkpoints, newest first."""
        return [p for p in store.checkpoints(self.root) if not self.problem(p)]

    def latest(self, skipped: list[tuple[Path, str]] | None = None, *, checksums: bool = True) -> Path | None:
        """The newest valid checkpoint (None: none); damaged newer ones appended to ``skipped`` with why.

        One that disappears while it is checked was pruned by a writer, which has written a newer
        one: the directory is listed again.
        """
        for _ in range(3):
            found: list[tuple[Path, str]] = []
            for path in store.checkpoints(self.root):
                why = self.problem(path, checksums)
                if not why:
                    if skipped is not None:
                        skipped += found
                    return path
                if not path.exists():
                    break
                found.append((path, why))
            else:
                if skipped is not None:
                    skipped += found
                return None
        return None

    def newest_or_error(self, skipped: list[tuple[Path, str]] | None = None) -> Path:
        """``latest(skipped)``, or a ValueError saying why there is none (naming the damaged ones)."""
        if not self.root.is_dir():
            raise ValueError(f"checkpoint {str(self.root)!r} does not exist (expected a checkpoint directory)")
        skipped = [] if skipped is None else skipped
        found = self.latest(skipped)
        if found is None:
            damaged = "; damaged: " + ", ".join(f"{p.name} ({why})" for p, why in skipped) if skipped else ""
            raise ValueError(f"{str(self.root)!r} is not a checkpoint: no {store.MARKER} marker and no complete "
                             f"step_N checkpoint inside{damaged}")
        return found

    def prune(self, written: Path | None = None) -> list[Path]:
        """Remove leftover temporary directories and the valid checkpoints beyond the newest ``keep``
        (``written``, the one just saved, always stays); damaged ones are neither counted nor removed."""
        store.remove_leftovers(self.root)
        if self.keep <= 0:
            return []
        drop = [p for p in self.valid()[self.keep:] if p != written]
        for path in drop:
            store.remove(path)
        return drop

    # --- a run's life (collective over ``group``) ----------------------------------------------------
    def open(self, *, resume: bool = False, overwrite: bool = False) -> None:
        """Lock the directory for this run, remove torn saves, and refuse a fresh run into an earlier
        run's checkpoints (``overwrite``: remove them). Rank 0 decides; a refusal raises on every rank."""
        try:
            _agree(self.group, lambda: self._open(resume, overwrite))
        except ValueError:
            self.close()
            raise

    def _open(self, resume: bool, overwrite: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"checkpoint_dir must be a directory, got {str(self.root)!r}, which is a file")
        lock = DirLock(self.root)
        warning = lock.acquire()
        self.lock = lock
        self._say([f"warning: {warning}"] if warning else [])
        self._say([f"removed {str(p)!r}, " + ("a checkpoint whose removal never completed (replaced or pruned)"
                                              if ".old-" in p.name else "a checkpoint save that never completed")
                   for p in store.remove_leftovers(self.root)])
        check_fresh(self.root, resume=resume, overwrite=overwrite)
        if overwrite and not resume:
            old = store.checkpoints(self.root)  # check_fresh refused foreign folders: these are all ours
            for path in old:
                store.remove(path)
            if old:
                self._say([f"removed the {len(old)} checkpoint{'s' if len(old) > 1 else ''} of an earlier run "
                           f"(--overwrite), newest {old[0].name}"])

    def choose(self, check: Callable[[Path, list[str]], None] | None = None) -> Path | None:
        """The checkpoint to resume from (None: start at step 0): the newest valid one, damaged newer
        ones skipped with a warning; ``check(path, notes)`` raises ValueError if it does not fit the run."""
        def decide() -> str | None:
            notes: list[str] = []
            try:
                path = self.resume_point(notes, check)
            finally:  # what was found before an error too
                self._say(notes)
            return str(path) if path else None

        path = _agree(self.group, decide)
        return Path(path) if path else None

    def resume_point(self, notes: list[str], check: Callable[[Path, list[str]], None] | None = None) -> Path | None:
        """``choose``'s decision in this process: no group needed (a check before starting ranks)."""
        skipped: list[tuple[Path, str]] = []
        path = self.latest(skipped)
        notes += [f"warning: skipping damaged checkpoint {str(p)!r} ({why})" for p, why in skipped]
        if path is None:
            if skipped:  # never start over on top of them: a later save or --keep would bury them
                raise ValueError(f"--resume: checkpoint directory {str(self.root)!r} holds checkpoints but none is valid: "
                                 + ", ".join(f"{p.name} ({why})" for p, why in skipped)
                                 + "; repair or move them away (modelpar does not start over on top of them)")
            notes.append(f"no complete checkpoint in {str(self.root)!r}: starting from step 0")
            return None
        if check is not None:
            check(path, notes)
        return path

    def load(self, path: Path, state: ShardedState) -> dict[str, Any]:
        """Fill ``state``'s tensors from checkpoint ``path`` (at any split); return its metadata."""
        return store.load_into(path, state, group=self.group)

    def save(self, step: int, state: ShardedState, meta: dict[str, Any]) -> Path:
        """Write ``state`` as ``root/step_<step>``, then prune to ``keep``; return its path.

        A failed write leaves the previous checkpoints as they were and removes the partial one; a
        full file system is one ValueError on every rank: "no space left on device writing ...".
        """
        self.finish()
        started = time.perf_counter()
        tmp = Path(_agree(self.group, lambda: str(store.scratch(self._mkdir(), step))))
        crcs: dict[str, int] = {}
        failure: BaseException | None = None
        try:
            crcs = store.write_files(tmp, state, self.group, self._planner)
        except (Exception, CheckpointException) as err:  # DCP's (a BaseException) comes on every rank
            failure = err
        path = self._complete(tmp, step, meta, crcs, failure, _nbytes(state))
        self.write_seconds = time.perf_counter() - started
        return path

    def save_async(self, step: int, state: ShardedState, meta: dict[str, Any]) -> Path | None:
        """Collective: ``finish`` the save in flight, then start the save of ``step``: ``state`` is copied to host
        memory before this returns, then written (DCP's ``async_save``), sealed, published and pruned in the
        background, as ``save`` does, the collectives on a group of their own. Returns the checkpoint ``finish``
        completed now (None: none was in flight)."""
        done = self.finish()
        started = time.perf_counter()
        if self._writers is None:  # collective, once: the background writes' own group
            self._writers = dist.new_group(dist.get_process_group_ranks(self.group), backend="gloo")
        tmp = Path(_agree(self.group, lambda: str(store.scratch(self._mkdir(), step))))
        staged = self._staged(state, tmp, step)
        pending = _Pending(step, tmp, copy.deepcopy(meta), _nbytes(state), started)  # meta as it is now
        try:
            written = store.start_write(tmp, staged, self._writers, self._planner)
        except (Exception, CheckpointException) as err:
            written = _failed(err)
        self._pending = pending
        written.add_done_callback(lambda crcs: self._complete_in_background(pending, crcs))
        return done

    def _staged(self, state: ShardedState, tmp: Path, step: int) -> ShardedState:
        """Collective: ``state`` copied to host memory on every rank, or, where one rank's copy fails (host memory
        full), the same ValueError on every rank and ``tmp`` removed: no rank starts a background write the others
        would wait for."""
        staged, error = None, ""
        try:
            staged = state.snapshot()
        except Exception as err:  # e.g. "DefaultCPUAllocator: can't allocate memory"
            error = _first_line(err)
        errors: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        failed = [(rank, text) for rank, text in enumerate(errors) if text]
        if not failed:
            assert staged is not None
            return staged
        if dist.get_rank(self.group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        rank, text = failed[0]
        raise ValueError(f"copying checkpoint step {step} to host memory failed on rank {rank} ({text}); the previous "
                         "checkpoints are kept")

    def _complete_in_background(self, pending: _Pending, written: Future[dict[str, int]]) -> None:
        """In the writing thread, once this rank's files are written: ``_complete`` over the writers' group."""
        crcs: dict[str, int] = {}
        failure: BaseException | None = None
        try:
            crcs = written.result()
        except (Exception, CheckpointException) as err:
            failure = err
        try:
            path = self._complete(pending.tmp, pending.step, pending.meta, crcs, failure, pending.nbytes,
                                  self._writers)
            pending.done.set_result((str(path), time.perf_counter() - pending.started))
        except BaseException as err:  # a future's callback must not raise: the error goes to ``finish``
            pending.done.set_exception(err)

    def finish(self) -> Path | None:
        """Wait for the save in flight (``save_async``) to be written, sealed, published and pruned; its path (None:
        none in flight). A failed write is the same ValueError as ``save``'s, on every rank (they agreed on it)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        path, self.write_seconds = pending.done.result()
        return Path(path)

    def _complete(self, tmp: Path, step: int, meta: dict[str, Any], crcs: dict[str, int],
                  failure: BaseException | None, nbytes: int, group: Any = None) -> Path:
        """Collective over ``group`` (default: the manager's): every rank's outcome gathered, then rank 0 seals,
        publishes and prunes (``_finish``)."""
        group = self.group if group is None else group
        rank = dist.get_rank(group)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (crcs, failure is not None, nbytes), group=group)
        if any(failed for _, failed, _ in gathered):  # every rank sees it: the plans are made afresh next time
            self._planner = ShardSavePlanner()
        if rank == 0 and failure is None and any(failed for _, failed, _ in gathered):
            failure = RuntimeError("another rank failed to write its file")
        return Path(_agree(group, lambda: self._finish(tmp, step, meta, gathered, failure)))

    def _mkdir(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root

    def _finish(self, tmp: Path, step: int, meta: dict[str, Any], gathered: list[Any],
                failure: BaseException | None) -> str:
        """Rank 0: seal and publish the written files, then prune; or remove them and say why not. Never once
        ``close`` has given up waiting for it (the directory's lock may be another run's by then)."""
        with self._sealing:
            if self._given_up and failure is None:
                failure = RuntimeError("the run closed the checkpoint directory before this save was complete")
            return self._seal_or_remove(tmp, step, meta, gathered, failure)

    def _seal_or_remove(self, tmp: Path, step: int, meta: dict[str, Any], gathered: list[Any],
                        failure: BaseException | None) -> str:
        final = store.final_path(self.root, step)
        if failure is None:
            try:
                end_if_orphaned()  # the launcher killed: nothing more is written (the next run removes tmp)
                store.seal(tmp, step, meta, {k: v for crcs, _, _ in gathered for k, v in crcs.items()})
                end_if_orphaned()
                store.publish(tmp, final)
            except OSError as err:
                failure = err
        if failure is not None:
            full = _no_space(failure, tmp)
            previous = self.valid()[:1]
            needed = _size(previous[0]) if previous else sum(nbytes for _, _, nbytes in gathered)
            shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise ValueError(f"no space left on device writing checkpoint step {step} to {str(self.root)!r} "
                                 f"(needs ~{needed / 1e6:,.1f} MB; the previous checkpoints are kept)")
            raise ValueError(f"writing checkpoint step {step} to {str(self.root)!r} failed "
                             f"({type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}); "
                             "the previous checkpoints are kept")
        self._valid.add((str(final), (final / store.MARKER).stat().st_ino, (final / store.MARKER).stat().st_mtime_ns))
        end_if_orphaned()
        self.prune(final)
        return str(final)

    def close(self, timeout: float = 60.0) -> None:
        """Release the lock (rank 0; a no-op elsewhere), once a save in flight has ended (at most ``timeout`` s).
        It ends complete if every rank's write succeeded in time (an error raised meanwhile on the ranks does not stop
        it: it holds the state of a step that completed); one still running then is never sealed: its temporary
        directory is removed by the next run."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(BaseException):  # not waited for further either way
                pending.done.result(timeout=timeout)
            with self._sealing:
                self._given_up = not pending.done.done()
            self._planner = ShardSavePlanner()  # not the one a write past its timeout may still be using
        if self._writers is not None:  # its gloo threads end with it (a process may train again)
            dist.destroy_process_group(self._writers)
            self._writers = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _say(self, notes: list[str]) -> None:
        if self.note is not None:
            for text in notes:
                self.note(text)


def _nbytes(state: ShardedState) -> int:
    return sum(piece.tensor.nbytes for shard in state.shards.values() for piece in shard.pieces)


def save_checkpoint(root: str | os.PathLike, step: int, state: ShardedState, meta: dict[str, Any], *,
                    group: Any, keep: int = 2) -> Path:
    """Collective over ``group``: ``CheckpointManager(root).save`` without the run's lock (a library call)."""
    return CheckpointManager(root, group=group, keep=keep).save(step, state, meta)


def load_checkpoint(path: str | os.PathLike, state: ShardedState, *, group: Any) -> dict[str, Any]:
    """Collective over ``group``: fill ``state``'s tensors in place from checkpoint ``path``; return its metadata.

    Every rank asks for the boxes it holds now, whatever split wrote them; ValueError on every rank
    before any tensor is read if the checkpoint lacks one of a rank's names or holds another shape.
    """
    return store.load_into(path, state, group=group)

