"""ResNet with BasicBlocks and BatchNorm (He et al. 2016), in the sizes tandem benchmarks.

``small_input`` swaps the ImageNet stem (7x7 stride-2 conv + max-pool) for one 3x3 conv, so 8x8
digits and 32x32 images keep enough resolution to reach the last stage.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

# depth -> residual blocks per stage; depth 8 is the 3-stage CIFAR-style net for tiny inputs.
STAGES: dict[int, tuple[int, ...]] = {8: (1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


def _conv_bn(channels_in: int, channels_out: int, kernel_size: int, stride: int) -> list[nn.Module]:
    conv = nn.Conv2d(channels_in, channels_out, kernel_size, stride, padding=kernel_size // 2, bias=False)
    return [conv, nn.BatchNorm2d(channels_out)]


class BasicBlock(nn.Module):
    """relu(bn(conv(relu(bn(conv(x))))) + shortcut(x)); the shortcut projects when the shape changes."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            *_conv_bn(channels_in, channels_out, 3, stride),
            nn.ReLU(),
            *_conv_bn(channels_out, channels_out, 3, 1),
        )
        reshapes = stride != 1 or channels_in != channels_out
        self.shortcut = (
            nn.Sequential(*_conv_bn(channels_in, channels_out, 1, stride)) if reshapes else nn.Identity()
        )
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        # Out-of-place add: nothing for functionalization to rewrite.
        return self.relu(self.residual(x) + self.shortcut(x))


class ResNet(nn.Module):
    """stem -> stages of BasicBlocks (width doubles, resolution halves per stage) -> mean pool -> Linear.

    Example:
        ```python
        model = tandem.models.resnet(depth=8, width=16, in_channels=1, small_input=True)   # a ResNet
        model(torch.randn(2, 1, 8, 8)).shape          # (2, 10)
        ```
    """

    def __init__(self, depth: int, width: int, num_classes: int, in_channels: int, small_input: bool) -> None:
        super().__init__()
        if depth not in STAGES:
            raise ValueError(f"resnet: depth={depth} is not supported; choose one of {sorted(STAGES)}")
        if width < 1 or num_classes < 1 or in_channels < 1:
            raise ValueError(
                f"resnet: width={width}, num_classes={num_classes}, in_channels={in_channels} must be positive"
            )
        if small_input:
            self.stem = nn.Sequential(*_conv_bn(in_channels, width, 3, 1), nn.ReLU())
        else:
            self.stem = nn.Sequential(
                *_conv_bn(in_channels, width, 7, 2), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)
            )
        stages: list[nn.Module] = []
        channels_in = width
        for index, num_blocks in enumerate(STAGES[depth]):
            channels_out = width * 2**index
            strides = [1 if index == 0 else 2] + [1] * (num_blocks - 1)
            stage_blocks = []
            for stride in strides:
                stage_blocks.append(BasicBlock(channels_in, channels_out, stride))
                channels_in = channels_out
            stages.append(nn.Sequential(*stage_blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels_in, num_classes)

    @property
    def blocks(self) -> list[nn.Module]:
        """Every residual block in forward order (the unit for per-block checkpointing).

        Example:
            ```python
            len(tandem.models.resnet(depth=18).blocks)   # 8 BasicBlocks
            ```
        """
        return [block for stage in self.stages for block in cast(nn.Sequential, stage)]

    def forward(self, x: Tensor) -> Tensor:
        features = self.stages(self.stem(x))
        # A plain mean over H, W instead of adaptive pooling keeps the captured graph simple.
        return self.head(torch.mean(features, dim=(2, 3)))


def resnet(
    depth: int = 18, width: int = 64, num_classes: int = 10, in_channels: int = 3, small_input: bool = False
) -> ResNet:
    """ResNet-8/18/34 with BatchNorm; ``small_input=True`` for 8x8 and 32x32 images.

    Example:
        ```python
        model = tandem.models.resnet(depth=8, width=16, in_channels=1, small_input=True)   # digits, 77,754 parameters
        ```
    """
    return ResNet(depth, width, num_classes, in_channels, small_input)
