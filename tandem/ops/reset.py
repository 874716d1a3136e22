"""``reset_arrays``: zero many tensors in one call (MXNet's ``reset_arrays`` operator).

A Python loop of ``t.zero_()`` pays the dispatcher and interpreter once per tensor; one
``torch._foreach_zero_`` per (device, dtype) pays it once per group. MXNet measured 0.84 s for
500 x 10 per-array ops against 0.016 s for one fused operator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.ops.tensor_lists import as_tensor_list, first_non_tensor_error, group_by_device_and_dtype


@torch.no_grad()
def reset_arrays(tensors: Sequence[Tensor]) -> None:
    """Zero every tensor in place: one ``torch._foreach_zero_`` per (device, dtype) group.

    Synchronous; not thread safe against concurrent writers of the same tensors (the engine
    serialises them by declaring all tensors as writes). Runs under ``no_grad`` so parameters can be
    zeroed too. An empty list is a no-op.

    A list whose first tensor is on CPU goes to torch in one call, ungrouped: CPU foreach kernels
    loop per tensor in C++ whatever the (device, dtype) mix, so grouping buys nothing there, while
    reading each tensor's device and dtype from Python costs about 10% of zeroing 500 small tensors.
    Any accelerator tensors in such a list are still zeroed correctly (torch's per-tensor route).
    """
    tensor_list = as_tensor_list("reset_arrays", "tensors", tensors)
    if not tensor_list:
        return
    first = tensor_list[0]
    if isinstance(first, Tensor) and first.is_cpu:
        try:
            torch._foreach_zero_(tensor_list)
        except TypeError as error:
            raise first_non_tensor_error("reset_arrays", "tensors", tensor_list) or error from None
        return
    for group in group_by_device_and_dtype("reset_arrays", {"tensors": tensor_list}).values():
        torch._foreach_zero_(group.columns[0])
