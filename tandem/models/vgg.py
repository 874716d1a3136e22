"""VGG (Simonyan & Zisserman 2014): the communication-heavy zoo model.

Its fully connected classifier holds most of the parameters but little of the compute, so in
data-parallel training the gradient push of those layers, not the arithmetic, sets the pace.
"""

from __future__ import annotations

from torch import Tensor, nn

# Output channels per conv, "M" = 2x2 max-pool closing a stage.
CONFIGS: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}
NUM_POOLS = 5


def _stage(channels_in: int, widths: list[int], batch_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in widths:
        # No conv bias under BatchNorm: BN's shift makes it redundant.
        layers.append(nn.Conv2d(channels_in, width, 3, padding=1, bias=not batch_norm))
        layers += [nn.BatchNorm2d(width), nn.ReLU()] if batch_norm else [nn.ReLU()]
        channels_in = width
    layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def _split_stages(config: list[int | str], width_multiplier: float) -> list[list[int]]:
    stages: list[list[int]] = [[]]
    for item in config:
        if item == "M":
            stages.append([])
        else:
            stages[-1].append(max(1, round(int(item) * width_multiplier)))
    return stages[:-1]


class VGG(nn.Module):
    """Conv stages (each ends in a max-pool) -> flatten -> Linear-ReLU-Linear-ReLU-Linear.

    Example:
        ```python
        model = tandem.models.vgg("vgg11", width_multiplier=1 / 16, classifier_width=32)   # a VGG
        model(torch.randn(2, 3, 32, 32)).shape        # (2, 10)
        ```
    """

    def __init__(
        self,
        config: str,
        num_classes: int,
        in_channels: int,
        width_multiplier: float,
        image_size: int,
        classifier_width: int,
        batch_norm: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        if config not in CONFIGS:
            raise ValueError(f"vgg: config={config!r} is unknown; choose one of {sorted(CONFIGS)}")
        if image_size < 2**NUM_POOLS or image_size % 2**NUM_POOLS:
            raise ValueError(
                f"vgg: image_size={image_size} must be a positive multiple of {2**NUM_POOLS} "
                f"(the net halves it {NUM_POOLS} times); e.g. 32"
            )
        if width_multiplier <= 0 or classifier_width < 1 or num_classes < 1 or in_channels < 1:
            raise ValueError(
                f"vgg: width_multiplier={width_multiplier}, classifier_width={classifier_width}, "
                f"num_classes={num_classes}, in_channels={in_channels} must be positive"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"vgg: dropout={dropout} must lie in [0, 1)")
        stages = []
        channels_in = in_channels
        for widths in _split_stages(CONFIGS[config], width_multiplier):
            stages.append(_stage(channels_in, widths, batch_norm))
            channels_in = widths[-1]
        self.stages = nn.Sequential(*stages)
        side = image_size // 2**NUM_POOLS
        extra: list[nn.Module] = [nn.Dropout(dropout)] if dropout > 0 else []
        self.classifier = nn.Sequential(
            nn.Linear(channels_in * side * side, classifier_width),
            nn.ReLU(),
            *extra,
            nn.Linear(classifier_width, classifier_width),
            nn.ReLU(),
            *extra,
            nn.Linear(classifier_width, num_classes),
        )

    @property
    def blocks(self) -> list[nn.Module]:
        """The conv stages in forward order (each ends with its max-pool).

        Example:
            ```python
            len(tandem.models.vgg("vgg11").blocks)   # 5
            ```
        """
        return list(self.stages)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.stages(x).flatten(1))


def vgg(
    config: str = "vgg11",
    num_classes: int = 10,
    in_channels: int = 3,
    width_multiplier: float = 1.0,
    image_size: int = 32,
    classifier_width: int = 4096,
    batch_norm: bool = False,
    dropout: float = 0.0,
) -> VGG:
    """VGG-11/16 for ``image_size`` square inputs; ``dropout`` (0.5 in the paper) is off by default.

    Example:
        ```python
        model = tandem.models.vgg("vgg11", width_multiplier=0.25, classifier_width=512)   # 32x32 RGB images
        ```
    """
    return VGG(
        config, num_classes, in_channels, width_multiplier, image_size, classifier_width, batch_norm, dropout
    )
