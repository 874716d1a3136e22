"""The model zoo: small, readable, capture-friendly models that tandem trains and benchmarks.

Every model is traceable by ``aot_export_module(..., trace_joint=True)``: no data-dependent Python
control flow, no ``.item()``, plain ``nn.Parameter``s, and each exposes ``.blocks`` (its repeated
units in forward order) for per-block checkpointing and mirroring experiments.
"""

from __future__ import annotations

from tandem.models.gpt import GPT, gpt
from tandem.models.losses import classification_loss, lm_loss
from tandem.models.lstm_lm import LSTMLanguageModel, lstm_lm
from tandem.models.mlp import MLP, mlp
from tandem.models.resnet import ResNet, resnet
from tandem.models.vgg import VGG, vgg
from tandem.models.zoo import ZOO, ZooEntry, build

__all__ = [
    "GPT",
    "MLP",
    "VGG",
    "ZOO",
    "LSTMLanguageModel",
    "ResNet",
    "ZooEntry",
    "build",
    "classification_loss",
    "gpt",
    "lm_loss",
    "lstm_lm",
    "mlp",
    "resnet",
    "vgg",
]
