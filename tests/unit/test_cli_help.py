"""`tandem --help` and every subcommand's help show every option with its help text and default, and
bad values are refused at parse time naming the valid set."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    assert {"train", "launch"} <= set(_subcommands(parser)), "launch is always there"
    top = parser.format_help()
    assert "train" in top and "launch" in top
    for name, sub in _subcommands(parser).items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            assert action.help, f"tandem {name} {flag} has no help text"
            assert flag in text, f"tandem {name} --help does not show {flag}"
            if action.option_strings and not action.required:
                assert "(default:" in sub._get_formatter()._expand_help(action), f"tandem {name} {flag} hides its default"


def test_bad_choices_are_refused_at_parse_time(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--kvstore", "foo"])
    error = capsys.readouterr().err
    assert "invalid choice: 'foo'" in error and "dist_p3" in error


def test_models_come_from_the_registries() -> None:
    from tandem.models import LIBRARY, ZOO

    train = _subcommands(build_parser())["train"]
    model = next(a for a in train._actions if a.dest == "model")
    assert set(model.choices or ()) == set(ZOO) | set(LIBRARY)
