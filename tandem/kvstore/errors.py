"""The exceptions the kvstore raises; all derive from ``KVStoreError`` so callers can catch one type."""

from __future__ import annotations


class KVStoreError(RuntimeError):
    """A kvstore operation failed; the message names the key, the node and the fix where known."""


class ProtocolError(KVStoreError):
    """A received message broke the wire format (malformed, wrong version, bad signature)."""


class RemoteError(KVStoreError):
    """A server refused a request (wrong shape or dtype, key never initialised, double init, ...)."""


class PeerFailure(KVStoreError):
    """Another process of the job died or stopped answering; the job cannot continue."""


class KVStoreTimeout(KVStoreError, TimeoutError):
    """A blocking kvstore wait ran past its timeout."""
