"""Validation and (device, dtype) grouping of index-aligned tensor lists.

Every fused op takes parallel lists (params[i], grads[i], exp_avgs[i], ...). Torch's ``_foreach_*``
kernels only take their fused route when a list shares one device and dtype, so each op splits the
lists by the primary list's (device, dtype) and makes one foreach call per group. Checking and
grouping happen in a single pass so the checks cost one loop, not one per list.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

GroupKey = tuple[torch.device, torch.dtype]


@dataclass
class Group:
    """Entries of one (device, dtype): ``columns[k]`` holds the k-th named list's tensors."""

    columns: list[list[Any]]
    indices: list[int] = field(default_factory=list)


def as_tensor_list(op: str, name: str, tensors: Sequence[Any]) -> list[Any]:
    """``tensors`` as a list; rejects a bare tensor, which would iterate over its rows."""
    if isinstance(tensors, Tensor):
        raise TypeError(f"{op}: {name} must be a list of tensors, not a single tensor; wrap it: [{name}]")
    if isinstance(tensors, list):
        return tensors
    try:
        return list(tensors)
    except TypeError:
        raise TypeError(
            f"{op}: {name} must be a list of tensors, got {type(tensors).__name__}"
        ) from None


def not_a_tensor(op: str, name: str, index: int, item: object) -> TypeError:
    return TypeError(f"{op}: {name}[{index}] is a {type(item).__name__}, expected a torch.Tensor")


def first_non_tensor_error(op: str, name: str, tensors: Sequence[Any]) -> TypeError | None:
    """The error for the first entry that is not a tensor, or None when all are tensors."""
    for index, item in enumerate(tensors):
        if not isinstance(item, Tensor):
            return not_a_tensor(op, name, index, item)
    return None


def check_lengths(op: str, named_lists: Mapping[str, Sequence[Any]]) -> None:
    names = list(named_lists)
    expected = len(named_lists[names[0]])
    for name in names[1:]:
        if len(named_lists[name]) != expected:
            raise ValueError(
                f"{op}: {name} has {len(named_lists[name])} entries but {names[0]} has {expected}; "
                "the lists must be aligned by index, one entry per parameter"
            )


def _check_partner(op: str, names: tuple[str, str], index: int, head: Tensor, item: Any) -> None:
    """``item`` must be a tensor shaped like ``head`` on its device with its dtype."""
    primary, name = names
    if not isinstance(item, Tensor):
        raise not_a_tensor(op, name, index, item)
    if item.device != head.device:
        raise ValueError(
            f"{op}: {name}[{index}] is on {item.device} but {primary}[{index}] is on {head.device}; "
            "move them to one device"
        )
    if item.dtype != head.dtype:
        raise TypeError(
            f"{op}: {name}[{index}] has dtype {item.dtype} but {primary}[{index}] has {head.dtype}; "
            "cast one so they match"
        )
    if item.shape != head.shape:
        raise ValueError(
            f"{op}: {name}[{index}] has shape {tuple(item.shape)} but {primary}[{index}] has "
            f"{tuple(head.shape)}; they must match"
        )


def _check_counter(op: str, names: tuple[str, str], index: int, head: Tensor, item: Any) -> None:
    """Step counters are 0-dim floating tensors on CPU (torch's default) or on the primary's device."""
    primary, name = names
    if not isinstance(item, Tensor):
        raise not_a_tensor(op, name, index, item)
    if item.dim() != 0 or not item.is_floating_point():
        raise ValueError(
            f"{op}: {name}[{index}] must be a 0-dim floating tensor (a step count), "
            f"got shape {tuple(item.shape)} dtype {item.dtype}"
        )
    if not item.is_cpu and item.device != head.device:
        raise ValueError(
            f"{op}: {name}[{index}] is on {item.device}; keep it on cpu or on {primary}[{index}]'s "
            f"device {head.device}"
        )


def group_by_device_and_dtype(
    op: str,
    named_lists: Mapping[str, Sequence[Any]],
    *,
    counters: Collection[str] = (),
    nullable: Collection[str] = (),
) -> dict[GroupKey, Group]:
    """Check the lists and split them by the first list's (device, dtype), keeping index order.

    Entries of the other lists must match the first list's entry in device, dtype and shape, except
    lists named in ``counters`` (0-dim step tensors) and None entries of lists named in ``nullable``.
    Raises TypeError/ValueError naming the list and index of the first bad entry.
    """
    check_lengths(op, named_lists)
    names = list(named_lists)
    primary = names[0]
    checks = [
        (name, _check_counter if name in counters else _check_partner, name in nullable) for name in names[1:]
    ]
    groups: dict[GroupKey, Group] = {}
    for index, row in enumerate(zip(*named_lists.values())):
        head = row[0]
        if not isinstance(head, Tensor):
            raise not_a_tensor(op, primary, index, head)
        for (name, check, may_be_none), item in zip(checks, row[1:]):
            if not (may_be_none and item is None):
                check(op, (primary, name), index, head, item)
        key = (head.device, head.dtype)
        group = groups.get(key)
        if group is None:
            group = groups[key] = Group([[] for _ in names])
        for column, item in zip(group.columns, row):
            column.append(item)
        group.indices.append(index)
    return groups
