"""The aten backend: a segment as straight-line Python over aten calls (exact: the ops eager runs).

    def segment_3(v):
        v[7] = aten_add(v[3], v[5])  # add_2
        v[3] = None                  # add_2 was add_1's last use: its memory is freed here
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from tandem.backends.program import Instruction


def _direct_callable(target: Any) -> Any:
    """An aten OpOverload's C++ entry point: calling it skips one Python frame (~0.3 us) per node."""
    return getattr(target, "_op", target) if isinstance(target, torch._ops.OpOverload) else target


def generate(index: int, instructions: Sequence[Instruction], slot_of: dict[fx.Node, int]) -> Callable[[list[Any]], None]:
    """Straight-line Python for one segment: ``v[7] = aten_add(v[3], v[5]); v[3] = None``."""
    constants: dict[str, Any] = {}

    def constant(value: Any) -> str:
        name = f"c{len(constants)}"
        constants[name] = value
        return name

    def render(arg: Any) -> str:
        if isinstance(arg, fx.Node):
            return f"v[{slot_of[arg]}]"
        if isinstance(arg, list):
            return "[" + ", ".join(render(a) for a in arg) + "]"
        if isinstance(arg, tuple):
            return "(" + "".join(render(a) + ", " for a in arg) + ")"
        if isinstance(arg, bool | int | str) or arg is None:
            return repr(arg)
        if isinstance(arg, float) and math.isfinite(arg):
            return repr(arg)
        return constant(arg)

    lines = [f"def segment_{index}(v):"]
    for instruction in instructions:
        node = instruction.node
        args = [render(a) for a in node.args] + [f"{k}={render(a)}" for k, a in node.kwargs.items()]
        if node.target is operator.getitem:
            call = f"{args[0]}[{args[1]}]"
        else:
            call = f"{constant(_direct_callable(node.target))}({', '.join(args)})"
        lines.append(f"    v[{instruction.slot}] = {call}  # {node.name}")
        lines.extend(f"    v[{slot}] = None" for slot in instruction.frees)
    lines.append("    return None")
    source = "\n".join(lines)
    namespace: dict[str, Any] = dict(constants)
    exec(compile(source, f"<tandem segment {index}>", "exec"), namespace)  # noqa: S102
    function = namespace[f"segment_{index}"]
    function.__tandem_source__ = source
    return function
