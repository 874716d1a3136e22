"""Progress bars (tqdm) that read well on a terminal and in a log: training epochs, compiling segments."""

from __future__ import annotations

import re
import sys
from typing import Any, TextIO

_CURSOR_MOVES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
PROGRESS_LINE_SECONDS = 5.0  # off a terminal, the progress bar is printed as a new line this often


class _ProgressLines:
    """A stream for tqdm off a terminal (a log file, or `tandem launch`, which prefixes its workers'
    output line by line): each redraw of the bar becomes a line of its own, and clearing it (only
    ``\\r`` and spaces) writes nothing; a terminal redraws the bar in place instead."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.encoding = getattr(stream, "encoding", None)  # tqdm draws unicode blocks only for a utf-8 stream

    def write(self, text: str) -> int:
        line = _CURSOR_MOVES.sub("", text.replace("\r", "")).rstrip()  # a nested bar moves the cursor: not in a log
        if line:
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_options() -> dict[str, Any]:
    """tqdm's options: the live bar on a terminal; elsewhere a line every PROGRESS_LINE_SECONDS."""
    stream = sys.stderr
    if stream is None or stream.isatty():
        return {}
    return {"file": _ProgressLines(stream), "mininterval": PROGRESS_LINE_SECONDS}
