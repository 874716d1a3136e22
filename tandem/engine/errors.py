"""Errors of the dependency engine and the record a failed op leaves behind.

An op runs on a worker thread, so its exception cannot reach the caller directly. The engine keeps a
:class:`Failure` and raises a fresh :class:`EngineError` (chained to the original exception) at the
next wait that observes it; a fresh error per raise keeps tracebacks from piling up on one instance.
"""

from __future__ import annotations

from dataclasses import dataclass


class EngineError(RuntimeError):
    """An engine op failed (or was skipped because an op it depends on failed).

    ``op_name`` names the op whose own code raised; ``original`` is that exception (also ``__cause__``).
    """

    def __init__(self, message: str, op_name: str = "", original: BaseException | None = None) -> None:
        super().__init__(message)
        self.op_name = op_name
        self.original = original


class EngineTimeout(EngineError, TimeoutError):
    """A wait ran past its timeout; the message names what was waited for and what is still pending."""


@dataclass(eq=False)
class Failure:
    """What a failed op leaves on the vars it writes until a wait reports it.

    ``root`` is the failure that started it all: a skipped op's failure points at the op that raised.
    """

    op_name: str
    exception: BaseException
    traceback_text: str
    root: Failure | None = None
    reported: bool = False

    @property
    def origin(self) -> Failure:
        return self.root if self.root is not None else self

    def skipped(self, op_name: str) -> Failure:
        """The failure of an op that did not run because it touches a var this failure poisoned."""
        origin = self.origin
        return Failure(op_name, origin.exception, origin.traceback_text, root=origin)

    def to_error(self) -> EngineError:
        origin = self.origin
        exc = origin.exception
        if self.root is None:
            head = f"engine op {self.op_name!r} failed: {type(exc).__name__}: {exc}"
        else:
            head = (
                f"engine op {self.op_name!r} was skipped because {origin.op_name!r} failed "
                f"({type(exc).__name__}: {exc})"
            )
        message = (
            f"{head}\n--- original traceback of {origin.op_name!r} ---\n{origin.traceback_text.rstrip()}"
        )
        error = EngineError(message, op_name=origin.op_name, original=exc)
        error.__cause__ = exc
        return error

    def mark_reported(self) -> None:
        self.reported = True
        self.origin.reported = True
