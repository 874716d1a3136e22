"""A real, bandwidth-limited network on one machine: one Linux network namespace per host.

Why: loopback moves gigabytes per second with microsecond latency, so a parameter server's
scheduling (P3's priorities, overlap of communication with compute) makes no visible difference
there. A cluster's NIC is the bottleneck; this module gives every process its own NIC.

Topology (all names carry ``tandem-<pid>-<serial>`` so that a crashed run can be recognised)::

    host ns h0 (eth0 10.231.X.2) ─veth─┐
    host ns h1 (eth0 10.231.X.3) ─veth─┼─ bridge br0 in hub ns ─veth─ root ns (10.231.X.1)
    ...                                ┘

Each host's link is shaped on both ends (``tc tbf`` on the egress of the host-side veth: upload;
and on the egress of the hub-side veth: download), like a full-duplex NIC of ``rate``. The link
to the root namespace is not shaped: it carries the launcher's rendezvous store, which is tiny.

Cleanup: deleting a namespace destroys the veths inside it (and their peers), so closing a network
kills the processes still inside its namespaces and deletes the namespaces. ``Network`` also
removes leftovers of dead processes when it starts, and an atexit/SIGTERM hook closes live ones.

Without root, ``ip`` or ``tc`` (see ``available()``) a network falls back to loopback: every host
is 127.0.0.1, ``command`` is unchanged, ``shaped`` is False, and a warning says so.

Used by ``tandem launch --netns-rate``, the benchmarks and the tests.
"""

from __future__ import annotations

import atexit
import fcntl
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType

NAME_PREFIX = "tandem-"
SUBNET_PREFIX = "10.231"  # private range unlikely to clash with real networks
LOCK_PATH = "/tmp/tandem-netns.lock"  # serialises subnet choice between concurrent processes
COMMAND_TIMEOUT = 20.0
MIN_BURST_BYTES = 8192  # a shaped link's token bucket: never under a few 1514-byte frames
_NAMESPACE = re.compile(rf"^{NAME_PREFIX}(\d+)-\d+-")
_ROOT_LINK = re.compile(r"^td([0-9a-f]+)n\d+$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)?\s*$", re.IGNORECASE)
_RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}
_serials = itertools.count()
_live: weakref.WeakSet[Network] = weakref.WeakSet()
_hooks_installed = False
_probe: tuple[bool, str] | None = None


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message quotes the command and its error output."""


def parse_rate(rate: str | int) -> int:
    """Bits per second of a tc-style rate (``"100mbit"``, ``"1gbit"``, ``"12.5mbps"``) or an int (bits/s)."""
    if isinstance(rate, int) and not isinstance(rate, bool):
        bits = rate
    else:
        match = _RATE.match(str(rate))
        if match is None:
            raise ValueError(
                f"rate {rate!r} is not a rate: use e.g. '100mbit', '1gbit', '500kbit' or bits/s as an int"
            )
        bits = int(float(match.group(1)) * _RATE_UNITS[(match.group(2) or "bit").lower()])
    if bits < 8_000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s; tc cannot shape usefully that slow")
    return bits


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if check and result.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and why not: needs root, ``ip``, ``tc`` and netns support.

    The answer is probed once per process by creating and deleting a throwaway namespace.
    """
    global _probe
    if _probe is not None:
        return _probe
    if os.geteuid() != 0:
        _probe = (False, "network namespaces need root (run as root or in a privileged container)")
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        _probe = (False, "iproute2 (`ip` and `tc`) is not installed; apt-get install iproute2")
    else:
        name = f"{NAME_PREFIX}{os.getpid()}-probe-"
        made = _run(["ip", "netns", "add", name], check=False)
        _run(["ip", "netns", "delete", name], check=False)
        reason = f"`ip netns add` failed: {made.stderr.strip()}"
        _probe = (True, "") if made.returncode == 0 else (False, reason)
    return _probe


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    listing = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside (only ever our own namespaces' processes), then delete it."""
    for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "delete", name], check=False)


