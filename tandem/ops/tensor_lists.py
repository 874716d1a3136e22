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


def _partner_error(op: str, names: tuple[str, str], index: int, head: Tensor, item: Any) -> Exception:
    """Why ``item`` does not match ``head`` (its primary): type, device, dtype or shape."""
    primary, name = names
    if not isinstance(item, Tensor):
        return not_a_tensor(op, name, index, item)
    if item.device != head.device:
        return ValueError(
            f"{op}: {name}[{index}] is on {item.device} but {primary}[{index}] is on {head.device}; "
            "move them to one device"
        )
    if item.dtype != head.dtype:
        return TypeError(
            f"{op}: {name}[{index}] has dtype {item.dtype} but {primary}[{index}] has {head.dtype}; "
            "cast one so they match"
        )
    return ValueError(
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


def _check_partners(op: str, names: list[str], index: int, row: tuple[Any, ...], key: GroupKey,
                    counters: Collection[str], nullable: Collection[str]) -> None:
    """Raise unless every entry after the first (the primary, ``row[0]``) fits it."""
    head = row[0]
    device, dtype = key
    shape = head.shape
    for name, item in zip(names[1:], row[1:]):
        if name in counters:
            _check_counter(op, (names[0], name), index, head, item)
        elif not (
            isinstance(item, Tensor) and item.dtype == dtype and item.device == device and item.shape == shape
        ) and not (item is None and name in nullable):
            raise _partner_error(op, (names[0], name), index, head, item)


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
    columns = [list(named_lists[name]) for name in names]
    indices_by_key: dict[GroupKey, list[int]] = {}
    for index, row in enumerate(zip(*columns)):
        head = row[0]
        if not isinstance(head, Tensor):
            raise not_a_tensor(op, names[0], index, head)
        key = (head.device, head.dtype)
        if len(row) > 1:
            _check_partners(op, names, index, row, key, counters, nullable)
        indices = indices_by_key.get(key)
        if indices is None:
            indices = indices_by_key[key] = []
        indices.append(index)
    if len(indices_by_key) == 1:  # the common case: the caller's lists are the group, no copying
        ((key, indices),) = indices_by_key.items()
        return {key: Group(columns, indices)}
    return {
        key: Group([[column[index] for index in indices] for column in columns], indices)
        for key, indices in indices_by_key.items()
    }
