"""``python -m tandem.models``: print the parameter counts of the documented configs as markdown."""

from __future__ import annotations

from torch import nn

from tandem.models.gpt import gpt
from tandem.models.lstm_lm import lstm_lm
from tandem.models.mlp import mlp
from tandem.models.resnet import resnet
from tandem.models.vgg import vgg

CONFIGS: dict[str, nn.Module] = {
    "mlp()": mlp(),
    "mlp(hidden=(32,)*20)": mlp(hidden=(32,) * 20),
    "resnet(depth=8, width=16, in_channels=1, small_input=True)": resnet(8, 16, in_channels=1, small_input=True),
    "resnet(depth=18)": resnet(18),
    "resnet(depth=34)": resnet(34),
    'vgg("vgg11")': vgg("vgg11"),
    'vgg("vgg16")': vgg("vgg16"),
    "lstm_lm()": lstm_lm(),
    "gpt()": gpt(),
}

if __name__ == "__main__":
    print("| config | parameters |\n|---|---|")
    for name, model in CONFIGS.items():
        print(f"| `{name}` | {sum(p.numel() for p in model.parameters()):,} |")
