"""Library models: real transformers classes, built from their config classes (nothing downloaded).

The zoo (``tandem.models.ZOO``) holds models written here; ``LIBRARY`` holds models of an installed
library, trained as they are, with their own loss: ``hf-gpt2`` (``GPT2LMHeadModel``) and
``hf-llama`` (``LlamaForCausalLM``), tiny byte-level causal LMs (vocabulary 256, 2 layers) for
``tandem.data.pydoc_text``. Batches are dicts ``{"input_ids", "attention_mask", "labels"}`` and the
loss is ``model_loss``: ``module(**batch).loss``.

transformers is the optional ``models`` extra (``pip install -e .[models]``): it is imported only
when an entry is built, and a missing install is an ImportError that says so.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

INSTALL_HINT = "pip install -e .[models]"


def model_loss(module: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The model's own loss on a dict batch with labels: ``module(**batch).loss`` (transformers).

    Example:
        ```python
        trainer = tandem.Trainer(tandem.models.build("hf-gpt2"), tandem.models.model_loss,
                                 tandem.optim.AdamW(lr=3e-3), batch_size=32)
        trainer.fit(tandem.data.pydoc_text("train"), epochs=1)
        ```
    """
    loss: Tensor = module(**batch).loss
    return loss


@dataclass(frozen=True)
class LibraryEntry:
    """A model class of an installed library, built from its config class with ``config`` (overridable).

    ``build(**overrides)`` returns ``library.<model_class>(library.<config_class>(**config, **overrides))``
    with the library's own initialization (seed torch first for reproducible weights); ``loss_fn``
    is what ``Trainer`` / ``tandem.compile`` take; ``loss_type`` names the library's loss function
    where the class name does not (transformers picks it by class name and warns when it guesses).

    Example:
        ```python
        entry = tandem.models.LIBRARY["hf-gpt2"]       # a LibraryEntry
        model = entry.build(n_layer=4)                # GPT2LMHeadModel(GPT2Config(**entry.config, n_layer=4))
        loss = entry.loss_fn(model, {"input_ids": tokens, "labels": tokens})
        ```
    """

    name: str
    library: str  # the package the class comes from ("transformers")
    model_class: str
    config_class: str
    config: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[..., Tensor] = model_loss
    loss_type: str | None = None

    def build(self, **overrides: Any) -> nn.Module:
        library = import_library(self.library, self.name)
        config = getattr(library, self.config_class)(**{**self.config, **overrides})
        model: nn.Module = getattr(library, self.model_class)(config)
        if self.loss_type is not None:
            model.loss_type = self.loss_type  # type: ignore[assignment]  # a plain attribute of the model
        return model


def import_library(library: str, wanted_by: str = "") -> Any:
    """Import ``library`` (torchvision made importable first: transformers imports it), or an
    ImportError naming the extra that installs it."""
    if importlib.util.find_spec(library) is None:
        who = f"model {wanted_by!r} needs" if wanted_by else "this needs"
        raise ImportError(f"{who} {library}, which is not installed: {INSTALL_HINT}")
    from tandem.testing.torchvision_compat import ensure_importable

    ensure_importable()
    return importlib.import_module(library)


BLOCK_SIZE = 64  # positions of the tiny LMs: the length of pydoc_text's default blocks
_NO_TOKENS = {"bos_token_id": 0, "eos_token_id": 0}  # byte 0 never occurs in text

LIBRARY: dict[str, LibraryEntry] = {
    entry.name: entry
    for entry in (
        LibraryEntry(
            "hf-gpt2", "transformers", "GPT2LMHeadModel", "GPT2Config",
            {"vocab_size": 256, "n_positions": BLOCK_SIZE, "n_embd": 64, "n_layer": 2, "n_head": 4,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **_NO_TOKENS},
            loss_type="ForCausalLM",
        ),
        LibraryEntry(
            "hf-llama", "transformers", "LlamaForCausalLM", "LlamaConfig",
            {"vocab_size": 256, "max_position_embeddings": BLOCK_SIZE, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "attention_dropout": 0.0, "tie_word_embeddings": True,
             "pad_token_id": None, **_NO_TOKENS},
        ),
    )
}  # fmt: skip
"""The library models by name (``hf-gpt2``, ``hf-llama``), each a ``LibraryEntry`` (the ``models`` extra).

Example:
    ```python
    sorted(tandem.models.LIBRARY)                  # ["hf-gpt2", "hf-llama"]
    model = tandem.models.LIBRARY["hf-llama"].build()   # transformers' LlamaForCausalLM
    ```
"""


def positions(config: dict[str, Any]) -> int | None:
    """The longest sequence a library LM config takes (``n_positions`` / ``max_position_embeddings``)."""
    value = config.get("n_positions", config.get("max_position_embeddings"))
    return int(value) if value is not None else None
