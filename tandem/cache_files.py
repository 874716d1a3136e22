"""Files tandem keeps under inductor's cache directory (the capture cache, the compiled-unit index):
where they live, which of them may be read, and how they are written.

They live in inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, default
``/tmp/torchinductor_$USER``), so that emptying it starts tandem and inductor cold together. An entry
is read only where it, its folder and the cache directory belong to this user and no one else may
write them (the capture cache's entries are pickles); it is written whole and renamed into place,
so a reader sees all of it or nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def folder(name: str) -> Path:
    """``name`` under inductor's cache directory (not created here)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).absolute() / name


def read(path: Path, off_switch: str) -> bytes | None:
    """The bytes of ``path``, or None where it is missing, unreadable or not trusted (``trusted``);
    ``off_switch`` is the knob the warning names. Never raises."""
    try:
        if not path.is_file() or not all(trusted(p, off_switch) for p in (path.parent.parent, path.parent, path)):
            return None
        return path.read_bytes()
    except OSError:  # unreadable, or removed meanwhile (another process dropped it): a miss
        return None


def write(path: Path, data: bytes, off_switch: str) -> bool:
    """Write ``data`` to ``path`` (its folder made private where missing); whether it was written.
    Never raises: a folder that cannot be written or trusted is left as it is."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not trusted(path.parent.parent, off_switch) or not trusted(path.parent, off_switch):
            return False
        # written whole, then renamed: a process reading at the same time sees all of it or nothing
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")  # mode 0600
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        finally:
            with contextlib.suppress(OSError):
                Path(temporary).unlink(missing_ok=True)  # gone already once renamed
        return True
    except OSError as error:
        log.info("tandem: %s was not written (%s: %s)", path, type(error).__name__, error)
        return False


_untrusted_warned: set[Path] = set()


def trusted(path: Path, off_switch: str) -> bool:
    """Owned by this user and writable by no one else (where the system has user ids). Warns once per path."""
    info = path.stat()
    if not hasattr(os, "geteuid"):
        return True
    if info.st_uid == os.geteuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return True
    if path not in _untrusted_warned:
        _untrusted_warned.add(path)
        log.warning("tandem: not using the cache at %s: it must belong to this user and be writable by no one "
                    "else (fix its owner and mode, or set %s=0)", path, off_switch)
    return False
