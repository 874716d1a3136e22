"""`tandem --help` and every subcommand's help show every option with its help text and default, and
bad values are refused at parse time naming the valid set."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Literal

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


# `tandem train` options that are settings of the config dataclasses, beside StepConfig's (all of which
# the CLI generates): dest -> TrainerConfig field. --batch-size is the global batch (split over the workers).
TRAINER_OPTIONS = {"batch_size": "batch_size", "seed": "seed", "clip_grad_norm": "clip_grad_norm",
                   "kvstore": "kvstore", "communication": "communication",
                   "gradient_compression": "gradient_compression"}  # fmt: skip
# Options that are no config field as such: the run's own, or a field under another form (--update-on
# servers|workers is update_on_kvstore, --no-progress is progress=False).
CLI_ONLY = {"help", "model", "data", "epochs", "optimizer", "lr", "momentum", "weight_decay", "update_on", "out",
            "samples", "max_train_samples", "max_eval_samples", "model_arg", "threads", "save", "no_progress",
            "checkpoint_dir", "checkpoint_every"}  # fmt: skip


def _train_actions() -> dict[str, argparse.Action]:
    return {action.dest: action for action in _subcommands(build_parser())["train"]._actions}


def test_every_train_option_is_a_config_field_or_declared_cli_only() -> None:
    from tandem.cli import step_option_names

    unclassified = set(_train_actions()) - set(step_option_names()) - set(TRAINER_OPTIONS) - CLI_ONLY
    assert not unclassified, f"map these tandem train options to a config field or list them in CLI_ONLY: {unclassified}"
    assert not CLI_ONLY - set(_train_actions()), "CLI_ONLY names an option tandem train no longer has"


def test_step_options_follow_step_config() -> None:
    """Every StepConfig field has a `tandem train` option with the field's default, choices and help text."""
    from dataclasses import MISSING, fields

    from tandem.cli import field_docs
    from tandem.step import StepConfig

    actions, docs, hints = _train_actions(), field_docs(StepConfig), typing.get_type_hints(StepConfig)
    for f in fields(StepConfig):
        if not f.init:
            continue
        action = actions.get(f.name)
        assert action is not None, f"StepConfig.{f.name} has no tandem train option"
        assert action.option_strings[0] == "--" + f.name.replace("_", "-")
        assert f.default is not MISSING and action.default == f.default, f"--{f.name}: default {action.default!r}"
        literal = [a for a in (hints[f.name], *typing.get_args(hints[f.name])) if typing.get_origin(a) is Literal]
        valid = f.metadata.get("choices") or [value for a in literal for value in typing.get_args(a)]
        if valid:  # the field's valid set
            assert tuple(action.choices or ()) == tuple(valid), f"--{f.name}: choices differ"
        for choice in action.choices or ():  # a hand-written option's choices: each one a value the field takes
            StepConfig(**{f.name: choice})
        assert f.name in docs and action.help, f"StepConfig.{f.name} is not documented in its docstring"


def test_trainer_options_follow_trainer_config_and_the_registries() -> None:
    from dataclasses import fields

    from tandem.kvstore import KINDS
    from tandem.trainer import TrainerConfig
    from tandem.update import MODES

    defaults = {f.name: f.default for f in fields(TrainerConfig)}
    actions = _train_actions()
    for dest, name in TRAINER_OPTIONS.items():
        assert actions[dest].default == defaults[name], f"--{dest}: default {actions[dest].default!r} is not {name}'s"
    assert tuple(actions["kvstore"].choices or ()) == KINDS
    assert tuple(actions["communication"].choices or ()) == ("auto", *MODES)
    assert tuple(actions["update_on"].choices or ()) == ("servers", "workers")


def test_optimizer_choices_are_registered_update_rules() -> None:
    from tandem import optim

    choices = _train_actions()["optimizer"].choices or ()
    assert choices and all(optim.create(name, lr=0.1).name == name for name in choices)


def test_field_docs_reads_the_attributes_section() -> None:
    from tandem.cli import field_docs

    class Example:
        """Summary.

        Attributes:
            first: one ``literal`` line
                continued here.
            second (int): another.

        Example:
            not: a field
        """

    assert field_docs(Example) == {"first": "one literal line continued here.", "second": "another."}


def test_step_options_reach_the_step_config() -> None:
    """What `tandem train` parses is what the Trainer's StepConfig gets; a bad value stops `tandem train`
    before it builds anything, naming the valid values (no traceback)."""
    from tandem.cli import main, step_option_names
    from tandem.step import StepConfig

    args = build_parser().parse_args(["train", "--mirror", "0.5", "--bulk-bwd", "4", "--no-recapture"])
    config = StepConfig(**{name: getattr(args, name) for name in step_option_names()})
    assert (config.mirror, config.bulk_bwd, config.recapture, config.max_captures) == (0.5, 4, False, 8)
    for bad, valid in ((["--mirror", "lots"], "memory-aware"), (["--bulk-fwd", "-2"], "int >= 0")):
        with pytest.raises(SystemExit, match=f"tandem train: .*{valid}"):
            main(["train", *bad])


@dataclasses.dataclass
class _Fields:
    """A StepConfig with more kinds of field.

    Attributes:
        backend: what runs the segments.
        level: how much (50% more).
        fast: go fast.
    """

    backend: Literal["aten", "inductor"] = "aten"
    level: int | None = dataclasses.field(default=None, metadata={"choices": (1, 2)})
    fast: bool = False


def test_a_new_step_config_field_gets_its_option(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.step

    monkeypatch.setattr(tandem.step, "StepConfig", _Fields)
    actions = _train_actions()
    assert (actions["backend"].choices, actions["backend"].default, actions["backend"].help) == (
        ("aten", "inductor"), "aten", "what runs the segments.")
    assert actions["level"].choices == (1, 2) and actions["level"].type is int
    assert "50%" in _subcommands(build_parser())["train"].format_help()
    args = build_parser().parse_args(["train", "--backend", "inductor", "--level", "2", "--fast"])
    assert (args.backend, args.level, args.fast) == ("inductor", 2, True)
