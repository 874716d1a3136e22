"""Who is who in a distributed job, read from the environment, and the TCPStore rendezvous.

Two sources of topology are understood:
- ``tandem launch`` sets ``TANDEM_ROLE``, ``TANDEM_RANK``, ``TANDEM_NUM_WORKERS``/``SERVERS`` and
  ``TANDEM_MASTER_ADDR``/``PORT`` (it hosts the TCPStore there);
- ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (its agent hosts the
  store); with ``TANDEM_NUM_SERVERS=S``, ranks ``[0, S)`` are servers and the rest workers.
Servers publish their two ZeroMQ endpoints in the store; workers read every server's from it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from tandem.env import is_set, knob
from tandem.kvstore.errors import KVStoreError, KVStoreTimeout


def restart_count() -> str:
    """Which start of the job this process belongs to: ``tandem launch --max-restarts``' attempt
    (``TANDEM_RESTART_ATTEMPT``) and torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``), e.g. "1.0".

    Both launchers keep their rendezvous store across restarts, so every key a job sets is named
    with this: a restarted job must never read the last one's keys (a dead server's endpoint)."""
    return f"{knob('TANDEM_RESTART_ATTEMPT')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


STORE_PREFIX = "tandem/kvstore/" if restart_count() == "0.0" else f"tandem/kvstore/restart-{restart_count()}/"


@dataclass(frozen=True)
class Topology:
    role: str  # "server" or "worker"
    rank: int  # within the role
    num_workers: int
    num_servers: int
    master_addr: str
    master_port: int
    local_processes: int  # processes sharing this machine's cores

    def __post_init__(self) -> None:
        if self.role not in ("server", "worker"):
            raise KVStoreError(f"TANDEM_ROLE must be 'server' or 'worker', got {self.role!r}")
        if self.num_workers < 1 or self.num_servers < 1:
            raise KVStoreError(
                f"a distributed kvstore needs >= 1 worker and >= 1 server, got {self.num_workers} workers and "
                f"{self.num_servers} servers (TANDEM_NUM_WORKERS / TANDEM_NUM_SERVERS)"
            )
        size = self.num_servers if self.role == "server" else self.num_workers
        if not 0 <= self.rank < size:
            raise KVStoreError(f"{self.role} rank {self.rank} is outside [0, {size}) (TANDEM_RANK)")

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"

    @classmethod
    def from_env(cls) -> Topology:
        """The topology ``tandem launch`` or ``torchrun`` put in the environment; names the fix if neither did."""
        if is_set("TANDEM_ROLE"):
            workers, servers = knob("TANDEM_NUM_WORKERS"), knob("TANDEM_NUM_SERVERS")
            return cls(knob("TANDEM_ROLE"), knob("TANDEM_RANK"), workers, servers, knob("TANDEM_MASTER_ADDR"),
                       knob("TANDEM_MASTER_PORT"), workers + servers)  # fmt: skip
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return cls._from_torchrun()
        raise KVStoreError(
            "a dist_* kvstore needs a job topology: start the script with `tandem launch -n WORKERS -s SERVERS -- "
            "python script.py`, or under torchrun with TANDEM_NUM_SERVERS set, or set TANDEM_ROLE and friends"
        )

    @classmethod
    def _from_torchrun(cls) -> Topology:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        servers = knob("TANDEM_NUM_SERVERS")
        if world <= servers:
            raise KVStoreError(f"torchrun WORLD_SIZE={world} leaves no workers beside TANDEM_NUM_SERVERS={servers}")
        role, role_rank = ("server", rank) if rank < servers else ("worker", rank - servers)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(role, role_rank, world - servers, servers, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   int(os.environ.get("MASTER_PORT", "29500")), local)  # fmt: skip


def set_torch_threads(topology: Topology) -> int:
    """Give each process its share of the cores (TANDEM_NUM_THREADS overrides), so processes do not thrash."""
    threads = knob("TANDEM_NUM_THREADS") or max(1, (os.cpu_count() or 1) // max(1, topology.local_processes))
    torch.set_num_threads(threads)
    return threads


class Master(Protocol):
    """Where a job's rendezvous store listens (a ``Topology``, or the collective store's ``Group``)."""

    @property
    def master_addr(self) -> str: ...

    @property
    def master_port(self) -> int: ...


def connect_store(topology: Master, timeout: float) -> dist.TCPStore:
    """A client of the job's TCPStore (hosted by ``tandem launch`` or torchrun's agent)."""
    try:
        return dist.TCPStore(topology.master_addr, topology.master_port, is_master=False,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)  # fmt: skip
    except Exception as error:  # torch raises RuntimeError/DistNetworkError subclasses here
        raise KVStoreError(
            f"cannot reach the rendezvous store at {topology.master_addr}:{topology.master_port} within {timeout:.0f} s "
            f"({error}); is `tandem launch` (or torchrun) running and TANDEM_MASTER_ADDR/PORT right?"
        ) from None


def mean_over_workers(store: dist.TCPStore, name: str, rank: int, num_workers: int, value: float,
                      timeout: float) -> float:  # fmt: skip
    """The mean of every worker's ``value`` under ``name`` (each name once); every worker gets the same float."""
    values = gather_over_workers(store, name, rank, num_workers, repr(value), timeout)
    return statistics.fmean(float(value) for value in values)  # same values, same order: same result


