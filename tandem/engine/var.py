"""Engine variables: the unit of dependency tracking.

A var stands for a piece of state (a tensor, a buffer, a socket). Ops name the vars they read and
write; the engine orders ops per var. The scheduling fields are touched only under the owning
engine's lock, so a Var must not be used by two engines with ops in flight at the same time.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.engine.errors import Failure


class Var:
    """A dependency variable. ``version`` counts finished writes (failed or skipped ones included).

    Thread safety: read ``name`` and ``version`` from any thread; everything else belongs to the engine.
    """

    __slots__ = ("name", "version", "_queue", "_readers", "_writing", "_writes_pushed", "_failure")

    def __init__(self, name: str = "") -> None:
        if not isinstance(name, str):
            raise TypeError(f"Var name must be a str, got {type(name).__name__}")
        self.name = name
        self.version = 0
        # Blocked (op, is_write) entries in push order; the head is the next access to grant.
        self._queue: deque[tuple[Any, bool]] = deque()
        self._readers = 0  # granted reads still running
        self._writing = False  # a granted write is running
        self._writes_pushed = 0  # writes pushed so far; wait() waits until version reaches it
        self._failure: Failure | None = None  # failure of the last write, until a wait reports it

    def __repr__(self) -> str:
        label = self.name or hex(id(self))
        return f"Var({label!r}, version={self.version})"

    @property
    def label(self) -> str:
        return repr(self.name) if self.name else f"<unnamed var {id(self):#x}>"
