"""The exceptions the kvstore raises; all derive from ``KVStoreError`` so callers can catch one type."""

from __future__ import annotations


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


class RemoteError(KVStoreError):
    """A server refused a request (wrong shape or dtype, key never initialised, double init, ...).

    Example:
        ```python
        kv.init("w", torch.zeros(3))
        kv.init("w", torch.zeros(3))    # RemoteError: key 'w' is already initialised; init each key once
        ```
    """


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