def remove_stale() -> list[str]:
    """Delete namespaces and root-namespace links left by tandem processes that no longer run."""
    removed = []
    for name in _namespaces():
        match = _NAMESPACE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(name)
            removed.append(name)
    for name in _root_links():
        match = _ROOT_LINK.match(name)
        if match and not _pid_alive(int(match.group(1), 16)):
            _run(["ip", "link", "delete", name], check=False)
            removed.append(name)
    return removed


def _root_links() -> list[str]:
    listing = _run(["ip", "-o", "link", "show"], check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in listing.splitlines() if line.count(":") >= 2]


def _free_subnet() -> int:
    """The lowest X such that no root-namespace address lies in 10.231.X.0/24 (call under LOCK_PATH)."""
    listing = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    used = {int(third) for third in re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", listing)}
    for candidate in range(1, 255):
        if candidate not in used:
            return candidate
    raise NetnsError(f"every {SUBNET_PREFIX}.X.0/24 subnet is in use; close other tandem networks")


@dataclass(frozen=True)
class Host:
    """One machine of the network: a namespace (``name``) with one NIC at ``address``."""

    index: int
    address: str
    name: str | None  # the namespace; None on the loopback fallback

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace (the environment passes through unchanged)."""
        return list(argv) if self.name is None else ["ip", "netns", "exec", self.name, *argv]


@dataclass(eq=False)  # identity semantics: live networks sit in a WeakSet
class Network:
    """``num_hosts`` namespaces on one shaped bridge; use as a context manager (or call ``close``).

    ``rate`` limits each host's upload and download separately (None: no shaping). ``shaped`` tells
    whether the limit is real; ``isolated`` whether hosts are real namespaces. ``root_address`` is how
    the hosts reach the root namespace (where e.g. a launcher's rendezvous store can listen).
    Thread safety: create and close from one thread; ``hosts`` may be read from any.
    """

    num_hosts: int
    rate: str | int | None = None
    hosts: list[Host] = field(init=False, default_factory=list)
    root_address: str = field(init=False, default="127.0.0.1")
    isolated: bool = field(init=False, default=False)
    rate_bits: int | None = field(init=False, default=None)
    _serial: int = field(init=False, default=0)
    _created: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.num_hosts <= 250:
            raise ValueError(f"num_hosts must be in [1, 250], got {self.num_hosts}")
        self.rate_bits = None if self.rate is None else parse_rate(self.rate)
        ok, reason = available()
        if not ok:
            warnings.warn(
                f"tandem.netns: {reason}; falling back to loopback without shaping", stacklevel=2
            )
            self.hosts = [Host(index, "127.0.0.1", None) for index in range(self.num_hosts)]
            return
        _install_hooks()
        remove_stale()
        self._serial = next(_serials)
        _live.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def shaped(self) -> bool:
        return self.isolated and self.rate_bits is not None

    @property
    def root(self) -> Host:
        """The root namespace as a host (index -1): where this process runs, reachable from every host."""
        return Host(-1, self.root_address, None)

    def _name(self, suffix: str) -> str:
        return f"{NAME_PREFIX}{os.getpid()}-{self._serial}-{suffix}"

    def _add_namespace(self, name: str) -> None:
        self._created.append(name)  # recorded first: a half-made namespace is still cleaned up
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        hub = self._name("hub")
        self._add_namespace(hub)
        _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge", "forward_delay", "0"])
        _run(["ip", "-n", hub, "link", "set", "br0", "up"])
        with open(LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two networks must not pick the same subnet
            subnet = f"{SUBNET_PREFIX}.{_free_subnet()}"
            self._link_root(hub, subnet)
        for index in range(self.num_hosts):
            self.hosts.append(self._add_host(hub, index, f"{subnet}.{index + 2}"))
        self.root_address = f"{subnet}.1"
        self.isolated = True

    def _link_root(self, hub: str, subnet: str) -> None:
        root_end = f"td{os.getpid():x}n{self._serial}"
        _run(["ip", "link", "add", root_end, "type", "veth", "peer", "name", "uplink", "netns", hub])
        _run(["ip", "-n", hub, "link", "set", "uplink", "master", "br0", "up"])
        _run(["ip", "addr", "add", f"{subnet}.1/24", "dev", root_end])
        _run(["ip", "link", "set", root_end, "up"])

    def _add_host(self, hub: str, index: int, address: str) -> Host:
        name, port = self._name(f"h{index}"), f"h{index}"
        self._add_namespace(name)
        _run(["ip", "link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", port, "netns", hub])
        _run(["ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0"])
        _run(["ip", "-n", name, "link", "set", "eth0", "up"])
        _run(["ip", "-n", hub, "link", "set", port, "master", "br0", "up"])
        if self.rate_bits is not None:
            self._shape(name, "eth0")  # upload
            self._shape(hub, port)  # download
        return Host(index, address, name)

    def _shape(self, namespace: str, device: str) -> None:
        rate = self.rate_bits
        assert rate is not None
        # burst: 2 ms at the rate, at least a few full-size frames. tbf cuts a GSO packet larger than
        # the bucket into frames itself, so the bucket need not hold one: a 128 KiB floor (10 ms at
        # 100 Mbit/s) let a small step's whole exchange through at memory speed, as no real link does
        burst = max(MIN_BURST_BYTES, rate // 8 // 500)
        _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
              "rate", f"{rate}bit", "burst", str(burst), "latency", "50ms"])  # fmt: skip

    def close(self) -> None:
        """Kill processes left in the namespaces and delete everything this network made; idempotent."""
        created, self._created = self._created, []
        for name in reversed(created):  # hosts first, hub (holding the root link's peer) last
            _delete_namespace(name)
        if created:
            _run(["ip", "link", "delete", f"td{os.getpid():x}n{self._serial}"], check=False)  # if half-made
        _live.discard(self)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_created", None):
            self.close()


def _close_all() -> None:
    for network in list(_live):
        network.close()


def _install_hooks() -> None:
    """Close live networks at exit and on SIGTERM (only if nobody else handles SIGTERM)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_all)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die as SIGTERM would have killed us
    time.sleep(1)
    sys.exit(128 + signum)


THROUGHPUT_SCRIPT = r"""
import socket, sys, time
role, address, port, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if role == "receive":
    server = socket.create_server((address, port))
    server.settimeout(seconds + 20)
    print("ready", flush=True)
    connection, _ = server.accept()
    connection.settimeout(seconds + 20)
    received, first, last = 0, None, None
    while True:
        chunk = connection.recv(1 << 20)
        if not chunk:
            break
        now = time.perf_counter()
        first = first if first is not None else now
        received, last = received + len(chunk), now
    print(received * 8 / max(last - first, 1e-9) if received else 0.0, flush=True)
else:
    connection = socket.create_connection((address, port), timeout=seconds + 20)
    block = b"x" * (1 << 16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        connection.sendall(block)
    connection.close()
"""


def throughput(sender: Host, receiver: Host, seconds: float = 1.0, port: int = 45719) -> float:
    """Bits per second one TCP stream reaches from ``sender`` to ``receiver`` in ``seconds`` of sending."""
    python = [sys.executable, "-c", THROUGHPUT_SCRIPT]
    args = [receiver.address, str(port), str(seconds)]
    listening = subprocess.Popen(
        receiver.command([*python, "receive", *args]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert listening.stdout is not None
        if listening.stdout.readline().strip() != "ready":
            raise NetnsError(f"throughput receiver on host {receiver.index} did not start")
        _run(sender.command([*python, "send", *args]))
        output, _ = listening.communicate(timeout=seconds + 30)
        return float(output.strip())
    finally:
        if listening.poll() is None:
            listening.kill()
            listening.wait()
