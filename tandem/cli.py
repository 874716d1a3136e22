"""The `tandem` command: `tandem train ...`, `tandem launch ...` and `tandem plan ...` (also `python -m tandem`)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

DATASETS = ("digits", "synthetic-images", "synthetic-tokens", "pydoc-text")
TEXT_DATA = ("pydoc-text",)  # dict batches whose labels the model shifts itself: no accuracy to report
TOKEN_DATA = ("synthetic-tokens", *TEXT_DATA)  # language modelling: perplexity = exp(mean token loss)


# Sensible model sizes per data set; --model-arg key=value overrides any of them.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "digits": {
        "mlp": {"in_features": 64, "hidden": (128, 128)},
        "resnet": {"depth": 8, "width": 16, "in_channels": 1, "small_input": True},
        "vgg": {"config": "vgg11", "in_channels": 1, "image_size": 8, "width_multiplier": 0.25, "classifier_width": 256},
    },
    "synthetic-images": {
        "mlp": {"in_features": 3 * 32 * 32},
        "resnet": {"depth": 8, "width": 16, "small_input": True},
        "vgg": {"config": "vgg11", "width_multiplier": 0.25, "classifier_width": 512},
    },
    "synthetic-tokens": {
        "lstm_lm": {"vocab_size": 512, "embed_dim": 128, "hidden": 128},
        "gpt": {"vocab_size": 512, "block_size": 64},
    },
    # transformers causal LMs (tandem.models.LIBRARY) built from their config classes: byte-level
    # (vocab 256), 64 positions, 2 layers, hidden 64; the data blocks are as long as the positions
    "pydoc-text": {"hf-gpt2": {}, "hf-llama": {}},
}


def _model_config(model: str, dataset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    base = PRESETS[dataset].get(model)
    if base is None:
        raise SystemExit(f"tandem train: model {model!r} does not fit data {dataset!r}; "
                         "image models (mlp, resnet, vgg) take digits or synthetic-images, "
                         "lstm_lm and gpt take synthetic-tokens, hf-gpt2 and hf-llama take pydoc-text")
    return {**base, **overrides}


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if "," in text:
        return tuple(_parse_value(part) for part in text.split(",") if part)
    return {"true": True, "false": False}.get(text.lower(), text)


def _datasets(args: argparse.Namespace, model_config: dict[str, Any]) -> tuple[Any, Any]:
    from tandem import data

    if args.data == "digits":
        return data.digits("train"), data.digits("test")
    if args.data == "synthetic-images":
        return (data.synthetic_images(args.samples, seed=args.seed),
                data.synthetic_images(max(args.samples // 5, 1), seed=args.seed + 1))
    if args.data == "pydoc-text":
        from tandem.models.library import BLOCK_SIZE, positions

        block_size = positions(model_config) or BLOCK_SIZE
        return data.pydoc_text("train", block_size=block_size), data.pydoc_text("validation", block_size=block_size)
    seq_len = min(64, model_config.get("block_size", 64))
    vocab = model_config.get("vocab_size", 512)
    return (data.synthetic_tokens(args.samples, seq_len=seq_len, vocab_size=vocab, seed=args.seed),
            data.synthetic_tokens(max(args.samples // 5, 1), seq_len=seq_len, vocab_size=vocab, seed=args.seed + 1))


def _first(dataset: Any, count: int | None) -> Any:
    """The first ``count`` samples of ``dataset`` (all of them when ``count`` is None)."""
    if count is None or count >= len(dataset):
        return dataset
    from tandem.data.shard import contiguous

    return contiguous(dataset, 0, count)


def _with_perplexity(record: dict[str, float], data: str) -> dict[str, float]:
    """An epoch's record with perplexities (exp of the mean token loss) on language-model data, and
    without accuracy where the labels are unshifted (the model shifts them: evaluate's is meaningless)."""
    if data in TEXT_DATA:
        record.pop("eval_accuracy", None)
    if data in TOKEN_DATA:
        record["train_perplexity"] = math.exp(min(record["train_loss"], MAX_LOG_PERPLEXITY))
        record["eval_perplexity"] = math.exp(min(record["eval_loss"], MAX_LOG_PERPLEXITY))
    return record


MAX_LOG_PERPLEXITY = 700.0  # exp() of more overflows a float: a diverged run reports ~1e304, not an error


def _optimizer(args: argparse.Namespace) -> Any:
    from tandem import optim

    if args.optimizer == "sgd":
        return optim.SGD(lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    return optim.create(args.optimizer, lr=args.lr, weight_decay=args.weight_decay)


def train(args: argparse.Namespace) -> int:
    import torch

    from tandem import models
    from tandem.env import knob
    from tandem.trainer import Trainer, TrainerConfig

    step_options = {name: getattr(args, name) for name in step_option_names()}  # defaults are StepConfig's
    exchange = _exchange_options(args)
    try:  # a bad --mirror / --bulk-fwd, or --kvstore dist_async --update-on workers, is refused before anything
        TrainerConfig.from_options({**step_options, **exchange})  # starts (in every role), without a traceback
    except (TypeError, ValueError) as error:
        raise SystemExit(f"tandem train: {error}") from None
    from tandem.kvstore.kinds import SERVERLESS_KINDS

    if args.kvstore not in (None, "local", *SERVERLESS_KINDS):
        from tandem import kvstore

        if kvstore.is_server():  # a server of the job (tandem launch runs this command in every role)
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            if args.checkpoint_dir and not os.environ.get("TANDEM_PS_CHECKPOINT_DIR"):
                # fit's checkpoints put this server's file there: the one directory it may save into
                os.environ["TANDEM_PS_CHECKPOINT_DIR"] = os.path.abspath(args.checkpoint_dir)
            return kvstore.serve(args.kvstore)  # until the job ends
    torch.set_num_threads(args.threads or knob("TANDEM_NUM_THREADS") or max(1, (os.cpu_count() or 1)))
    torch.manual_seed(args.seed)
    overrides = dict(_split_pair(item, "--model-arg") for item in args.model_arg)
    config = _model_config(args.model, args.data, {k: _parse_value(v) for k, v in overrides.items()})
    entry = models.lookup(args.model)
    try:
        module = entry.build(**config)
    except ImportError as error:  # a library model whose library (the models extra) is not installed
        raise SystemExit(f"tandem train: {error}") from None
    for flag in ("max_train_samples", "max_eval_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"tandem train: --{flag.replace('_', '-')} must be >= 1")
    if args.checkpoint_every is not None and (args.checkpoint_dir is None or args.checkpoint_every < 1):
        raise SystemExit("tandem train: --checkpoint-every needs --checkpoint-dir and must be >= 1 (steps)")
    train_set, test_set = _datasets(args, config)
    train_set, test_set = _first(train_set, args.max_train_samples), _first(test_set, args.max_eval_samples)
    split = "validation" if args.data in TEXT_DATA else "test"
    workers = _job_workers(args.kvstore)
    if args.batch_size % workers:
        raise SystemExit(f"--batch-size {args.batch_size} is the global batch: it must divide by the {workers} workers")
    options: dict[str, Any] = {"batch_size": args.batch_size // workers, "seed": args.seed,
                               "progress": not args.no_progress}
    trainer = Trainer(module, entry.loss_fn, _optimizer(args), **options, **step_options, **exchange)
    rank = trainer.rank
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parameters = sum(p.numel() for p in module.parameters())
    where = f" on worker {rank} of {workers}" if workers > 1 else ""
    print(f"tandem: training {args.model} ({parameters / 1e6:.2f}M parameters) on {args.data} "
          f"({len(train_set)} train / {len(test_set)} {split} samples), global batch {args.batch_size}, "
          f"{args.epochs} epochs{where}")
    start = time.perf_counter()
    history = []
    while trainer.epoch < args.epochs:  # with --checkpoint-dir, the first fit may resume a few epochs in
        for record in trainer.fit(train_set, epochs=1, eval_data=test_set, checkpoint_dir=args.checkpoint_dir,
                                  checkpoint_every=args.checkpoint_every):  # fmt: skip
            record = _with_perplexity(record, args.data)
            history.append(record)
            accuracy = f", {split} accuracy {record['eval_accuracy']:.4f}" if "eval_accuracy" in record else ""
            perplexity = f", {split} perplexity {record['eval_perplexity']:.2f}" if "eval_perplexity" in record else ""
            print(f"epoch {int(record['epoch'])}: train loss {record['train_loss']:.4f}, "
                  f"{split} loss {record['eval_loss']:.4f}{accuracy}{perplexity}, "
                  f"{record['samples_per_s'] * workers:.0f} samples/s")
    elapsed = time.perf_counter() - start
    if not history:  # resumed from the checkpoint written at the very end: nothing was left to train
        print(f"tandem: nothing left to train: {args.checkpoint_dir} holds this run's last checkpoint "
              f"(epoch {trainer.epoch} of {args.epochs})")  # fmt: skip
        trainer.close()
        return 0
    if args.save:
        trainer.save(args.save)
        print(f"checkpoint written to {args.save}")
    final = history[-1]
    report = trainer.train_step.memory_report()
    trainer.close()
    suffix = f"-rank{rank}" if workers > 1 else ""
    (out / f"history{suffix}.json").write_text(json.dumps(history, indent=1))
    title = f"{args.model} on {args.data}" + (f", worker {rank}" if workers > 1 else "")
    plot = _plot_history(history, out / f"training{suffix}.png", title, split)
    accuracy = f"{split}_accuracy={final['eval_accuracy']:.4f} " if "eval_accuracy" in final else ""
    perplexity = f"{split}_perplexity={final['eval_perplexity']:.2f} " if "eval_perplexity" in final else ""
    print(f"tandem: done: model={args.model} data={args.data} epochs={args.epochs} {accuracy}{perplexity}"
          f"{split}_loss={final['eval_loss']:.4f} samples_per_s={final['samples_per_s'] * workers:.0f} "
          f"peak_activation_MB={report['peak_bytes'] / 2**20:.1f} time={elapsed:.1f}s")
    trace_path = os.environ.get("TANDEM_TRACE", "")
    print(f"tandem: outputs: history and plot {plot}"
          + (f", trace {trace_path.replace('{pid}', str(os.getpid()))} (open in ui.perfetto.dev)" if trace_path else ""))
    return 0


def _exchange_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer options of how gradients are exchanged (kvstore, communication, update location, ...)
    that ``tandem train``'s command line sets; unset ones are left to the Trainer's defaults."""
    names = ("kvstore", "clip_grad_norm", "communication", "gradient_compression")
    options = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.update_on is not None:
        options["update_on_kvstore"] = args.update_on == "servers"
    return options


def _plot_history(history: list[dict[str, float]], path: Path, title: str, split: str = "test") -> Path:
    """Loss per epoch (train and eval) on the left; on the right the eval accuracy, or on language-model
    data the train and eval perplexity (the first and last eval values written out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in history]
    figure, (loss_axis, right_axis) = plt.subplots(1, 2, figsize=(9, 3.5))
    loss_axis.plot(epochs, [r["train_loss"] for r in history], marker="o", label="train")
    loss_axis.plot(epochs, [r["eval_loss"] for r in history], marker="o", label=split)
    loss_axis.set(xlabel="epoch", ylabel="loss", title=title)
    loss_axis.legend()
    if all("eval_perplexity" in r for r in history):
        right_axis.plot(epochs, [r["train_perplexity"] for r in history], marker="o", label="train")
        right_axis.plot(epochs, [r["eval_perplexity"] for r in history], marker="o", label=split)
        for record in [history[0], history[-1]] if len(history) > 1 else history:  # first and last values
            right_axis.annotate(f"{record['eval_perplexity']:.2f}", (record["epoch"], record["eval_perplexity"]),
                                textcoords="offset points", xytext=(0, 6), ha="center", color="C1")
        right_axis.set(xlabel="epoch", ylabel="perplexity (exp loss)", title="perplexity (lower is better)")
        right_axis.legend()
    elif all("eval_accuracy" in r for r in history):
        right_axis.plot(epochs, [r["eval_accuracy"] for r in history], marker="o", color="C2")
        right_axis.set(xlabel="epoch", ylabel=f"{split} accuracy", ylim=(0, 1))
    for axis in (loss_axis, right_axis):
        axis.xaxis.get_major_locator().set_params(integer=True)  # whole epochs
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plan(args: argparse.Namespace) -> int:
    """`tandem plan`: build the model and one worker's batch as `tandem train` would, then tandem.planner."""
    from tandem.planner.command import run
    from tandem.step import StepConfig

    step_options = {name: getattr(args, name) for name in step_option_names()}
    try:  # a bad --mirror / --bulk-fwd is refused before anything is built
        StepConfig(**step_options)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"tandem plan: {error}") from None
    module, loss_fn, batch, config = _plan_model(args)
    return run(args, module, loss_fn, batch, config, step_options)


def _plan_model(args: argparse.Namespace) -> tuple[Any, Any, tuple[Any, ...], dict[str, Any]]:
    """The model, its loss, one worker's batch (a zoo model's make_batch on synthetic data, else the
    data set's first batch) and the model's config, from `tandem plan`'s options."""
    import torch

    from tandem import data, models

    if args.batch_size < 1:
        raise SystemExit(f"tandem plan: --batch-size must be >= 1 (per worker), got {args.batch_size}")
    dataset = args.data or next(name for name in ("synthetic-images", "synthetic-tokens", "pydoc-text", "digits")
                                if args.model in PRESETS[name])  # fmt: skip
    overrides = dict(_split_pair(item, "--model-arg") for item in args.model_arg)
    config = _model_config(args.model, dataset, {k: _parse_value(v) for k, v in overrides.items()})
    entry = models.lookup(args.model)
    torch.manual_seed(args.seed)
    try:
        module = entry.build(**config)
    except ImportError as error:  # a library model whose library (the models extra) is not installed
        raise SystemExit(f"tandem plan: {error}") from None
    if isinstance(entry, models.ZooEntry) and dataset.startswith("synthetic"):
        return module, entry.loss_fn, entry.make_batch(args.batch_size, torch.Generator().manual_seed(args.seed + 1),
                                                       **config), config  # fmt: skip
    from torch.utils.data import TensorDataset

    from tandem.graph.batch import as_arguments

    args.samples, args.data = max(args.batch_size, 64), dataset  # what _datasets reads
    train_set, _ = _datasets(args, config)
    make = data.batches if isinstance(train_set, TensorDataset) else data.loader  # as the Trainer batches it
    return module, entry.loss_fn, as_arguments(next(iter(make(train_set, args.batch_size)))), config


def _job_workers(kind: str | None) -> int:
    """Workers of the job this process belongs to: 1 alone; under `tandem launch` or torchrun the
    topology the launcher put in the environment (torchrun's WORLD_SIZE less the servers)."""
    from tandem.kvstore.kinds import SERVERLESS_KINDS

    if kind in (None, "local"):
        return 1
    if kind in SERVERLESS_KINDS:
        from tandem.kvstore.collective.group import Group

        return Group.from_env().size
    from tandem.kvstore.ps.topology import Topology

    return Topology.from_env().num_workers


def _models() -> tuple[str, ...]:
    from tandem.models import LIBRARY, ZOO

    return (*ZOO, *LIBRARY)


def _split_pair(item: str, flag: str) -> tuple[str, str]:
    if "=" not in item:
        raise SystemExit(f"{flag} takes KEY=VALUE, got {item!r}")
    key, value = item.split("=", 1)
    return key, value


def _mirror(text: str) -> str | float:
    try:
        return float(text)
    except ValueError:
        return text


def field_docs(cls: type) -> dict[str, str]:
    """Each field's text in ``cls``'s docstring's ``Attributes:`` section (Google style), one line each,
    with reST literals unquoted: the help of the options generated from the fields."""
    docs: dict[str, str] = {}
    name, inside = None, False
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        if not inside:
            inside = line.strip() == "Attributes:"
            continue
        if not line.strip() or not line.startswith("    "):
            break
        entry = re.match(r"^    (\w+)(?: \(.*?\))?: (.*)$", line)
        if entry is not None:
            name, docs[entry.group(1)] = entry.group(1), entry.group(2)
        elif name is not None:
            docs[name] += " " + line.strip()
    return {key: text.replace("``", "") for key, text in docs.items()}


def step_option_names() -> list[str]:
    """The StepConfig fields ``tandem train`` has an option for: every one a caller sets."""
    from tandem.step import StepConfig

    return [f.name for f in dataclasses.fields(StepConfig) if f.init]


def add_step_options(parser: argparse.ArgumentParser) -> None:
    """An option per ``StepConfig`` field (``--bulk-fwd`` for ``bulk_fwd``), generated from the dataclass:
    its default, its docstring text as help, ``choices`` from the field's metadata or a ``Literal``
    annotation; booleans get a ``--no-`` form too. A field that already has a hand-written option keeps
    that one. (tests/unit/test_cli_help.py checks every field is documented and has its option.)"""
    import types
    import typing

    from tandem.step import StepConfig

    docs, hints = field_docs(StepConfig), typing.get_type_hints(StepConfig)
    group = parser.add_argument_group("compile options", "tandem.StepConfig's fields (explicit values beat the "
                                      "TANDEM_* knobs; None takes the knob)")  # fmt: skip
    for f in dataclasses.fields(StepConfig):
        flag = "--" + f.name.replace("_", "-")
        if not f.init or flag in parser._option_string_actions:
            continue
        text = docs.get(f.name, f"StepConfig.{f.name}")
        option: dict[str, Any] = {"default": None if f.default is dataclasses.MISSING else f.default,
                                  "help": text.replace("%", "%%")}  # fmt: skip
        hint = hints[f.name]
        kinds = set(typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,))
        kinds.discard(type(None))
        literals = {kind for kind in kinds if typing.get_origin(kind) is typing.Literal}
        choices = f.metadata.get("choices") or [value for kind in literals for value in typing.get_args(kind)]
        kinds = (kinds - literals) | {type(value) for value in choices}
        if kinds == {bool}:
            option["action"] = argparse.BooleanOptionalAction
        elif kinds == {str, float}:
            option["type"] = _mirror
        elif len(kinds) == 1 and next(iter(kinds)) in (int, float, str):
            option["type"] = next(iter(kinds))
        if choices:
            option["choices"] = tuple(choices)
        group.add_argument(flag, **option).help = option["help"]  # BooleanOptionalAction (3.11) appends a default


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default; descriptions keep their line breaks."""


def build_parser() -> argparse.ArgumentParser:
    from tandem import launch
    from tandem.kvstore.kinds import KINDS
    from tandem.update import MODES

    parser = argparse.ArgumentParser(prog="tandem", description=__doc__, formatter_class=_HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{train,launch,plan}")
    p = commands.add_parser("train", help="train a model on a data set, with a progress bar",
                            description="Train a zoo or library model on a data set: progress bar, per-epoch "
                                        "evaluation, a plot and history.json in --out.", formatter_class=_HelpFormatter)
    p.add_argument("--model", default="resnet", choices=_models(),
                   help="a zoo model, or hf-gpt2 / hf-llama: transformers causal LMs (pip install -e .[models])")
    p.add_argument("--data", default="digits", choices=DATASETS,
                   help="images: digits, synthetic-images; tokens: synthetic-tokens; text: pydoc-text")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training data")
    p.add_argument("--batch-size", type=int, default=64, help="global batch (split over the workers)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw", "lamb"], help="the update rule (tandem.optim)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="weight decay of the optimizer")
    p.add_argument("--clip-grad-norm", type=float, default=None, help="clip the global gradient norm to this (off when unset)")
    p.add_argument("--kvstore", default=None, choices=KINDS,
                   help="local, or a distributed store under tandem launch / torchrun (unset: local)")
    p.add_argument("--communication", default="auto", choices=["auto", *MODES],
                   help="how gradients travel with a distributed kvstore (auto: p3 on the P3 kinds, else overlap)")
    p.add_argument("--gradient-compression", default=None, metavar="KIND[:THRESHOLD]",
                   help="compress pushed gradients with a distributed kvstore: 2bit (threshold 0.5), 2bit:0.1, "
                        "fp16, bf16, int8 or int4, with error feedback (off when unset)")
    p.add_argument("--update-on", default=None, choices=["servers", "workers"],
                   help="with a distributed kvstore: where the optimizer runs (unset: servers; the async kinds "
                        "refuse workers: their servers do not sum the workers' gradients)")
    p.add_argument("--out", default="runs/latest", help="directory for history.json and the training plot")
    p.add_argument("--samples", type=int, default=4096, help="size of synthetic data sets")
    p.add_argument("--max-train-samples", type=int, default=None, metavar="N",
                   help="train on the first N samples of the train split only (all when unset)")
    p.add_argument("--max-eval-samples", type=int, default=None, metavar="N",
                   help="evaluate on the first N samples of the test / validation split only (all when unset)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="model constructor overrides, repeatable")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights and the data order")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: TANDEM_NUM_THREADS, else all cores)")
    p.add_argument("--save", default=None, help="write a checkpoint here at the end (none when unset)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="write checkpoints into DIR/step-NNNNNN/ and, when DIR holds one, resume from the newest "
                   "(a restarted job: tandem launch --max-restarts; docs/distributed.md)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                   help="steps between checkpoints (unset: at the end of every epoch); needs --checkpoint-dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_step_options(p)
    p.set_defaults(handler=train)
    lp = commands.add_parser("launch", help="start servers and workers on this machine: tandem launch -n 2 -s 2 -- CMD",
                             description="Start a parameter-server job on this machine: every process runs CMD "
                                         "with its role in TANDEM_* variables.", formatter_class=_HelpFormatter)
    launch.add_arguments(lp)
    lp.set_defaults(handler=launch.run)
    pp = commands.add_parser("plan", help="predict samples/s on a cluster from one profiled step; pick mode and knobs",
                             description="Profile one step of a model (or read a saved profile), simulate training on "
                                         "--workers workers and --servers servers with --link links per mode (baseline, "
                                         "overlap, p3, allreduce; with and without compression) and recommend the mode, "
                                         "slice size, water mark and number of servers (docs/plan.md).",
                             formatter_class=_HelpFormatter)  # fmt: skip
    pp.add_argument("--model", default="resnet", choices=_models(), help="any model tandem train trains")
    pp.add_argument("--data", default=None, choices=DATASETS,
                    help="the data its batch looks like (unset: synthetic images or tokens; pydoc-text for hf-*)")
    pp.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    pp.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="model constructor overrides, repeatable")
    pp.add_argument("--seed", type=int, default=0, help="seed of the model's weights and the batch")
    from tandem.planner.command import add_arguments as add_plan_arguments

    add_plan_arguments(pp)
    add_step_options(pp)
    pp.set_defaults(handler=plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
