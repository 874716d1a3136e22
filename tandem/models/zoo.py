"""The registry of zoo models, so tests and tools can iterate over "every zoo model".

Each entry pairs a builder with its loss, a tiny config for fast tests and a ``make_batch`` that
produces a random batch of the right shapes for *any* config of that builder.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tandem.models.gpt import gpt
from tandem.models.library import LIBRARY, LibraryEntry
from tandem.models.losses import classification_loss, lm_loss
from tandem.models.lstm_lm import lstm_lm
from tandem.models.mlp import mlp
from tandem.models.resnet import resnet
from tandem.models.vgg import vgg

DIGITS_SIZE = 8  # the sklearn digits are 8x8 single-channel images
IMAGE_SIZE = 32  # default side of multi-channel images
LSTM_SEQ_LEN = 8  # default length of lstm_lm batches: short, as every step unrolls into the graph


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: how to build it, train it, and feed it.

    ``make_batch(batch_size, generator, dtype=torch.float32, **config)`` takes the same kwargs as
    ``build`` (builder defaults fill in what is missing) plus batch-only keys: ``image_size`` for
    image models and ``seq_len`` for language models. Floating inputs get ``dtype``; labels and
    tokens stay int64. It returns ``(x, y)`` for classifiers and ``(tokens, targets)`` for LMs,
    ready for ``loss_fn(module, *batch)``. ``has_dropout`` / ``has_batchnorm`` describe the
    instance built from ``tiny``.

    Example:
        ```python
        entry = tandem.models.ZOO["resnet"]           # a ZooEntry
        model = entry.build(**entry.tiny)
        x, y = entry.make_batch(16, torch.Generator().manual_seed(0), **entry.tiny)   # (16, 1, 8, 8), (16,)
        loss = entry.loss_fn(model, x, y)
        ```
    """

    name: str
    build: Callable[..., nn.Module]
    loss_fn: Callable[..., Tensor]
    tiny: dict[str, Any]
    make_batch: Callable[..., tuple[Tensor, ...]]
    has_dropout: bool
    has_batchnorm: bool


def _config(
    builder: Callable[..., nn.Module], config: dict[str, Any], batch_keys: dict[str, Any]
) -> dict[str, Any]:
    """Builder defaults, then batch-only defaults, then the caller's config; unknown keys are errors."""
    parameters = inspect.signature(builder).parameters
    unknown = set(config) - set(parameters) - set(batch_keys)
    if unknown:
        valid = sorted(set(parameters) | set(batch_keys))
        raise TypeError(
            f"make_batch for {builder.__name__}: unknown config keys {sorted(unknown)}; valid: {valid}"
        )
    defaults = {name: parameter.default for name, parameter in parameters.items()}
    return {**defaults, **batch_keys, **config}


def _labels(batch_size: int, num_classes: int, generator: torch.Generator) -> Tensor:
    return torch.randint(num_classes, (batch_size,), generator=generator)


def _mlp_batch(
    batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32, **config: Any
) -> tuple[Tensor, ...]:
    c = _config(mlp, config, {})
    x = torch.randn(batch_size, c["in_features"], generator=generator, dtype=dtype)
    return x, _labels(batch_size, c["num_classes"], generator)


def _image_batch(
    c: dict[str, Any], batch_size: int, generator: torch.Generator, dtype: torch.dtype
) -> tuple[Tensor, ...]:
    shape = (batch_size, c["in_channels"], c["image_size"], c["image_size"])
    return torch.randn(shape, generator=generator, dtype=dtype), _labels(
        batch_size, c["num_classes"], generator
    )


def _resnet_batch(
    batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32, **config: Any
) -> tuple[Tensor, ...]:
    # Single-channel ResNets are the digits models: 8x8 unless the caller says otherwise.
    default_side = DIGITS_SIZE if config.get("in_channels") == 1 else IMAGE_SIZE
    return _image_batch(_config(resnet, config, {"image_size": default_side}), batch_size, generator, dtype)


