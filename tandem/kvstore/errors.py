"""The exceptions the kvstore raises; all derive from ``KVStoreError`` so callers can catch one type."""

from __future__ import annotations

from collections.abc import Sequence


class KVStoreError(RuntimeError):
    """A kvstore operation failed; the message names the key, the node and the fix where known.

    Example:
        ```python
        try:
            kv.pull("w", out).wait()
        except tandem.kvstore.KVStoreError as error:    # every kvstore error derives from it
            print(error)
        ```
    """


class ProtocolError(KVStoreError):
    """A received message broke the wire format (malformed, wrong version, bad signature).

    Example:
        ```python
        from tandem.kvstore.ps.protocol import decode
        decode([b"not a tandem message"])   # ProtocolError: header of 20 bytes is shorter than ...
        # a server or worker receiving such a message (or a bad signature) logs it and drops it
        ```
    """


class RequestRefused(KVStoreError):
    """The store refused a request: wrong shape or dtype, key never initialised, a second init, ...

    The local and the collective store raise it themselves; a server's refusal arrives as its
    subclass ``RemoteError``, so ``except RequestRefused`` catches a bad request on every kind.

    Example:
        ```python
        kv = tandem.kvstore.create("local")
        kv.init("w", torch.zeros(3))
        kv.push("w", torch.zeros(4))    # RequestRefused: push of key 'w': got shape (4,) torch.float32, ...
        ```
    """


class RemoteError(RequestRefused):
    """A server refused a request (wrong shape or dtype, key never initialised, double init, a worker
    that closed its store, ...); the message is the server's.

    Example:
        ```python
        kv = tandem.kvstore.create("dist_sync")   # a worker of a job
        kv.init("w", torch.zeros(3))
        kv.pull("never", torch.zeros(3)).wait()   # RemoteError: pull of key 'never': key was never initialised
        ```
    """


def second_init(key: object, stored: tuple[Sequence[int], object], given: tuple[Sequence[int], object]) -> str:
    """The message of an ``init`` of a key already initialised: the key and both (shape, dtype).

    Every store refuses a second init, even with the same shape and dtype (``init`` is collective and
    sets the value every worker starts from: a second one would silently replace or, with another
    shape, duplicate it).

    Example:
        ```python
        second_init("w", ((3,), torch.float32), ((4,), torch.float32))
        # "init of key 'w' as (4,) torch.float32: the key is already initialised as (3,) torch.float32; ..."
        ```
    """
    (stored_shape, stored_dtype), (shape, dtype) = stored, given
    return (f"init of key {key!r} as {tuple(shape)} {dtype}: the key is already initialised as "
            f"{tuple(stored_shape)} {stored_dtype}; init each key once (one model per store)")  # fmt: skip


class PeerFailure(KVStoreError):
    """Another process of the job died or stopped answering; the job cannot continue.

    Example:
        ```python
        try:
            trainer.fit(train_set, epochs=3)
        except tandem.kvstore.PeerFailure as failure:  # a server or worker died: restart from a checkpoint
            sys.exit(f"job failed: {failure}")
        ```
    """


class KVStoreTimeout(KVStoreError, TimeoutError):
    """A blocking kvstore wait ran past its timeout.

    Example:
        ```python
        try:
            kv.pull("w", out).wait(timeout=5)
        except tandem.kvstore.KVStoreTimeout:         # also a TimeoutError
            ...
        ```
    """
