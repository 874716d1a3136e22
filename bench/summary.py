"""Refresh the sections of docs/benchmarks.md that are copied from a doc page's own measurements.

    python bench/summary.py

docs/benchmarks.md is written by hand: the current tables of every capability, each with the
command that reproduces it, its date and its hardware (the capability pages keep one summary table
each). A page listed in PAGES keeps its measurements next to the text that explains them; this
copies that section into docs/benchmarks.md under the page's title, replacing the section of that
title where it exists and appending it otherwise. Every other section is left as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = [  # (page, title, headings whose sections hold measurements)
    ("real-models.md", "Real library models (transformers, timm)", ["Measured"]),
]


def section(text: str, heading: str) -> str | None:
    """The body under a markdown heading named ``heading``, up to the next heading of its level or higher."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, flags=re.MULTILINE)
    if match is None:
        return None
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.MULTILINE)
    body = rest[: end.start()] if end else rest
    return re.sub(r"^(#+) ", lambda m: "#" * max(len(m.group(1)), 3) + " ", body, flags=re.MULTILINE).strip()


def refresh(summary: str, title: str, block: str) -> str:
    """``summary`` with its ``## title`` section replaced by ``block`` (appended if there is none)."""
    match = re.search(rf"^## {re.escape(title)}\s*$", summary, flags=re.MULTILINE)
    if match is None:
        return summary.rstrip("\n") + "\n\n" + block
    rest = summary[match.end():]
    end = re.search(r"^## ", rest, flags=re.MULTILINE)
    return summary[: match.start()] + block + ("\n" + rest[end.start():] if end else "")


def main() -> None:
    path = DOCS / "benchmarks.md"
    summary = path.read_text()
    for page, title, headings in PAGES:
        text = (DOCS / page).read_text()
        bodies = [body for body in (section(text, h) for h in headings) if body]
        if not bodies:
            print(f"{page}: no measurement section; left as it is")
            continue
        summary = refresh(summary, title, f"## {title}\n\nFrom [{page}]({page}).\n\n" + "\n\n".join(bodies) + "\n")
    path.write_text(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