def _vgg_batch(
    batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32, **config: Any
) -> tuple[Tensor, ...]:
    return _image_batch(_config(vgg, config, {}), batch_size, generator, dtype)


def _token_batch(c: dict[str, Any], batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
    # One random stream, targets = tokens shifted by one, as in real LM training.
    stream = torch.randint(c["vocab_size"], (batch_size, c["seq_len"] + 1), generator=generator)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def _lstm_batch(
    batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32, **config: Any
) -> tuple[Tensor, ...]:
    return _token_batch(_config(lstm_lm, config, {"seq_len": LSTM_SEQ_LEN}), batch_size, generator)


def _gpt_batch(
    batch_size: int, generator: torch.Generator, dtype: torch.dtype = torch.float32, **config: Any
) -> tuple[Tensor, ...]:
    block_size = config.get("block_size", inspect.signature(gpt).parameters["block_size"].default)
    return _token_batch(_config(gpt, config, {"seq_len": block_size}), batch_size, generator)


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry(
            "mlp", mlp, classification_loss, {"in_features": 64, "hidden": (16, 16)}, _mlp_batch, False, False
        ),
        ZooEntry(
            "resnet",
            resnet,
            classification_loss,
            {"depth": 8, "width": 4, "in_channels": 1, "small_input": True},
            _resnet_batch,
            False,
            True,
        ),
        ZooEntry(
            "vgg",
            vgg,
            classification_loss,
            {"config": "vgg11", "width_multiplier": 1 / 16, "image_size": 32, "classifier_width": 32},
            _vgg_batch,
            False,
            False,
        ),
        ZooEntry(
            "lstm_lm",
            lstm_lm,
            lm_loss,
            {"vocab_size": 50, "embed_dim": 16, "hidden": 16, "num_layers": 2},
            _lstm_batch,
            False,
            False,
        ),
        ZooEntry(
            "gpt",
            gpt,
            lm_loss,
            {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16, "dropout": 0.1},
            _gpt_batch,
            True,
            False,
        ),
    )
}
"""Every zoo model by name (``mlp``, ``resnet``, ``vgg``, ``lstm_lm``, ``gpt``), each a ``ZooEntry``.

Example:
    ```python
    for name, entry in tandem.models.ZOO.items():
        model = entry.build(**entry.tiny)          # a tiny instance of each, for quick tests
    ```
"""


def lookup(name: str) -> ZooEntry | LibraryEntry:
    """The entry called ``name``: a ZOO model, or a LIBRARY one (``hf-gpt2``, ``hf-llama``).

    Both have ``build(**overrides)`` and ``loss_fn``; a ValueError lists the valid names.

    Example:
        ```python
        entry = tandem.models.lookup("gpt")
        model = entry.build(**entry.tiny)                # a few thousand parameters
        batch = entry.make_batch(4, torch.Generator().manual_seed(0), **entry.tiny)
        loss = entry.loss_fn(model, *batch)
        ```
    """
    entry = ZOO.get(name) or LIBRARY.get(name)
    if entry is None:
        raise ValueError(f"unknown zoo model {name!r}; valid names: {sorted(ZOO) + sorted(LIBRARY)}")
    return entry


def build(name: str, **overrides: Any) -> nn.Module:
    """``lookup(name).build(**overrides)``: the builder's defaults, except what ``overrides`` sets.

    A LIBRARY name builds that library model from its config class, ``overrides`` updating the config
    (an ImportError naming the ``models`` extra where the library is not installed).

    Example:
        ```python
        model = tandem.models.build("resnet", depth=8, width=16, in_channels=1, small_input=True)
        lm = tandem.models.build("hf-gpt2", n_embd=128)  # transformers' GPT2LMHeadModel (models extra)
        ```
    """
    return lookup(name).build(**overrides)
