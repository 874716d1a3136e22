"""MkDocs hooks: the reference tables that come from the code, generated at build time.

A page that contains ``<!-- generated: cli -->`` gets the `tandem` command's options (from its
argparse parser); ``<!-- generated: environment -->`` the TANDEM_* knobs (from tandem/env.py). So
the pages cannot drift from the code, and nothing generated is kept in git.
"""

from __future__ import annotations

import argparse
from typing import Any

_MARKERS = {"<!-- generated: cli -->": lambda: cli_reference(), "<!-- generated: environment -->": lambda: environment_reference()}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, generate in _MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """One table per subcommand of `tandem`: every option with its help, default and choices."""
    from tandem.cli import build_parser

    parser = build_parser()
    lines: list[str] = []
    for name, sub in _subcommands(parser).items():
        lines += [f"### `tandem {name}`", "", _cell(sub.description or ""), "",
                  "| option | default | choices | meaning |", "|---|---|---|---|"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
            default = "" if action.default in (None, argparse.SUPPRESS) else f"`{action.default}`"
            choices = ", ".join(f"`{c}`" for c in action.choices) if action.choices else ""
            lines.append(f"| {flags} | {default} | {choices} | {_cell(action.help or '')} |")
        lines.append("")
    return "\n".join(lines)


def environment_reference() -> str:
    """Every TANDEM_* knob: type, default and meaning."""
    from tandem.env import all_knobs

    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for knob in all_knobs():
        default = f"`{knob.default}`" if knob.default != "" else "(empty)"
        lines.append(f"| `{knob.name}` | {knob.kind.__name__} | {default} | {_cell(knob.help)} |")
    return "\n".join(lines)
