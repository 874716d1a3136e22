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
every worker and server has written its file, so a job killed while saving leaves an incomplete
directory that is ignored. A resume takes the newest complete directory; worker 0 keeps the newest
``KEEP`` complete ones and deletes every directory older than those.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

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
    removed if ``write`` raises; only a killed process leaves one behind (``.<name>.*.tmp``)."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as stream:
            write(stream)
            stream.flush()  # Python's buffer to the kernel ...
            os.fsync(stream.fileno())  # ... and the kernel's to the disk, before the rename can be
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(directory)  # the rename is a change of the directory: make it durable too


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
