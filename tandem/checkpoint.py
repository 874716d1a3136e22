"""Checkpoints that survive a crash: atomic files, and the step directories of ``Trainer.fit``.

A file is written atomically (``atomic_save``): into a temporary file beside its target, flushed
and fsync'ed, renamed over the target, and the directory fsync'ed so that the rename itself is on
disk. A process killed at any point leaves either the old file or the new one, never a mix (a
stray temporary file at worst); a power cut after the call returns cannot lose the new one.
``Trainer.save`` and the parameter servers' ``save_server_state`` both write this way.

``Trainer.fit(checkpoint_dir=..., checkpoint_every=N)`` writes one directory per checkpoint::

    checkpoint_dir/step-000120/worker-0.pt ... worker-<W-1>.pt   each worker's trainer state and place in the data
                               server-<r>-of-<S>.pt               the servers' values and optimizer state
                               COMPLETE                           written last, by worker 0: the checkpoint counts

A directory counts only once its ``COMPLETE`` marker exists: worker 0 writes it (atomically) after
every worker and server has written its file, and only once it sees every worker's file there
(``check_worker_files``: ``checkpoint_dir`` must be a filesystem all workers share), so a job
killed while saving leaves an incomplete directory that is ignored. A resume (``resume_point``)
takes the newest complete directory whose files every worker can read: the workers first agree
that they see the same newest checkpoint, and a worker whose file there is damaged makes them all
fall back to the previous one. Worker 0 keeps the newest ``KEEP`` complete ones and deletes every
directory older than those.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

import torch

KEEP = 2  # complete checkpoints kept: the newest, and one more in case the newest's files are damaged
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d+)")


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically: a crash leaves the previous file at ``path`` or the new one.

    Example:
        ```python
        tandem.checkpoint.atomic_save(trainer.state_dict(), "ckpt.pt")   # torch.load reads it as usual
        ```
    """
    _atomic_write(Path(path), lambda stream: torch.save(obj, stream))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, as ``atomic_save`` does.

    Example:
        ```python
        tandem.checkpoint.atomic_write_text("ckpt/step-000120/COMPLETE", '{"step": 120}')
        ```
    """
    _atomic_write(Path(path), lambda stream: stream.write(text.encode()))


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write through ``write`` into a temporary file in ``path``'s directory, fsync it, rename it over
    ``path``, fsync the directory. The temporary file is unique (two writers never share one) and is
    removed if ``write`` raises; only a killed process leaves one behind (``.<name>.*.tmp``). The file
    gets the permissions ``open()`` would give it (0666 less the umask), not mkstemp's 0600."""
    directory = path.parent
    _make_directories(directory)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        if hasattr(os, "fchmod"):  # not on Windows (before 3.13), where mkstemp's mode is no narrower
            os.fchmod(descriptor, 0o666 & ~_umask())
        with os.fdopen(descriptor, "wb") as stream:
            write(stream)
            stream.flush()  # Python's buffer to the kernel ...
            os.fsync(stream.fileno())  # ... and the kernel's to the disk, before the rename can be
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(directory)  # the rename is a change of the directory: make it durable too


def _umask() -> int:
    """This process's umask, read without changing it where the platform allows (Linux's
    /proc/self/status); else set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_directories(directory: Path) -> None:
    """``directory.mkdir(parents=True, exist_ok=True)``, fsync'ing the parent of each directory it
    creates: a new step directory's entry survives a crash, as its files do."""
    missing = []
    ancestor = directory
    while not ancestor.exists() and ancestor.parent != ancestor:
        missing.append(ancestor)
        ancestor = ancestor.parent
    directory.mkdir(parents=True, exist_ok=True)
    for made in reversed(missing):
        _fsync_directory(made.parent)


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform (Windows) that cannot open a directory: the rename is all it offers
        return
    try:
        os.fsync(descriptor)
    except OSError:  # some filesystems refuse fsync on a directory; the file itself is synced
        pass
    finally:
        os.close(descriptor)


