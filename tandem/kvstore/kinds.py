"""The kinds of kvstore, and what ``tandem launch --p3`` makes of them (the store's, its P3 side's and
the updates' one table)."""

from __future__ import annotations

from tandem.env import knob

KINDS = ("local", "dist_sync", "dist_async", "dist_p3", "dist_p3_async")
DISTRIBUTED_KINDS = KINDS[1:]
P3_FOR = {"dist_sync": "dist_p3", "dist_async": "dist_p3_async"}  # what TANDEM_KVSTORE_P3=1 (launch --p3) makes of a kind


def resolve_kind(kind: str) -> str:
    """The kind ``create(kind)`` makes: under TANDEM_KVSTORE_P3=1 (``tandem launch --p3``) the
    parameter-server kinds become their P3 kinds."""
    return P3_FOR[kind] if kind in P3_FOR and knob("TANDEM_KVSTORE_P3") else kind
