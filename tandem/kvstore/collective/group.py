"""Who the workers of a collective job are, their process groups, and how they learn a peer died.

Two sources of topology are understood, as for the parameter server (``ps/topology.py``):
``tandem launch -n N -s 0`` (``TANDEM_ROLE=worker``, ``TANDEM_RANK``, ``TANDEM_NUM_WORKERS``,
``TANDEM_MASTER_ADDR``/``PORT``: the launcher hosts the TCPStore) and torchrun (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: its agent hosts the store; every rank is a worker).

The process groups are made straight from that store (``ProcessGroupGloo`` / ``ProcessGroupNCCL``),
never through ``init_process_group``: a script may have its own default group (DDP beside tandem),
and a store made twice in one process gets groups of its own.

Failure detection: gloo reports a peer whose sockets closed, but not which rank it was, and a peer
that hangs only after the group's timeout. So every worker also beats a counter in the store every
``heartbeat`` seconds and watches the others'; a counter that stands still for ``timeout`` seconds
names the dead worker. A worker that dies of an exception posts why (``abort``), one that closes
its store says so (``closed``), so that the others neither wait for a heartbeat nor mistake it for
a dead one.

The monitor has a store client of its own: a client serialises its operations, so a heartbeat
sharing one with the training thread would stall behind that thread's blocking wait (an init
waiting for a slower worker), and the healthy worker would be called dead. The training thread's
waits (``gather``) poll, and between polls check whether the job ended, so a
waiter ends with the job rather than at the wait's timeout.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.env import is_set, knob
from tandem.kvstore.errors import KVStoreError, KVStoreTimeout, PeerFailure
from tandem.kvstore.ps.topology import restart_count

POLL_SECONDS = 0.02  # how often a wait in the store looks whether it is over, or the job ended
EXIT_GRACE_SECONDS = 3.0  # a worker whose job failed exits this long after, if its main thread did not first


@dataclass(frozen=True)
class Group:
    """This worker's place in a collective job (every process of it is a worker)."""

    rank: int
    size: int
    master_addr: str
    master_port: int
    local_processes: int  # processes sharing this machine's cores
    incarnation: str = "0.0"  # ps.topology.restart_count(): a restarted job meets in a store that saw the last one

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise KVStoreError(f"worker rank {self.rank} is outside [0, {self.size}) (TANDEM_RANK / RANK)")

    @classmethod
    def from_env(cls) -> Group:
        """The workers ``tandem launch`` or torchrun put in the environment; names the fix if neither did."""
        if is_set("TANDEM_ROLE"):
            if knob("TANDEM_ROLE") != "worker":
                raise KVStoreError("the collective kvstore has no servers: start the job with `tandem launch -n N "
                                   "-s 0` (this process was started as a server)")  # fmt: skip
            workers = knob("TANDEM_NUM_WORKERS")
            return cls(knob("TANDEM_RANK"), workers, knob("TANDEM_MASTER_ADDR"), knob("TANDEM_MASTER_PORT"),
                       workers + knob("TANDEM_NUM_SERVERS"), restart_count())  # fmt: skip
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            world = int(os.environ["WORLD_SIZE"])
            return cls(int(os.environ["RANK"]), world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                       int(os.environ.get("MASTER_PORT", "29500")), int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                       restart_count())  # fmt: skip
        raise KVStoreError("the collective kvstore needs a job: start the script with `tandem launch -n WORKERS -s 0 "
                           "-- python script.py` or under torchrun")  # fmt: skip

    def set_torch_threads(self) -> int:
        """Each process its share of the cores (TANDEM_NUM_THREADS overrides), as the parameter server's."""
        threads = knob("TANDEM_NUM_THREADS") or max(1, (os.cpu_count() or 1) // max(1, self.local_processes))
        torch.set_num_threads(threads)
        return threads


def gloo_group(store: dist.Store, prefix: str, group: Group, timeout: float) -> Any:
    """A gloo process group of every worker, meeting under ``prefix`` in ``store``, listening on
    ``listen_address`` (gloo's own choice where that is None)."""
    prefixed = dist.PrefixStore(prefix, store)
    address = listen_address(group.master_addr, group.master_port)
    if address is None:
        return dist.ProcessGroupGloo(prefixed, group.rank, group.size, timedelta(seconds=timeout))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the gloo options (not typed)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = timedelta(seconds=timeout)
    return dist.ProcessGroupGloo(prefixed, group.rank, group.size, options)


def listen_address(host: str, port: int) -> str | None:
    """The address gloo listens on: None (gloo's choice) if ``GLOO_SOCKET_IFNAME`` chooses an interface;
    else ``TANDEM_BIND_ADDR`` if set (not a wildcard); else this machine's address on the route to
    the store (``host``), loopback included; None only if there is no route.

    Gloo's own choice, the address the host name resolves to, is often a loopback address other
    hosts cannot reach (``127.0.1.1``), or a LAN address where the store is on loopback; the route
    to the store is the address the peers, reaching the same store, reach this worker by."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    if is_set("TANDEM_BIND_ADDR") and knob("TANDEM_BIND_ADDR") not in ("0.0.0.0", "*", "::"):
        return str(knob("TANDEM_BIND_ADDR"))
    return route_address(host, port)


def route_address(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host`` (loopback if ``host`` is), without an IPv6
    scope suffix; None if there is no route. Sends nothing."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # a UDP connect only picks the route and the source address
            address = str(probe.getsockname()[0]).split("%")[0]
        return str(ipaddress.ip_address(address))
    except (OSError, ValueError):
        return None


def gather(store: dist.Store, name: str, rank: int, size: int, text: str, timeout: float,
           ended: Callable[[], None]) -> list[str]:
    """Every worker's ``text`` under ``name`` (each name once), in rank order, on every worker.

    Waits at most ``timeout`` seconds, polling every ``POLL_SECONDS`` (never one blocking wait, which
    would hold the client); between polls ``ended()`` raises if the job ended (a peer failed or posted
    an abort), so no waiter outlives it."""
    keys = [f"{name}/{worker}" for worker in range(size)]
    store.set(keys[rank], text)
    deadline = time.monotonic() + timeout
    while not store.check(keys):  # polled: a timed-out store.wait logs a warning each time
        ended()
        if time.monotonic() > deadline:
            missing = [worker for worker, key in enumerate(keys) if not store.check([key])]
            raise KVStoreTimeout(f"worker(s) {missing} did not report {name} within {timeout:.0f} s")
        time.sleep(POLL_SECONDS)
    return [store.get(key).decode() for key in keys]


def data_group(store: dist.Store, prefix: str, group: Group, timeout: float, device: torch.device) -> Any:
    """The group that carries the tensors: NCCL for CUDA tensors, gloo for CPU ones (the same calls)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), group.rank, group.size, options)
    return gloo_group(store, prefix, group, timeout)


