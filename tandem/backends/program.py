"""What the executor hands a backend: a segment's instructions in slot form."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass
class Instruction:
    slot: int
    node: fx.Node
    frees: list[int]  # slots whose last use is this instruction
