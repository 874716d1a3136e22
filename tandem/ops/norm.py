"""Global gradient norm and clipping over many tensors without a host sync per tensor.

MXNet's ``multi_sum_sq`` and torch's ``clip_grad_norm_(foreach=True)``: one ``_foreach_norm`` per
(device, dtype) group, the per-tensor norms stacked on one device, one reduction. Nothing calls
``.item()``, so on an accelerator the result stays a device tensor until the caller reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.ops.scalars import check_number
from tandem.ops.tensor_lists import Group, GroupKey, as_tensor_list, group_by_device_and_dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (float32, bfloat16, float16) accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped_norms(op: str, tensors: Sequence[Tensor]) -> tuple[Tensor, dict[GroupKey, Group]] | None:
    """The L2 norm of each tensor (in group order) stacked on the first tensor's device, and the groups.

    None for an empty list. The norms are float64 when any tensor is float64, else float32.
    """
    tensor_list = as_tensor_list(op, "tensors", tensors)
    if not tensor_list:
        return None
    groups = group_by_device_and_dtype(op, {"tensors": tensor_list})
    result_dtype = torch.float64 if any(dtype == torch.float64 for _, dtype in groups) else torch.float32
    target = tensor_list[0].device
    norms: list[Tensor] = []
    for (_, dtype), group in groups.items():
        if not dtype.is_floating_point:
            index = group.indices[0]
            raise TypeError(f"{op}: tensors[{index}] has dtype {dtype}; norms need floating point tensors")
        group_norms = torch._foreach_norm(group.columns[0], 2, dtype=accumulation_dtype(dtype))
        norms.append(torch.stack(group_norms).to(device=target, dtype=result_dtype))
    return (norms[0] if len(norms) == 1 else torch.cat(norms)), groups


@torch.no_grad()
def multi_sum_sq(tensors: Sequence[Tensor]) -> Tensor:
    """Sum of squares of all elements of all tensors, as a 0-dim tensor on the first tensor's device.

    float64 when any input is float64, else float32 (bfloat16/float16 accumulate in float32).
    ``multi_sum_sq([])`` is ``tensor(0.)``. Synchronous on CPU; asynchronous on accelerators.
    """
    found = grouped_norms("multi_sum_sq", tensors)
    return torch.tensor(0.0) if found is None else found[0].square().sum()


@torch.no_grad()
def global_norm(tensors: Sequence[Tensor]) -> Tensor:
    """L2 norm of all tensors taken as one vector (sqrt of ``multi_sum_sq``), same dtype and device."""
    found = grouped_norms("global_norm", tensors)
    # The norm of the per-tensor norms, as torch.nn.utils.clip_grad_norm_ computes it.
    return torch.tensor(0.0) if found is None else torch.linalg.vector_norm(found[0])


@torch.no_grad()
def clip_global_norm(tensors: Sequence[Tensor], max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale all tensors in place by ``min(1, max_norm / (norm + eps))``; return the norm before clipping.

    Same result as ``torch.nn.utils.clip_grad_norm_(tensors, max_norm, foreach=True)`` for float32
    and float64 tensors; no host sync (the scale factor stays a tensor). Synchronous on CPU; not
    thread safe against concurrent writers of the tensors.
    """
    check_number("clip_global_norm", "max_norm", max_norm, lambda value: value > 0, "> 0")
    check_number("clip_global_norm", "eps", eps, lambda value: value >= 0, ">= 0")
    found = grouped_norms("clip_global_norm", tensors)
    if found is None:
        return torch.tensor(0.0)
    norms, groups = found
    total = torch.linalg.vector_norm(norms)
    scale = torch.clamp(max_norm / (total + eps), max=1.0)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group.columns[0], scale.to(device))
    return total