class Monitor:
    """Heartbeats through the job's store, and the verdict on a silent, failed or departed peer.

    ``on_failure(PeerFailure)`` is called once, from the monitor's thread, when a worker has not
    beaten for ``timeout`` seconds, posted an abort, or the store itself stopped answering.
    """

    def __init__(self, store: dist.Store, prefix: str, group: Group, heartbeat: float, timeout: float,
                 on_failure: Callable[[PeerFailure], None]) -> None:  # fmt: skip
        self.store, self.prefix, self.group = store, prefix, group
        self.heartbeat, self.timeout, self.on_failure = heartbeat, timeout, on_failure
        self._stop = threading.Event()
        self._beats = [f"{prefix}beat/{rank}" for rank in range(group.size)]
        self.store.set(f"{prefix}who/{group.rank}", f"pid {os.getpid()} on {socket.gethostname()}")
        self.store.add(self._beats[group.rank], 1)
        self._thread = threading.Thread(target=self._run, name=f"tandem-collective-monitor-{group.rank}", daemon=True)

    def start(self) -> None:
        """Start watching (once every worker has beaten once: after the process groups are made)."""
        self._thread.start()

    def who(self, rank: int) -> str:
        try:
            return f"worker {rank} ({self.store.get(f'{self.prefix}who/{rank}').decode()})"
        except Exception:  # noqa: BLE001 - the store may be gone: the rank alone still names it
            return f"worker {rank}"

    def _run(self) -> None:
        others = [rank for rank in range(self.group.size) if rank != self.group.rank]
        seen = {rank: -1 for rank in others}
        changed = {rank: time.monotonic() for rank in others}
        abort, closed = f"{self.prefix}abort", [f"{self.prefix}closed/{rank}" for rank in range(self.group.size)]
        while not self._stop.wait(self.heartbeat):
            try:
                self.store.add(self._beats[self.group.rank], 1)
                if self.store.check([abort]):
                    self.on_failure(PeerFailure(f"the job was stopped: {self.store.get(abort).decode()}"))
                    return
                now = time.monotonic()
                for rank in others:
                    beats = self.store.add(self._beats[rank], 0)
                    if beats != seen[rank]:
                        seen[rank], changed[rank] = beats, now
                    elif now - changed[rank] > self.timeout and not self.store.check([closed[rank]]):
                        self.on_failure(PeerFailure(f"{self.who(rank)} stopped answering: no heartbeat for "
                                                    f"{self.timeout:.1f} s"))  # fmt: skip
                        return
            except Exception as error:  # noqa: BLE001 - the store's host (launcher, torchrun agent) is gone
                if self._stop.is_set():
                    return
                self.on_failure(PeerFailure(f"the job's rendezvous store at {self.group.master_addr}:"
                                            f"{self.group.master_port} stopped answering ({error})"))  # fmt: skip
                return

    def post_abort(self, reason: str) -> None:
        """Tell every worker the job failed (best effort: the first reason posted stands)."""
        try:
            self.store.compare_set(f"{self.prefix}abort", "", reason)
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass

    def stop(self, closed: bool) -> None:
        """Stop beating; ``closed``: this worker left on purpose (the others must not call it dead)."""
        if closed:
            try:
                self.store.set(f"{self.prefix}closed/{self.group.rank}", "1")
            except Exception:  # noqa: BLE001 - the store may be gone already
                pass
        self._stop.set()


def exit_later(rank: int, reason: str) -> None:
    """Exit the process after ``EXIT_GRACE_SECONDS`` (the main thread may raise the failure first)."""

    def run() -> None:
        time.sleep(EXIT_GRACE_SECONDS)
        print(f"tandem kvstore, worker {rank}: {reason}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=run, name="tandem-collective-exit", daemon=True).start()
