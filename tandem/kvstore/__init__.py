"""Key-value stores for data-parallel training: ``local`` (one process) and a parameter server.

``create("local")`` sums per-device values in this process; ``create("dist_sync")`` and
``create("dist_async")`` join a parameter-server job started by ``tandem launch`` or torchrun as a
worker, and ``serve("dist_sync")`` runs a server of it (see docs/distributed.md); ``dist_p3`` /
``dist_p3_async`` add priority-based propagation (docs/p3.md); ``create("collective")`` joins a job of
workers only that all-reduce among themselves, by priority too (docs/distributed.md#collective-mode).
"""

from __future__ import annotations

from typing import Any

from tandem.kvstore.base import Handle, KVStore
from tandem.kvstore.config import DistOptions, KVStoreConfig, KVStoreOptionError, P3Options
from tandem.kvstore.errors import (
    KVStoreError,
    KVStoreTimeout,
    PeerFailure,
    ProtocolError,
    RemoteError,
    RequestRefused,
)
from tandem.kvstore.kinds import DISTRIBUTED_KINDS, KINDS, P3_FOR, SERVERLESS_KINDS, resolve_kind
from tandem.kvstore.local import LocalKVStore


def create(kind: str | KVStoreConfig = "local", **options: Any) -> KVStore:
    """A new store of ``kind``; distributed kinds join, as a worker, the job the environment describes.

    Options of distributed kinds (each defaults to its TANDEM_* knob): ``bigarray_bound``,
    ``heartbeat``, ``timeout``, ``secret``, ``bind_addr``, ``rendezvous_timeout``, ``exit_on_failure``;
    ``dist_p3``/``dist_p3_async`` and ``collective`` also take ``slice_size`` (or "auto") and ``water_mark`` (docs/p3.md).
    With TANDEM_KVSTORE_P3=1 (``tandem launch --p3``) ``dist_sync``/``dist_async`` become P3 stores.
    The kind and options are resolved into a ``KVStoreConfig`` (which ``kind`` may also be) and checked
    before anything joins the job: a bad one raises ``ValueError`` / ``TypeError`` naming the valid ones.

    Example:
        ```python
        kv = tandem.kvstore.create("local")
        kv.init("w", torch.zeros(3))
        kv.push("w", [torch.ones(3), torch.ones(3)]).wait()   # one value per device: summed
        out = torch.empty(3)
        kv.pull("w", out).wait()                              # out is [2., 2., 2.]

        kv = tandem.kvstore.create("dist_sync")               # a worker of a job (tandem launch, torchrun)
        ```
    A server process of the job is refused (KVStoreError): it runs ``serve(kind)`` instead.
    """
    config = KVStoreConfig.of(kind, **options)
    if not config.distributed:
        return LocalKVStore()
    if config.kind in SERVERLESS_KINDS:
        from tandem.kvstore.collective import connect as join_collective

        return join_collective(config)  # type: ignore[no-any-return]
    from tandem.kvstore.ps.job import connect  # imported late: zmq is only needed for distributed runs

    return connect(config)


def serve(kind: str | KVStoreConfig = "dist_sync", **options: Any) -> int:
    """The server role's entry point: run this server process of the job until the job ends.

    Returns the exit status (0: every worker said goodbye; 1: the job failed), never exits. Under
    ``tandem launch`` or torchrun every process runs the same script, so a script serves first:
    ``if tandem.kvstore.is_server(): sys.exit(tandem.kvstore.serve("dist_sync"))``. ``kind`` and the
    options are ``create``'s (P3 or not as there). The server logs to ``logging`` ("tandem.kvstore.server").

    Example:
        ```python
        if tandem.kvstore.is_server():                 # in the script every process of the job runs
            sys.exit(tandem.kvstore.serve("dist_sync"))
        ```
    """
    config = KVStoreConfig.of(kind, **options)
    if not config.distributed or config.kind in SERVERLESS_KINDS:
        served = tuple(kind for kind in DISTRIBUTED_KINDS if kind not in SERVERLESS_KINDS)
        where = f" (a {config.kind} job has workers only: tandem launch -s 0)" if config.distributed else ""
        raise ValueError(f"only a distributed kvstore has servers; choose one of {served}{where}")
    from tandem.kvstore.ps.job import serve as serve_job

    return serve_job(config)


def is_server() -> bool:
    """Whether this process is a server of a distributed job (``TANDEM_ROLE=server``, or a server rank
    under torchrun); False outside a job.

    Example:
        ```python
        if tandem.kvstore.is_server():
            sys.exit(tandem.kvstore.serve("dist_sync"))
        trainer = tandem.Trainer(model, loss_fn, opt, kvstore="dist_sync")   # the workers
        ```
    """
    from tandem.kvstore.ps.job import is_server as server_role

    return server_role()


__all__ = ["KINDS", "P3_FOR", "DistOptions", "Handle", "KVStore", "KVStoreConfig", "KVStoreError", "KVStoreOptionError",
           "KVStoreTimeout", "LocalKVStore", "P3Options", "PeerFailure", "ProtocolError", "RemoteError",
           "RequestRefused", "create",
           "is_server", "resolve_kind", "serve"]  # fmt: skip