def gather_over_workers(store: dist.TCPStore, name: str, rank: int, num_workers: int, text: str,
                        timeout: float) -> list[str]:  # fmt: skip
    """Every worker's ``text`` under ``name`` (each name once), in rank order, on every worker."""
    keys = [f"{STORE_PREFIX}{name}/{worker}" for worker in range(num_workers)]
    store.set(keys[rank], text)
    values = _wait_for(store, keys, timeout,
                       lambda missing: f"worker(s) {missing} did not report {name} within {timeout:.0f} s")  # fmt: skip
    return [value.decode() for value in values]


def from_rank_zero(store: dist.TCPStore, name: str, rank: int, text: str, timeout: float) -> str:
    """Worker 0's ``text`` under ``name`` (each name once), on every worker; other ranks' ``text`` is ignored."""
    key = f"{STORE_PREFIX}{name}"
    if rank == 0:
        store.set(key, text)
    (value,) = _wait_for(store, [key], timeout, lambda _: f"worker 0 did not publish {name} within {timeout:.0f} s")
    return value.decode()


def _wait_for(store: dist.TCPStore, keys: list[str], timeout: float, problem: Callable[[list[int]], str]) -> list[bytes]:
    """The values of ``keys`` once all are set; after ``timeout`` seconds a ``KVStoreTimeout`` saying
    ``problem(indices of the keys still missing)``."""
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # torch raises its own timeout types here
        raise KVStoreTimeout(problem([index for index, key in enumerate(keys) if not store.check([key])])) from None
    return [store.get(key) for key in keys]


def public_endpoint(bind_addr: str, port: int) -> str:
    """The address workers should dial: the bind address, or this host's address for a wildcard bind."""
    host = socket.gethostbyname(socket.gethostname()) if bind_addr in ("0.0.0.0", "*") else bind_addr
    return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class ServerAddress:
    """A server's endpoint (its ROUTER: every message to and from it)."""

    endpoint: str

    def __str__(self) -> str:
        return self.endpoint


def _endpoint_tag(secret: bytes, key: str, endpoint: str) -> str:
    return hmac.new(secret, f"{key}={endpoint}".encode(), hashlib.sha256).hexdigest()


def publish_server(store: dist.TCPStore, rank: int, address: ServerAddress, secret: bytes = b"") -> None:
    """Tell workers where server ``rank`` listens; with a secret, the entry is signed (the store itself
    is not authenticated: whoever reaches it could otherwise send workers to a server of their own)."""
    key = f"{STORE_PREFIX}server/{rank}"
    store.set(key, f"{address.endpoint} {_endpoint_tag(secret, key, address.endpoint)}" if secret else address.endpoint)


def server_addresses(store: dist.TCPStore, num_servers: int, timeout: float, secret: bytes = b"") -> list[ServerAddress]:
    """Every server's endpoints, waiting up to ``timeout`` seconds for servers to publish them; with a
    secret, an entry not signed with it is refused."""
    keys = [f"{STORE_PREFIX}server/{rank}" for rank in range(num_servers)]
    entries = _wait_for(store, keys, timeout, lambda missing: (
        f"server(s) {missing} did not publish an endpoint within {timeout:.0f} s; did they start (`tandem launch "
        f"-s {num_servers}` or TANDEM_NUM_SERVERS under torchrun)?"))  # fmt: skip
    addresses = []
    for rank, (key, entry) in enumerate(zip(keys, entries)):
        endpoint, _, tag = entry.decode("utf-8", "replace").partition(" ")
        if secret and not hmac.compare_digest(tag, _endpoint_tag(secret, key, endpoint)):
            raise KVStoreError(f"the endpoint of server {rank} in the rendezvous store ({endpoint!r}) is not signed "
                               f"with this job's TANDEM_PS_SECRET: another secret, or someone else wrote it")  # fmt: skip
        addresses.append(ServerAddress(endpoint))
    return addresses
