"""The model zoo: small, readable, capture-friendly models that tandem trains and benchmarks.

Every model is traceable by ``aot_export_module(..., trace_joint=True)``: no data-dependent Python
control flow, no ``.item()``, plain ``nn.Parameter``s, and each exposes ``.blocks`` (its repeated
units in forward order) for per-block checkpointing and mirroring experiments.

``LIBRARY`` adds models of an installed library trained as they are (``hf-gpt2``, ``hf-llama``:
transformers causal LMs built from their config classes, the optional ``models`` extra).
"""

from __future__ import annotations

from tandem.models.gpt import GPT, gpt
from tandem.models.library import LIBRARY, LibraryEntry, model_loss
from tandem.models.losses import classification_loss, lm_loss
from tandem.models.lstm_lm import LSTMLanguageModel, lstm_lm
from tandem.models.mlp import MLP, mlp
from tandem.models.resnet import ResNet, resnet
from tandem.models.vgg import VGG, vgg
from tandem.models.zoo import ZOO, ZooEntry, build, lookup

__all__ = [
    "GPT",
    "LIBRARY",
    "MLP",
    "VGG",
    "ZOO",
    "LSTMLanguageModel",
    "LibraryEntry",
    "ResNet",
    "ZooEntry",
    "build",
    "classification_loss",
    "gpt",
    "lm_loss",
    "lookup",
    "lstm_lm",
    "mlp",
    "model_loss",
    "resnet",
    "vgg",
]
