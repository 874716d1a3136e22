"""The kinds of kvstore, and what ``tandem launch --p3`` makes of them (the store's, its P3 side's and
the updates' one table)."""

from __future__ import annotations

from tandem.env import knob

KINDS = ("local", "dist_sync", "dist_async", "dist_p3", "dist_p3_async", "collective")
"""Every kind ``create`` makes: ``local`` (one process), the parameter-server kinds, and ``collective``
(all-reduce between the workers over ``torch.distributed``, sliced and sent by priority; no servers).

Example:
    ```python
    "dist_p3" in tandem.kvstore.KINDS                     # True
    trainer = tandem.Trainer(model, loss_fn, opt, kvstore="dist_p3")   # under tandem launch
    ```
"""
DISTRIBUTED_KINDS = KINDS[1:]
SERVERLESS_KINDS = ("collective",)  # distributed kinds whose jobs have workers only (tandem launch -s 0)
P3_FOR = {"dist_sync": "dist_p3", "dist_async": "dist_p3_async"}  # what TANDEM_KVSTORE_P3=1 (launch --p3) makes of a kind
"""The P3 kind each parameter-server kind becomes under ``TANDEM_KVSTORE_P3=1`` (``tandem launch --p3``).

Example:
    ```python
    tandem.kvstore.P3_FOR["dist_sync"]                    # "dist_p3"
    ```
"""


def resolve_kind(kind: str) -> str:
    """The kind ``create(kind)`` makes: under TANDEM_KVSTORE_P3=1 (``tandem launch --p3``) the
    parameter-server kinds become their P3 kinds.

    Example:
        ```python
        tandem.kvstore.resolve_kind("dist_sync")   # "dist_sync"; "dist_p3" under tandem launch --p3
        tandem.kvstore.resolve_kind("local")       # "local" always
        ```
    """
    return P3_FOR[kind] if kind in P3_FOR and knob("TANDEM_KVSTORE_P3") else kind