# -- the step directories of Trainer.fit ---------------------------------------------------------------
def step_directory(root: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint after ``step`` steps lives under ``root``.

    Example:
        ```python
        tandem.checkpoint.step_directory("ckpt", 120)   # Path("ckpt/step-000120")
        ```
    """
    return Path(root) / f"step-{step:06d}"


def worker_file(directory: Path, rank: int) -> Path:
    """Worker ``rank``'s file in a step directory.

    Example:
        ```python
        tandem.checkpoint.worker_file(Path("ckpt/step-000120"), 1)   # ckpt/step-000120/worker-1.pt
        ```
    """
    return directory / f"worker-{rank}.pt"


def _steps(root: Path) -> dict[int, Path]:
    """Every step directory under ``root`` (complete or not), by step."""
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found[int(match.group(1))] = entry
    return found


def complete_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the complete checkpoints under ``root``, oldest first.

    Example:
        ```python
        tandem.checkpoint.complete_steps("ckpt")        # [100, 120]
        ```
    """
    return sorted(step for step, directory in _steps(Path(root)).items() if (directory / MARKER).exists())


def latest(root: str | os.PathLike[str]) -> tuple[int, Path, dict[str, Any]] | None:
    """The newest complete checkpoint under ``root``: its step, directory and marker (what
    ``mark_complete`` recorded); None when there is none.

    Example:
        ```python
        found = tandem.checkpoint.latest("ckpt")
        if found is not None:
            step, directory, marker = found            # 120, Path("ckpt/step-000120"), {"step": 120, ...}
        ```
    """
    steps = complete_steps(root)
    if not steps:
        return None
    directory = step_directory(root, steps[-1])
    return steps[-1], directory, json.loads((directory / MARKER).read_text())


def mark_complete(directory: Path, record: dict[str, Any]) -> None:
    """Make ``directory`` count: write its marker (JSON of ``record``), atomically. Call it once
    every file of the checkpoint is written.

    Example:
        ```python
        tandem.checkpoint.mark_complete(Path("ckpt/step-000120"), {"step": 120, "workers": 2, "servers": 1})
        ```
    """
    atomic_write_text(directory / MARKER, json.dumps(record))


def check_worker_files(directory: Path, workers: int) -> None:
    """Raise ``CheckpointError`` unless every worker's file (``worker-0.pt`` ... ``worker-<workers-1>.pt``)
    is in ``directory``: worker 0 calls it before ``mark_complete``, after every worker wrote its file.
    A missing one means the workers do not share ``checkpoint_dir`` (each machine has its own).

    Example:
        ```python
        tandem.checkpoint.check_worker_files(Path("ckpt/step-000120"), 2)   # worker-0.pt and worker-1.pt there
        ```
    """
    missing = [str(worker_file(directory, rank)) for rank in range(workers) if not worker_file(directory, rank).exists()]
    if missing:
        raise CheckpointError(
            f"checkpoint {directory} is not complete: worker 0 does not see {', '.join(missing)} although every "
            f"worker wrote its file; checkpoint_dir must be a filesystem shared by all {workers} workers (the same "
            f"directory on every machine, e.g. NFS), not a local directory of each machine")  # fmt: skip


class CheckpointError(RuntimeError):
    """Checkpoints the workers of a job cannot use together: files missing beside worker 0's, workers
    that see different newest checkpoints, or a checkpoint no worker can read."""


T = TypeVar("T")
Gather = Callable[[str], list[str]]  # every worker's text, in rank order (collective; alone: [text])


@dataclass
class Resumed(Generic[T]):
    """The checkpoint a job resumes from (``resume_point``): its step, directory, marker, and what
    ``read`` made of this worker's file there."""

    step: int
    directory: Path
    marker: dict[str, Any]
    loaded: T


def resume_point(root: str | os.PathLike[str], after: int, read: Callable[[Path], T], gather: Gather, rank: int,
                 workers: int) -> Resumed[T] | None:  # fmt: skip
    """The newest complete checkpoint under ``root`` past step ``after`` that every worker can read,
    and what ``read(directory)`` returned for it on this worker; None when there is none past ``after``.
    Collective: every worker calls it with the same arguments but its ``rank``.

    The workers first compare their newest complete step (``gather``): a difference (``checkpoint_dir``
    not shared, or not the same directory) raises ``CheckpointError`` naming each worker's. A marker
    written by another number of workers raises ``ValueError``. ``read`` raising ``OSError`` or
    ``ValueError`` (a missing, truncated or unreadable file) makes this worker warn, naming the file,
    and try the previous complete checkpoint; the workers then agree on the newest step all of them
    read (those that read a newer one read that one), so all resume from the same step. When a
    worker can read none, every worker raises ``CheckpointError``.

    Example:
        ```python
        found = tandem.checkpoint.resume_point("ckpt", 0, lambda d: torch.load(d / "worker-0.pt"), lambda t: [t], 0, 1)
        if found is not None:
            found.step, found.loaded                   # 120, what torch.load read
        ```
    """
    steps = [step for step in complete_steps(root) if step > after]
    newest = [json.loads(text) for text in gather(json.dumps(steps[-1] if steps else None))]
    if len(set(newest)) > 1:
        seen = ", ".join(f"worker {worker}: {'none' if step is None else f'step {step}'}" for worker, step in enumerate(newest))
        raise CheckpointError(f"the workers see different newest complete checkpoints under {root} ({seen}); "
                              f"checkpoint_dir must be a filesystem shared by all workers (the same directory on "
                              f"every machine), else they would resume from different steps")  # fmt: skip
    if not steps:
        return None
    marker = _marker(step_directory(root, steps[-1]))
    if marker is not None and marker.get("workers", 1) != workers:
        raise ValueError(f"checkpoint {step_directory(root, steps[-1])} was written by {marker.get('workers')} workers; "
                         f"this job has {workers}: resume with as many workers, or use another checkpoint_dir")  # fmt: skip
    failures: list[str] = []

    def newest_readable(at_most: int) -> Resumed[T] | None:
        for step in reversed(steps):
            if step > at_most:
                continue
            directory = step_directory(root, step)
            try:
                found = _marker(directory)
                if found is None:
                    raise ValueError(f"its marker {directory / MARKER} is not JSON")
                return Resumed(step, directory, found, read(directory))
            except (OSError, ValueError) as error:
                failures.append(f"{directory}: {error}")
                older = [s for s in steps if s < step]
                print(f"tandem: warning: worker {rank} cannot read checkpoint {directory} ({error}); "
                      + (f"trying the previous one, step-{older[-1]:06d}" if older else "no older complete one"),
                      file=sys.stderr, flush=True)  # fmt: skip
        return None

    resumed = newest_readable(steps[-1])
    while True:
        read_steps = [json.loads(text) for text in gather(json.dumps(resumed.step if resumed is not None else None))]
        unreadable = [worker for worker, step in enumerate(read_steps) if step is None]
        if unreadable:
            mine = f": {'; '.join(failures)}" if rank in unreadable else " (see their warnings)"
            raise CheckpointError(f"worker(s) {unreadable} can read none of the complete checkpoints under {root} past "
                                  f"step {after}{mine}; remove the damaged ones or use another checkpoint_dir")  # fmt: skip
        target = min(read_steps)
        if resumed is None or all(step == target for step in read_steps):
            return resumed
        if resumed.step > target:
            behind = [worker for worker, step in enumerate(read_steps) if step == target]
            print(f"tandem: warning: worker {rank} resumes from step {target}, not {resumed.step}: worker(s) {behind} "
                  f"cannot read a newer checkpoint", file=sys.stderr, flush=True)  # fmt: skip
            resumed = newest_readable(target)


def _marker(directory: Path) -> dict[str, Any] | None:
    """The record in ``directory``'s marker; None when it cannot be read as a JSON object."""
    try:
        record = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def prune(root: str | os.PathLike[str], keep: int = KEEP) -> list[Path]:
    """Delete every step directory older than the newest ``keep`` complete ones (complete or not);
    newer incomplete ones stay (they are being written, or will be written over). Returns the deleted.

    Example:
        ```python
        tandem.checkpoint.prune("ckpt")                  # after step-000140 completed: step-000100 goes
        ```
    """
    complete = complete_steps(root)
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    deleted = []
    for step, directory in sorted(_steps(Path(root)).items()):
        if step < oldest_kept:
            (directory / MARKER).unlink(missing_ok=True)  # first: a half-deleted directory is never resumed from
            shutil.rmtree(directory, ignore_errors=True)
            deleted.append(directory)
    return deleted
