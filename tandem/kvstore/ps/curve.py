"""Who may connect at all: ZeroMQ's CURVE (encrypted links) or, with a secret alone, PLAIN admission.

Both are checked in the connection's handshake by a ZAP handler, before any message is delivered, so
a peer that fails them cannot make a server buffer a single frame (libzmq caps frames, not
messages: without admission a stranger's unfinished multipart message would grow without bound).

**PLAIN** (a job with ``TANDEM_PS_SECRET`` and no CURVE keys): the password is derived from the
job's key (``password_of``), so the secret itself never crosses the wire; the password does, in the
clear, so an eavesdropper on the path could connect, but not forge or replay a message (``auth``).

A job has two key pairs: the servers' and the workers'. A server's socket proves it holds the
servers' secret key and admits only peers holding the workers' (ZeroMQ's ZAP handshake, before any
message is delivered), so a peer without the workers' key cannot even send a frame. Keys are Z85
text, in four environment knobs; ``tandem launch --curve`` makes a fresh pair of pairs per job and
gives each process only the secret key of its own role. Under torchrun, make them once with
``python -m tandem.kvstore.ps.curve`` and export them on every node (``docs/security.md``).
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from dataclasses import dataclass
from typing import Any

import zmq

from tandem.env import knob
from tandem.kvstore.errors import KVStoreError

SERVER_KEY, SERVER_SECRET_KEY = "TANDEM_PS_CURVE_SERVER_KEY", "TANDEM_PS_CURVE_SERVER_SECRET_KEY"
WORKER_KEY, WORKER_SECRET_KEY = "TANDEM_PS_CURVE_WORKER_KEY", "TANDEM_PS_CURVE_WORKER_SECRET_KEY"
KEY_CHARACTERS = 40  # a Z85 CURVE key


@dataclass(frozen=True)
class CurveKeys:
    """The keys one process needs: both public keys and its own role's secret key."""

    server_key: str
    worker_key: str
    secret_key: str  # the servers' on a server, the workers' on a worker

    def __post_init__(self) -> None:
        for name, value in (("server key", self.server_key), ("worker key", self.worker_key),
                            ("secret key", self.secret_key)):  # fmt: skip
            if len(value) != KEY_CHARACTERS:
                raise KVStoreError(f"CURVE {name} must be {KEY_CHARACTERS} Z85 characters, got {len(value)}; "
                                   f"make keys with `python -m tandem.kvstore.ps.curve`")  # fmt: skip

    @classmethod
    def from_env(cls, role: str) -> CurveKeys | None:
        """The keys in the environment for a process of ``role`` ("server" or "worker"); None if CURVE is off."""
        secret_name = SERVER_SECRET_KEY if role == "server" else WORKER_SECRET_KEY
        values = {name: knob(name) for name in (SERVER_KEY, WORKER_KEY, secret_name)}
        if not any(values.values()):
            return None
        missing = [name for name, value in values.items() if not value]
        if missing:
            raise KVStoreError(f"CURVE is half configured: a {role} needs {', '.join(missing)} too "
                               f"(`tandem launch --curve` sets them all)")  # fmt: skip
        if not zmq.has("curve"):
            raise KVStoreError("CURVE keys are set but this libzmq was built without CURVE support")
        return cls(values[SERVER_KEY], values[WORKER_KEY], values[secret_name])

    def make_server(self, socket: zmq.Socket, context: zmq.Context[Any]) -> Any:
        """Make ``socket`` (before it binds) a CURVE server that admits only the workers' key; returns
        the running authenticator (stop it before the context is destroyed)."""
        authenticator = _authenticator(context)
        authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_OneKey(self.worker_key.encode()))
        socket.zap_domain = ZAP_DOMAIN.encode()
        socket.curve_server = True
        socket.curve_secretkey = self.secret_key.encode()
        socket.curve_publickey = self.server_key.encode()
        return authenticator

    def make_client(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (before it connects) a CURVE client: it talks only to a holder of the servers' key."""
        socket.curve_serverkey = self.server_key.encode()
        socket.curve_publickey = self.worker_key.encode()
        socket.curve_secretkey = self.secret_key.encode()


ZAP_DOMAIN = "tandem"


def _authenticator(context: zmq.Context[Any]) -> Any:
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    return authenticator


def password_of(job_key: bytes) -> bytes:
    """The PLAIN password of a job whose (per-start) key is ``job_key``: one-way, so it reveals no key."""
    return hmac.digest(job_key, b"tandem zmq plain", hashlib.sha256).hex().encode()


def admit_with_password(socket: zmq.Socket, context: zmq.Context[Any], password: bytes) -> Any:
    """Make ``socket`` (before it binds) a PLAIN server admitting only ``password``; returns the running
    authenticator (stop it before the context is destroyed)."""
    authenticator = _authenticator(context)
    authenticator.configure_plain(ZAP_DOMAIN, {"tandem": password.decode()})
    socket.zap_domain = ZAP_DOMAIN.encode()
    socket.plain_server = True
    return authenticator


def present_password(socket: zmq.Socket, password: bytes) -> None:
    """Make ``socket`` (before it connects) log in to a PLAIN server with ``password``."""
    socket.plain_username = b"tandem"
    socket.plain_password = password


class _OneKey:
    """ZAP credentials: the one client key the job admits."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


def _z85(key: bytes) -> str:
    return key.decode("ascii")


def new_job_keys() -> dict[str, dict[str, str]]:
    """Fresh keys for one job: the environment of its servers and of its workers (``"server"``, ``"worker"``)."""
    server_public, server_secret = zmq.curve_keypair()
    worker_public, worker_secret = zmq.curve_keypair()
    public = {SERVER_KEY: _z85(server_public), WORKER_KEY: _z85(worker_public)}
    return {"server": {**public, SERVER_SECRET_KEY: _z85(server_secret)},
            "worker": {**public, WORKER_SECRET_KEY: _z85(worker_secret)}}  # fmt: skip


def main() -> int:
    """Print ``export`` lines for a job's CURVE keys (servers need the first three, workers the other three)."""
    keys = new_job_keys()
    for role in ("server", "worker"):
        print(f"# on every {role}:")
        for name, value in keys[role].items():
            print(f"export {name}='{value}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
