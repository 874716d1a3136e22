"""A discrete-event simulation of data-parallel training iterations: the core of ``tandem plan``.

What it simulates, per mode (``Strategy.mode``), for ``Cluster.workers`` identical workers:
  - every worker runs the profiled forward and backward segments (``Workload``) one after another;
  - ``baseline``: after backward, each gradient is pushed, then each parameter pulled (FIFO); the
    next forward starts once every parameter is back;
  - ``overlap``: each gradient is pushpulled whole (FIFO) when the backward segment finishing it ends;
  - ``p3``: the same cut into slices (the real ``RoundRobinPlacement``), a backward segment's slices
    queued together by priority (``-parameter index``) in the worker's sender with at most
    ``water_mark`` requests in flight (a request is in flight until its worker receives its reply,
    or the RECEIVED notice a server sends when it parks a request that asked for one, as
    ``p3_sender`` rules it; a ``small`` one, of at most ``slice_size / 16`` elements, never counts),
    served by priority on the servers;
  - in ``overlap`` and ``p3`` the next forward starts each segment once the parameters it reads are back;
  - ``allreduce``: no servers; gradients bucketed in backward order, each bucket ring-all-reduced
    when its last gradient is ready, one bucket at a time (``allreduce_seconds``);
  - ``collective``: no servers; tandem's collective kvstore (``_CollectiveSim``): a backward
    segment's gradients cut into slices, by priority, small ones fused up to a slice, agreed in
    rounds (small all-reduces, each completion refilled by a round; ``Strategy.ordered``: issued in
    the order they are sent, no rounds); one ring all-reduce at a time, at most
    ``water_mark`` issued ahead of their completion; the next forward starts each segment once the
    parameters it reads are summed.
The network: every host (worker or server) has a full-duplex NIC, an uplink and a downlink of
``rate`` each (``Link``): a FIFO per peer (a TCP connection), the flows to (or from) different peers
sharing the rate while several have bytes queued. A message takes ``bytes / (rate x
payload_fraction)`` of a link to itself (TCP/IP framing takes the rest); its head reaches the
receiver's downlink ``latency`` after it starts leaving (cut-through), where it shares that downlink
with the other senders' flows (incast), and it lands whole, once it has left the uplink and crossed
the downlink (the two ends not rate-coupled: ``_PSSim.cross``). Priorities act above the links: in the worker's sender queue
and in the server's loop, so a high-priority slice waits for at most ``water_mark`` admitted slices
(with ``water_mark=1``, only for the one in flight).
The server's loop (``server.Server.serve``): take every message landed so far (a poll), serve its
requests one by one (p3: by priority, ``p3.PriorityReceive``), then send the held replies. The P3
server sends each reply as it is served; the plain server holds a poll's replies to each worker and
sends them as one message (up to ``TANDEM_PS_COALESCE_BYTES``); a push is acknowledged (an empty reply).
CPU (``Machine``): a message of n requests (or replies) costs ``message_s + n * entry_s + bytes *
byte_s`` in the sending worker's sender thread and in the receiving worker's IO thread (requests
leaving the sender at once share one message per server, up to ``TANDEM_PS_COALESCE_BYTES``); a
server spends ``server_message_s`` per message received, ``server_entry_s + bytes * server_byte_s +
bytes / aggregate_Bps`` per request in it (receive and sum), ``bytes / aggregate_Bps`` once per
round (the update) and ``server_message_s + n * server_entry_s + bytes * server_byte_s`` per
message of n replies it sends (or a RECEIVED notice). A thread that finds no message waiting and is woken by
the next pays ``Machine.wake_s`` on top, more the longer it waited (caches gone cold; measured).
Every thread's work (compute segments included) runs on its host's ``cores``, shared by processor
sharing (``CPU``): n busy threads on c cores each progress at min(1, c / n), or min(1, c / (n + b))
beside ``Machine.background`` threads of other work. A host is one
worker or one server (a cluster); with ``Cluster.colocated``, worker k and server k share a host (its
NIC, its cores; their messages to each other skip the network); with ``Machine.shared_host``, one
host runs every worker and server (this machine under ``tandem launch``), so communication and
servers slow compute down.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from tandem.env import knob
from tandem.kvstore.compression import KINDS as COMPRESSION_KINDS
from tandem.kvstore.compression import GradientCompression, summable
from tandem.kvstore.ps.client import grouped
from tandem.kvstore.ps.p3_sender import small
from tandem.kvstore.ps.placement import RangePlacement, RoundRobinPlacement, Slice
from tandem.kvstore.ps.protocol import MAX_BATCH_ENTRIES
from tandem.kvstore.ps.transport import MAX_BATCH

Mode = Literal["baseline", "overlap", "p3", "allreduce", "collective"]
MODES: tuple[Mode, ...] = ("baseline", "overlap", "p3", "allreduce", "collective")
SLICED_MODES: tuple[Mode, ...] = ("p3", "collective")  # the modes with a slice size and a water mark to tune
PS_MODES = ("baseline", "overlap", "p3")
# float32 bytes / bytes on the wire, per kind; the kinds whose codes the collective store all-gathers (not summable)
COMPRESSION_RATIO = {"none": 1, **{kind: GradientCompression(kind).ratio for kind in COMPRESSION_KINDS}}
GATHERED = tuple(kind for kind in COMPRESSION_KINDS if not summable(GradientCompression(kind)))
INF = math.inf
# TCP over Ethernet at MTU 1500: a full segment carries 1448 bytes of payload in a 1514-byte frame
# (14 B Ethernet, 20 B IP, 20 B TCP, 12 B TCP timestamps), and a rate limiter (tc tbf) or a NIC's
# rate counts the frame. A physical link also spends 24 B per frame on preamble, gap and checksum
# (1448 / 1538), which this leaves out.
TCP_PAYLOAD_FRACTION = 1448 / 1514


@dataclass(frozen=True)
class Workload:
    """One worker's step, as profiled: segment times, which parameters each segment reads or finishes.

    Parameters are indexed in forward order (``names``); index ``i`` is P3's priority ``-i``.
    """

    names: tuple[str, ...]  # parameter names, forward order
    param_bytes: tuple[int, ...]  # float32 bytes of each parameter
    forward_s: tuple[float, ...]  # seconds of each forward segment
    forward_reads: tuple[tuple[int, ...], ...]  # parameters each forward segment reads
    backward_s: tuple[float, ...]  # seconds of each backward segment
    backward_grads: tuple[tuple[int, ...], ...]  # parameters whose gradient each backward segment finishes
    batch_size: int = 1  # samples per worker per step
    # per forward segment, seconds of a worker's optimizer update of the parameters it reads first: run
    # just before it where the workers update (collective, update_on="workers"; allreduce runs their sum
    # after the last bucket); () for none
    update_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if len(self.names) != len(self.param_bytes):
            raise ValueError(f"{len(self.names)} names but {len(self.param_bytes)} byte counts")
        if len(self.forward_s) != len(self.forward_reads) or len(self.backward_s) != len(self.backward_grads):
            raise ValueError("one list of parameters per segment (forward_reads, backward_grads)")
        if self.update_s and len(self.update_s) != len(self.forward_s):
            raise ValueError(f"update_s: one time per forward segment ({len(self.forward_s)}), got {len(self.update_s)}")
        if any(t < 0 for t in (*self.forward_s, *self.backward_s, *self.update_s)):
            raise ValueError("segment and update times must be >= 0")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def compute_s(self) -> float:
        return sum(self.forward_s) + sum(self.backward_s)

    @property
    def worker_update_s(self) -> float:
        """A worker's optimizer update of every parameter, per step (where the workers update)."""
        return sum(self.update_s)

    @property
    def total_bytes(self) -> int:
        return sum(self.param_bytes)


@dataclass(frozen=True)
class Machine:
    """The hosts' CPUs: costs per message and per byte (measured: ``measure.measure_machine``), cores, placement.

    The defaults are costs measured on a 2-core x86_64 machine (CPU time, not wall time; messages
    authenticated, the update on the servers) and hosts with a core to spare for every thread
    (``cores=inf``), one process per host, with no wake-up fee (one measured on a virtual machine says
    little about a cluster's hosts).
    """

    # a message of one request costs 51 us (worker) and 70 us (server), split into the message and its
    # request by the request's share measured on the same machine (13 % at a worker, 24 % at a server)
    message_s: float = 44e-6  # a worker's CPU per message sent or received
    entry_s: float = 7e-6  # a worker's CPU per request (or reply) a message carries, beyond the message
    byte_s: float = 0.19e-9  # a worker's CPU per byte sent or received (serialise, copy, authenticate)
    server_message_s: float = 53e-6  # a server's CPU per message received or sent
    server_entry_s: float = 17e-6  # a server's CPU per request (or reply) a message carries (the update's slot too)
    server_byte_s: float = 0.18e-9  # a server's CPU per byte received or sent (beyond summing)
    aggregate_Bps: float = 22e9  # float32 bytes/s a server sums (one pass)
    cores: float = INF  # cores per host
    shared_host: bool = False  # every worker and server on one host of ``cores`` (one machine); else one each
    background: float = 0.0  # threads of other work, always runnable, on every host (measure.background_threads)
    # The wake-up fee: a thread that has handled no message for a while pays more CPU for the next one
    # (caches cold after other work or idle cores, the wake-up itself). Points (idle seconds, worker's
    # fee, server's fee), idle seconds increasing; the fee is interpolated linearly from (0, 0, 0) and
    # stays at the last point's beyond it. Empty: no fee (every message costs what a busy thread pays).
    wake: tuple[tuple[float, float, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "wake", tuple(tuple(float(v) for v in point) for point in self.wake))  # from JSON lists
        costs = (self.message_s, self.byte_s, self.server_message_s, self.server_byte_s, self.entry_s, self.server_entry_s)
        if not (all(c >= 0 for c in costs) and self.aggregate_Bps > 0 and self.cores > 0 and self.background >= 0):
            raise ValueError(f"CPU costs and background must be >= 0, aggregate_Bps and cores > 0, got {self}")
        gaps = [point[0] for point in self.wake]
        if (any(len(point) != 3 or min(point) < 0 or not all(map(math.isfinite, point)) for point in self.wake)
                or gaps != sorted(set(gaps)) or 0.0 in gaps):  # fmt: skip
            raise ValueError(f"wake: points (idle seconds > 0, increasing; worker fee >= 0; server fee >= 0; all "
                             f"finite), got {self.wake}")  # fmt: skip

    @property
    def single_message_s(self) -> float:
        """A worker's CPU for a message of one request: what a ring step's send or receive is charged."""
        return self.message_s + self.entry_s

    def wake_s(self, idle_s: float, server: bool = False) -> float:
        """The extra CPU seconds of a message handled by a thread that had handled none for ``idle_s``."""
        side = 2 if server else 1
        previous = (0.0, 0.0, 0.0)
        for point in self.wake:
            if idle_s <= point[0]:
                return previous[side] + (point[side] - previous[side]) * (idle_s - previous[0]) / (point[0] - previous[0])
            previous = point
        return previous[side]

    def describe(self) -> str:
        where = (f"all on one host of {self.cores:g} cores" if self.shared_host
                 else "one host each" + ("" if self.cores == INF else f", {self.cores:g} cores"))  # fmt: skip
        if self.background:
            where += f", {self.background:.1f} threads of other work"
        wake = ", ".join(f"{gap * 1e3:.2g} ms: +{worker * 1e6:.0f} / +{server * 1e6:.0f} us" for gap, worker, server in self.wake)
        return (f"CPU per message {self.message_s * 1e6:.0f} us + {self.entry_s * 1e6:.0f} us per request + "
                f"{self.byte_s * 1e9:.2f} ns/B (servers {self.server_message_s * 1e6:.0f} us + "
                f"{self.server_entry_s * 1e6:.0f} us + {self.server_byte_s * 1e9:.2f} ns/B), servers sum "
                f"{self.aggregate_Bps / 1e9:.1f} GB/s" + (f", after idle ({wake})" if wake else "") + f"; {where}")  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """The machines: ``workers`` and ``servers`` hosts, each NIC ``rate_bps`` bits/s each way, their ``machine``."""

    workers: int
    servers: int
    rate_bps: float
    latency_s: float = 50e-6  # one way, NIC to NIC
    machine: Machine = Machine()
    # server k runs on worker k's host (MXNet's launch.py without -s): they share its NIC (and, with
    # cores, its CPU), and their messages to each other stay on the host (no link, no latency)
    colocated: bool = False
    payload_fraction: float = TCP_PAYLOAD_FRACTION  # of the link's rate that carries message bytes

    def __post_init__(self) -> None:
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"workers must be an int >= 1 (1 to any number), got {self.workers!r}")
        if not (isinstance(self.servers, int) and self.servers >= 0):
            raise ValueError(f"servers must be an int >= 0 (0 only for allreduce and collective), got {self.servers!r}")
        if not self.rate_bps > 0:
            raise ValueError(f"link rate must be > 0 bits/s (e.g. '100mbit', '10gbit'), got {self.rate_bps!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if not 0 < self.payload_fraction <= 1:
            raise ValueError(f"payload_fraction must be in (0, 1], got {self.payload_fraction}")
        if self.colocated and self.servers > self.workers:
            raise ValueError(f"colocated servers run on the workers' hosts: at most {self.workers} servers, "
                             f"got {self.servers}")  # fmt: skip

    @property
    def bytes_per_s(self) -> float:
        """Message bytes a link moves per second, each way (headers take the rest of the rate)."""
        return self.rate_bps / 8 * self.payload_fraction


@dataclass(frozen=True)
class Strategy:
    """How gradients travel: the mode and its knobs."""

    mode: Mode = "p3"
    slice_size: int = 40_000  # elements per slice (p3, collective)
    water_mark: int = 10  # requests in flight per worker (p3), collectives in flight (collective)
    compression: str = "none"  # none, fp16, bf16, int8, int4, 2bit: pushes (and all-reduce) shrink by its ratio
    update_on: Literal["servers", "workers"] = "servers"  # workers: the pulled sums are compressed too
    bucket_bytes: int = 25 * 2**20  # allreduce: DDP's bucket size
    send_bucket_elements: int = -1  # collective: finished gradients a send waits for (-1: one slice; 0: none)
    # collective: sends issued in the order they are made, without rounds (TANDEM_COLLECTIVE_ORDERED=1;
    # a Trainer's p3 agrees in rounds unless its tuner chooses otherwise)
    ordered: bool = field(default_factory=lambda: knob("TANDEM_COLLECTIVE_ORDERED") == "1")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.compression not in COMPRESSION_RATIO:
            raise ValueError(f"compression must be one of {tuple(COMPRESSION_RATIO)}, got {self.compression!r}")
        if self.slice_size < 1 or self.water_mark < 1 or self.bucket_bytes < 1:
            raise ValueError(f"slice_size, water_mark and bucket_bytes must be >= 1, got "
                             f"{self.slice_size}, {self.water_mark}, {self.bucket_bytes}")  # fmt: skip
        if self.update_on not in ("servers", "workers"):
            raise ValueError(f"update_on must be 'servers' or 'workers', got {self.update_on!r}")
        if self.send_bucket_elements < -1:
            raise ValueError(f"send_bucket_elements must be >= -1, got {self.send_bucket_elements}")

    @property
    def label(self) -> str:
        knobs = f" ({self.slice_size // 1000}k, wm {self.water_mark})" if self.mode in SLICED_MODES else ""
        return self.mode + knobs + ("" if self.compression == "none" else f" +{self.compression}")


@dataclass
class Prediction:
    """One simulated configuration: steady-state seconds per iteration and where worker 0's time went."""

    cluster: Cluster
    strategy: Strategy
    iteration_s: float
    compute_s: float
    exposed_s: float  # worker 0 waiting while a message of its own was on the network (a link, its queue, latency)
    idle_s: float  # waiting while none was: CPU per message, the servers' CPU
    samples_per_s: float = 0.0
    sends: list[tuple[float, int, int]] = field(default_factory=list, repr=False)  # worker 0: (time, param, slice)
    notices: int = 0  # RECEIVED notices worker 0 received over the whole simulation (p3)
    replies: list[tuple[float, int, int]] = field(default_factory=list, repr=False)  # worker 0: (time, param, slice)
    worker_cpu_s: float = 0.0  # CPU seconds one worker is charged per iteration (compute + communication; mean)
    server_cpu_s: float = 0.0  # CPU seconds one server is charged per iteration (mean; 0 without servers)

    def row(self) -> dict[str, float | str]:
        return {"mode": self.strategy.label, "samples/s": self.samples_per_s, "ms/iter": self.iteration_s * 1e3,
                "compute ms": self.compute_s * 1e3, "exposed comm ms": self.exposed_s * 1e3,
                "idle ms": self.idle_s * 1e3}  # fmt: skip


def simulate(workload: Workload, cluster: Cluster, strategy: Strategy, iterations: int = 5) -> Prediction:
    """Predict one configuration: ``iterations`` steps, measured between the end of the second and the last."""
    if iterations < 3:
        raise ValueError(f"iterations must be >= 3 (one to fill the pipeline, two to measure), got {iterations}")
    if strategy.mode == "allreduce":
        return _allreduce(workload, cluster, strategy)
    if strategy.mode == "collective":
        return _CollectiveSim(workload, cluster, strategy, iterations).run()
    if cluster.servers < 1:
        raise ValueError(f"mode {strategy.mode!r} needs servers >= 1 (1 to any number), got {cluster.servers}")
    return _PSSim(workload, cluster, strategy, iterations).run()


# -- the event core ----------------------------------------------------------------------------------------


class Events:
    """A clock and a heap of (time, order, action); ``run`` calls actions in time order, ties FIFO."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = 0

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, self._order, action))
        self._order += 1

    def run(self) -> None:
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()


class CPU:
    """A host's ``cores``, shared by processor sharing: while n jobs run beside ``background`` always-runnable
    threads of other work, each progresses at min(1, cores / (n + background)).

    ``run(seconds, done)``: ``seconds`` of one core's work; ``done`` runs when it is finished.
    """

    def __init__(self, events: Events, cores: float = INF, background: float = 0.0) -> None:
        self.events, self.cores, self.background = events, cores, background
        self.jobs: dict[int, list] = {}  # id -> [seconds left, done]
        self.stamp, self.epoch, self.ids = 0.0, 0, 0

    def rate(self) -> float:
        return min(1.0, self.cores / (len(self.jobs) + self.background)) if self.jobs else 1.0

    def run(self, seconds: float, done: Callable[[], None]) -> None:
        if self.cores == INF:  # never shared: the job takes its own time
            self.events.at(self.events.now + seconds, done)
            return
        self._settle()
        self.jobs[self.ids] = [seconds, done]
        self.ids += 1
        self._schedule()

    def _settle(self) -> None:
        """Take the work done since the last change off every running job."""
        now, rate = self.events.now, self.rate()
        for job in self.jobs.values():
            job[0] -= (now - self.stamp) * rate
        self.stamp = now

    def _schedule(self) -> None:
        self.epoch += 1  # an earlier scheduled finish is stale now
        if self.jobs:
            epoch, first = self.epoch, min(job[0] for job in self.jobs.values())
            self.events.at(self.events.now + max(first, 0.0) / self.rate(), lambda: self._finish(epoch))

    def _finish(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self._settle()
        done = [self.jobs.pop(k)[1] for k, job in list(self.jobs.items()) if job[0] <= 1e-12]
        self._schedule()
        for action in done:
            action()


class Resource:
    """One thing that does one job at a time (a thread, one connection's flow on a link): jobs in
    (priority, arrival) order, each run on ``cpu`` (a host's cores, or a link's wire), so a job takes
    longer while that is shared.

    ``put(seconds, done, priority, started)``: ``started`` runs when the job begins, ``done`` when it ends.
    ``wake(idle_seconds)``: extra seconds for a job that finds the resource idle (a thread's wake-up
    fee, ``Machine.wake_s``); a job queued behind another pays none. ``charged``: the seconds put on
    ``cpu`` so far, fees included.
    """

    def __init__(self, events: Events, cpu: CPU, wake: Callable[[float], float] | None = None) -> None:
        self.events, self.cpu, self.wake = events, cpu, wake
        self.busy, self.charged = False, 0.0
        self.idle_since = -INF  # never busy yet: a first job pays the longest wake-up
        self._queue: list[tuple[float, int, float, Callable[[], None], Callable[[], None] | None]] = []
        self._order = 0

    def put(self, seconds: float, done: Callable[[], None], priority: float = 0.0,
            started: Callable[[], None] | None = None) -> None:  # fmt: skip
        heapq.heappush(self._queue, (-priority, self._order, seconds, done, started))
        self._order += 1
        if not self.busy:
            self._next(woken=True)

    def _next(self, woken: bool = False) -> None:
        if not self._queue:
            self.busy, self.idle_since = False, self.events.now
            return
        _, _, seconds, done, started = heapq.heappop(self._queue)
        self.busy = True
        if woken and self.wake is not None:
            seconds += self.wake(self.events.now - self.idle_since)
        self.charged += seconds
        if started is not None:
            started()
        self.cpu.run(seconds, partial(self._finish, done))

    def _finish(self, done: Callable[[], None]) -> None:
        done()
        self._next()


Peer = tuple[str, int]  # ("worker", k) or ("server", k): the other end of a connection


class Link:
    """One direction of a host's NIC: a FIFO per peer (one TCP connection each), the peers' flows sharing
    the wire equally while several have bytes queued, as packets of concurrent connections interleave
    in a NIC's queue (processor sharing: the wire is a ``CPU`` of one core, not the host's cores).

    ``put(peer, seconds, done, started)``: ``seconds`` with the link to itself; ``started`` runs when the
    message's first byte leaves (its flow's earlier messages sent), ``done`` when its last has.
    """

    def __init__(self, events: Events) -> None:
        self.events, self.wire = events, CPU(events, cores=1.0)
        self.flows: dict[Peer, Resource] = {}

    def put(self, peer: Peer, seconds: float, done: Callable[[], None],
            started: Callable[[], None] | None = None) -> None:  # fmt: skip
        if peer not in self.flows:
            self.flows[peer] = Resource(self.events, self.wire)
        self.flows[peer].put(seconds, done, started=started)


# -- the parameter-server modes ----------------------------------------------------------------------------


@dataclass
class _Request:
    worker: int
    param: int
    slice: int
    server: int
    nbytes: float
    reply_bytes: float
    priority: float
    kind: str  # "pushpull", "push" or "pull"
    iteration: int
    capped: bool  # counts against the water mark (p3: a push that is not ``small``)
    opens: bool = False  # the first request of its message: the server pays the message's fixed cost on it
    receipt: bool = False  # asks for a RECEIVED notice should its server park it (p3_sender's rule)
    released: bool = False  # its cap slot is free again: its notice or its reply was received


@dataclass
class _Reply:
    request: _Request
    nbytes: float
    notice: bool = False  # a RECEIVED notice (p3), not the answer


class _ComputeLoop:
    """One worker's compute, as the executor runs it: forward segment k starts once every parameter
    it reads is back from the previous iteration (``gate_all_first``: the first waits for all of
    them, baseline's whole pull), backward segments follow without waiting. ``finished(iteration,
    index)`` is told as each segment ends, before the next one is looked at. Records its waits."""

    def __init__(self, workload: Workload, events: Events, cpu: CPU, iterations: int,
                 finished: Callable[[int, int], None], gate_all_first: bool = False,
                 updates: bool = False) -> None:  # fmt: skip
        self.w, self.events, self.cpu, self.iterations = workload, events, cpu, iterations
        self.finished, self.gate_all_first = finished, gate_all_first
        self.updates = updates and bool(workload.update_s)  # the workers update: before each forward segment, its share
        self.back = [-1] * len(workload.names)  # per parameter, the last iteration fully back
        self.position = (0, 0)  # (iteration, segment index over forward + backward)
        self.computing = False
        self.wait_since: float | None = None
        self.waits: list[tuple[float, float]] = []

    def advance(self) -> None:
        """Start the next segment, unless one runs, the iterations are done or its parameters are not back."""
        iteration, index = self.position
        if self.computing or iteration >= self.iterations:
            return
        w, n_forward = self.w, len(self.w.forward_s)
        if index < n_forward:
            needs = range(len(w.names)) if (self.gate_all_first and index == 0) else w.forward_reads[index]
            if any(self.back[p] < iteration - 1 for p in needs):
                self.wait_since = self.events.now if self.wait_since is None else self.wait_since
                return
            seconds = w.forward_s[index]
            if self.updates and iteration > 0:  # the previous step's sums become its parameters first
                seconds += w.update_s[index]
        else:
            seconds = w.backward_s[index - n_forward]
        if self.wait_since is not None:
            if self.events.now > self.wait_since:
                self.waits.append((self.wait_since, self.events.now))
            self.wait_since = None
        self.computing = True
        self.cpu.run(seconds, partial(self._segment_done, iteration, index))

    def is_last(self, index: int) -> bool:
        return index == len(self.w.forward_s) + len(self.w.backward_s) - 1

    def _segment_done(self, iteration: int, index: int) -> None:
        self.computing = False
        self.position = (iteration + 1, 0) if self.is_last(index) else (iteration, index + 1)
        self.finished(iteration, index)
        self.advance()


class _PSSim:
    def __init__(self, workload: Workload, cluster: Cluster, strategy: Strategy, iterations: int) -> None:
        self.w, self.c, self.s, self.iterations = workload, cluster, strategy, iterations
        self.events = Events()
        ev, rate = self.events, cluster.bytes_per_s
        self.rate = rate
        numel = [b // 4 for b in workload.param_bytes]
        placement = (RoundRobinPlacement(cluster.servers, strategy.slice_size) if strategy.mode == "p3"
                     else RangePlacement(cluster.servers))  # fmt: skip
        self.slices: list[list[Slice]] = [placement.plan(name, n) for name, n in zip(workload.names, numel)]
        n_workers, machine = cluster.workers, cluster.machine
        self.m = machine
        cores, background = machine.cores, machine.background
        shared = CPU(ev, cores, background)  # shared_host: one host runs every process
        self.cpu = [shared if machine.shared_host else CPU(ev, cores, background) for _ in range(n_workers)]
        server_cpus = [shared if machine.shared_host else self.cpu[k] if cluster.colocated else CPU(ev, cores, background)
                       for k in range(cluster.servers)]  # fmt: skip
        self.uplink = [Link(ev) for _ in range(n_workers)]
        self.downlink = [Link(ev) for _ in range(n_workers)]
        worker_wake, server_wake = partial(machine.wake_s, server=False), partial(machine.wake_s, server=True)
        self.sender = [Resource(ev, self.cpu[w], worker_wake) for w in range(n_workers)]  # the worker's sender thread
        self.receiver = [Resource(ev, self.cpu[w], worker_wake) for w in range(n_workers)]  # the worker's IO thread
        colocated = cluster.colocated
        self.server_up = [self.uplink[k] if colocated else Link(ev) for k in range(cluster.servers)]
        self.server_down = [self.downlink[k] if colocated else Link(ev) for k in range(cluster.servers)]
        self.server_cpu = [Resource(ev, cpu, server_wake) for cpu in server_cpus]  # the server's thread
        self.queued: list[list[tuple[float, int, _Request]]] = [[] for _ in range(n_workers)]  # send queues
        self.order = 0
        self.in_flight = [0] * n_workers  # capped requests not released
        self.receipts = [0] * n_workers  # of those, how many asked for a RECEIVED notice
        self.water_mark = strategy.water_mark if strategy.mode == "p3" else INF
        self.coalesce_bytes = knob("TANDEM_PS_COALESCE_BYTES")  # 0: every request its own message
        self.rounds: dict[tuple[int, int, int], list[_Request]] = {}  # (param, slice, iteration) -> arrived
        self.done_rounds: set[tuple[int, int, int]] = set()
        self.waiting_pulls: dict[tuple[int, int, int], list[_Request]] = {}
        self.inbox: list[list[list[_Request]]] = [[] for _ in range(cluster.servers)]  # messages landed, not polled
        self.polling = [False] * cluster.servers  # the server's loop is serving a poll's requests
        self.held: list[dict[int, list[_Reply]]] = [{} for _ in range(cluster.servers)]  # per worker, until flushed
        self.missing = [[0] * len(workload.names) for _ in range(n_workers)]  # slices not back, per param
        self.loops = [_ComputeLoop(workload, ev, self.cpu[w], iterations, partial(self.segment_done, w),
                                   gate_all_first=strategy.mode == "baseline",
                                   updates=_updates_on_workers(strategy))
                      for w in range(n_workers)]  # fmt: skip
        self.backward_end: list[float] = []  # worker 0, per iteration
        self.sends: list[tuple[float, int, int]] = []
        self.replies: list[tuple[float, int, int]] = []  # worker 0's answers received: (time, param, slice)
        self.notices = 0  # worker 0's
        self.network: list[tuple[float, float]] = []  # worker 0's messages between leaving and landing

    def segment_done(self, worker: int, iteration: int, index: int) -> None:
        w, n_forward = self.w, len(self.w.forward_s)
        last = self.loops[worker].is_last(index)
        if index >= n_forward:
            if self.s.mode != "baseline":
                # p3: the segment's gradients are queued together, then leave (the trainer's batched());
                # overlap: one pushpull call per gradient
                together = self.s.mode == "p3"
                for p in w.backward_grads[index - n_forward]:
                    self.send_gradient(worker, p, iteration, "pushpull", pump=not together)
                if together:
                    self.pump(worker)
            elif last:
                for kind in ("push", "pull"):  # push everything in one call, then pull everything in one
                    for p in range(len(w.names)):
                        self.send_gradient(worker, p, iteration, kind, pump=False)
                    self.pump(worker)
        if last and worker == 0:
            self.backward_end.append(self.events.now)

    # requests
    def send_gradient(self, worker: int, param: int, iteration: int, kind: str, pump: bool = True) -> None:
        ratio = COMPRESSION_RATIO[self.s.compression]
        p3 = self.s.mode == "p3"
        priority = -param if p3 else 0
        if kind != "push":
            self.missing[worker][param] = len(self.slices[param])
        for i, part in enumerate(self.slices[param]):
            nbytes = 0.0 if kind == "pull" else part.numel * 4 / ratio
            reply = 0.0 if kind == "push" else part.numel * 4 / (ratio if self.s.update_on == "workers" else 1)
            capped = p3 and kind != "pull" and not small(part.numel, self.s.slice_size)
            request = _Request(worker, param, i, part.server, nbytes, reply, priority, kind, iteration, capped)
            heapq.heappush(self.queued[worker], (-priority, self.order, request))
            self.order += 1
        if pump:
            self.pump(worker)

    def pump(self, worker: int) -> None:
        """The sender (``p3_sender``): while the queue's head fits under the water mark (small requests
        always fit), or the cap is full but none in flight asked for a notice (one more then), a group
        leaves: the head and those behind it that fit. Only then are their slots taken, each asking
        for a notice if it fills the cap or requests still queue behind the group. A group goes to each
        server in as few messages as the client's grouping makes (``grouped``: TANDEM_PS_COALESCE_BYTES
        each; one message_s per message)."""
        queue, fits = self.queued[worker], lambda r, held: not r.capped or held < self.water_mark
        while queue and (fits(queue[0][2], self.in_flight[worker]) or not self.receipts[worker]):
            leaving = [heapq.heappop(queue)[2]]
            held = self.in_flight[worker] + leaving[0].capped
            while queue and fits(queue[0][2], held):
                leaving.append(heapq.heappop(queue)[2])
                held += leaving[-1].capped
            for request in leaving:  # p3_sender._hold, once the group has left the queue
                if request.capped:
                    self.in_flight[worker] += 1
                    request.receipt = self.in_flight[worker] >= self.water_mark or bool(queue)
                    self.receipts[worker] += request.receipt
            for message in grouped(leaving, self.coalesce_bytes, lambda r: r.server, lambda r: r.nbytes):
                self._send_message(worker, message)

    def _send_message(self, worker: int, requests: list[_Request]) -> None:
        requests[0].opens = True
        cost = self.m.message_s + len(requests) * self.m.entry_s + sum(r.nbytes for r in requests) * self.m.byte_s
        self.sender[worker].put(cost, lambda: self.transmit(requests))

    def transmit(self, requests: list[_Request]) -> None:
        """One message of ``requests`` from their worker to their server: it lands whole (the server's
        transport reads whole messages), after the worker's uplink and the server's downlink."""
        worker, server = requests[0].worker, requests[0].server
        sent = self.events.now
        if worker == 0:
            self.sends.extend((sent, request.param, request.slice) for request in requests)

        def landed() -> None:
            self.on_network(worker, sent)
            self.arrived(server, requests)

        if self.c.colocated and worker == server:  # on the host: no link
            landed()
            return
        self.cross(self.uplink[worker], ("worker", worker), self.server_down[server], ("server", server),
                   sum(r.nbytes for r in requests), landed)  # fmt: skip

    def cross(self, up: Link, sender: Peer, down: Link, receiver: Peer, nbytes: float,
              landed: Callable[[], None]) -> None:  # fmt: skip
        """A message over the sender's uplink and the receiver's downlink, cut-through: its head reaches
        the downlink ``latency`` after it starts leaving; it lands once its last byte has left the
        uplink (plus latency) and crossed the downlink, the later of the two. The two ends are not
        rate-coupled (no max-min fairness): each charges its link the message's whole time at its own
        share, so the slower end sets the landing and each link's busy time is right, but a flow held
        back at one end still takes its full share at the other."""
        seconds, ends_left = nbytes / self.rate, 2

        def one_end_done() -> None:
            nonlocal ends_left
            ends_left -= 1
            if ends_left == 0:
                landed()

        def head_arrives() -> None:
            down.put(sender, seconds, one_end_done)

        up.put(receiver, seconds, lambda: self.events.at(self.events.now + self.c.latency_s, one_end_done),
               started=lambda: self.events.at(self.events.now + self.c.latency_s, head_arrives))  # fmt: skip

    # the server: a loop that takes every request arrived so far (a poll), serves them one by one, then
    # sends the replies it held (server.Server.serve)
    def arrived(self, server: int, requests: list[_Request]) -> None:
        self.inbox[server].append(requests)
        if not self.polling[server]:
            self.poll(server)

    def poll(self, server: int) -> None:
        """Take the messages landed so far, whole, until they hold ``MAX_BATCH`` requests (transport's poll);
        p3 serves their requests by priority, ties in arrival order (``p3.PriorityReceive``), the plain
        server in arrival order. Idle once nothing waits."""
        inbox, batch = self.inbox[server], list[_Request]()
        while inbox and len(batch) < MAX_BATCH:
            batch.extend(inbox.pop(0))
        self.polling[server] = bool(batch)
        if self.s.mode == "p3":
            batch.sort(key=lambda request: -request.priority)  # stable
        if batch:
            self.serve(server, batch, 0)

    def serve(self, server: int, batch: list[_Request], index: int) -> None:
        """Serve ``batch[index]`` (receive and sum its bytes; the first of a message receives the message),
        then the rest; at the end, flush and poll again."""
        if index == len(batch):
            self.flush(server, lambda: self.poll(server))
            return
        request, m = batch[index], self.m
        cost = (request.opens * m.server_message_s + m.server_entry_s + request.nbytes * m.server_byte_s
                + request.nbytes / m.aggregate_Bps)  # fmt: skip
        self.server_cpu[server].put(cost, lambda: self.served(request, lambda: self.serve(server, batch, index + 1)))

    def served(self, request: _Request, then: Callable[[], None]) -> None:
        """The round logic of one request; its replies (and the round's update) cost the server's thread
        before ``then`` serves the next request."""
        key = (request.param, request.slice, request.iteration)
        if request.kind == "pull":
            if key in self.done_rounds:
                self.answer([_Reply(request, request.reply_bytes)], then)
            else:
                self.waiting_pulls.setdefault(key, []).append(request)
                then()
            return
        ack = [_Reply(request, 0.0)] if request.kind == "push" else []  # acknowledged at once (server._push)
        arrived = self.rounds.setdefault(key, [])
        arrived.append(request)
        if len(arrived) < self.c.workers:
            if request.receipt:  # parked: the worker learns at once that it arrived (p3.P3Server._pushpull)
                self.answer([_Reply(request, 0.0, notice=True)], then)
            else:
                self.answer(ack, then)
            return
        del self.rounds[key]
        update = self.slices[request.param][request.slice].numel * 4 / self.m.aggregate_Bps  # one pass over the sum

        def round_done() -> None:
            self.done_rounds.add(key)
            waiting = arrived if request.kind == "pushpull" else self.waiting_pulls.pop(key, [])
            self.answer([_Reply(r, r.reply_bytes) for r in waiting] + ack, then)  # _merge answers, then _push acks

        self.server_cpu[request.server].put(update, round_done)

    def answer(self, replies: list[_Reply], then: Callable[[], None]) -> None:
        """Send ``replies``, then ``then``. The plain server holds replies per worker until its poll ends
        (``flush``) or they reach ``TANDEM_PS_COALESCE_BYTES`` (transport.ServerTransport.reply); the P3
        server sends each at once, and notices always go at once."""
        for index, reply in enumerate(replies):  # a loop, not a call per reply: thousands of workers' replies
            worker, server = reply.request.worker, reply.request.server
            if reply.notice or self.s.mode == "p3" or self.coalesce_bytes <= 0:
                self.send_replies(server, worker, [reply], partial(self.answer, replies[index + 1 :], then))
                return
            held = self.held[server].setdefault(worker, [])
            total = sum(r.nbytes for r in held) + reply.nbytes
            if held and total > self.coalesce_bytes:
                self.send_replies(server, worker, self.held[server].pop(worker), partial(self.answer, replies[index:], then))
                return
            held.append(reply)
            if total >= self.coalesce_bytes or len(held) == MAX_BATCH_ENTRIES:
                self.send_replies(server, worker, self.held[server].pop(worker), partial(self.answer, replies[index + 1 :], then))
                return
        then()

    def flush(self, server: int, then: Callable[[], None]) -> None:
        """The end of a poll: each worker's held replies leave, one message per worker."""
        if not self.held[server]:
            then()
            return
        worker = next(iter(self.held[server]))
        self.send_replies(server, worker, self.held[server].pop(worker), lambda: self.flush(server, then))

    def send_replies(self, server: int, worker: int, replies: list[_Reply], then: Callable[[], None]) -> None:
        """One message (a BATCH if several replies): the server's thread (server_message_s + replies x
        server_entry_s + bytes x server_byte_s), its uplink, the worker's downlink and IO thread
        (message_s + replies x entry_s + bytes x byte_s), then each reply takes effect; ``then`` runs
        once the server's thread has sent it."""
        nbytes = sum(r.nbytes for r in replies)

        def received() -> None:
            for reply in replies:
                if reply.notice:
                    self.noticed(reply.request)
                elif reply.request.kind != "push":  # a push's acknowledgement only costs its message
                    self.received(reply.request)

        def sent() -> None:
            self.to_worker(server, worker, nbytes, len(replies), received)
            then()

        m = self.m
        self.server_cpu[server].put(m.server_message_s + len(replies) * m.server_entry_s + nbytes * m.server_byte_s, sent)

    def to_worker(self, server: int, worker: int, nbytes: float, entries: int, received: Callable[[], None]) -> None:
        """A message of ``entries`` replies (or a RECEIVED notice of no bytes), ``nbytes`` in all, from
        ``server`` to ``worker``: the server's uplink, the worker's downlink, its IO thread."""
        sent = self.events.now

        def landed() -> None:
            self.on_network(worker, sent)
            self.receiver[worker].put(self.m.message_s + entries * self.m.entry_s + nbytes * self.m.byte_s, received)

        if self.c.colocated and worker == server:  # on the host: no link
            landed()
            return
        self.cross(self.server_up[server], ("server", server), self.downlink[worker], ("worker", worker), nbytes,
                   landed)  # fmt: skip

    def on_network(self, worker: int, since: float) -> None:
        """A message of ``worker`` was on the network (links, their queues, latency) from ``since`` until now."""
        if worker == 0:
            self.network.append((since, self.events.now))

    def noticed(self, request: _Request) -> None:
        self.notices += request.worker == 0
        self.release(request)

    def release(self, request: _Request) -> None:
        """A capped request's slot is free again: its notice or its reply was received, the first of them."""
        if not request.capped or request.released:
            return
        request.released = True
        self.in_flight[request.worker] -= 1
        self.receipts[request.worker] -= request.receipt
        self.pump(request.worker)

    def received(self, request: _Request) -> None:
        if request.worker == 0:
            self.replies.append((self.events.now, request.param, request.slice))
        self.release(request)
        worker, param = request.worker, request.param
        self.missing[worker][param] -= 1
        if self.missing[worker][param] == 0:
            self.loops[worker].back[param] = request.iteration
            self.loops[worker].advance()

    def run(self) -> Prediction:
        for loop in self.loops:
            loop.advance()
        self.events.run()
        iteration_s, measured, waits = _steady_state(self.backward_end, self.loops[0].waits)
        links = _union(self.network)
        waited = sum(b - a for a, b in waits) / measured
        exposed = sum(_overlap(a, b, links) for a, b in waits) / measured
        found = _prediction(self.w, self.c, self.s, iteration_s, exposed, waited - exposed, self.sends, self.notices)
        found.replies = self.replies
        per_worker = self.iterations * self.c.workers  # every iteration moves every gradient once, so totals divide
        found.worker_cpu_s = found.compute_s + sum(t.charged for t in self.sender + self.receiver) / per_worker
        found.server_cpu_s = sum(t.charged for t in self.server_cpu) / (self.iterations * self.c.servers)
        return found


def _steady_state(ends: list[float], waits: list[tuple[float, float]]) -> tuple[float, int, list[tuple[float, float]]]:
    """Seconds per iteration between the end of the second backward and the last, how many iterations
    that window holds, and the compute's waits clipped to it (the first iteration fills the pipeline)."""
    measured = len(ends) - 2
    start, end = ends[1], ends[-1]
    return (end - start) / measured, measured, [(max(a, start), min(b, end)) for a, b in waits if b > start and a < end]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(start: float, end: float, merged: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged)


def _prediction(workload: Workload, cluster: Cluster, strategy: Strategy, iteration_s: float, exposed: float,
                idle: float, sends: list[tuple[float, int, int]] | None = None, notices: int = 0) -> Prediction:  # fmt: skip
    samples = cluster.workers * workload.batch_size / iteration_s if iteration_s > 0 else INF
    return Prediction(cluster, strategy, iteration_s, _compute_s(workload, strategy), exposed, max(idle, 0.0),
                      samples, sends or [], notices)  # fmt: skip


def _updates_on_workers(strategy: Strategy) -> bool:
    """Whether each worker runs the optimizer (on the summed gradients) rather than the servers."""
    return strategy.mode in ("allreduce", "collective") or strategy.update_on == "workers"


def _compute_s(workload: Workload, strategy: Strategy) -> float:
    """A worker's compute per step: its segments, and its optimizer update where the workers update."""
    return workload.compute_s + (workload.worker_update_s if _updates_on_workers(strategy) else 0.0)


# -- collective all-reduce ---------------------------------------------------------------------------------


def _ring_steps(nbytes: float, workers: int, gather: bool = False) -> tuple[int, float]:
    """A ring collective's steps and the bytes each link moves over them: an all-reduce of ``nbytes``
    takes 2(W-1) steps of nbytes/W; an all-gather of every worker's ``nbytes`` W-1 steps of nbytes."""
    if gather:
        return workers - 1, (workers - 1) * nbytes
    steps = 2 * (workers - 1)
    return steps, steps / workers * nbytes


def _ring_seconds(nbytes: float, cluster: Cluster, gather: bool) -> float:
    steps, moved = _ring_steps(nbytes, cluster.workers, gather)
    return moved / cluster.bytes_per_s + steps * (cluster.latency_s + 2 * cluster.machine.single_message_s)


def allreduce_seconds(nbytes: float, cluster: Cluster) -> float:
    """A ring all-reduce of ``nbytes`` over ``workers``: 2(W-1) steps, each moving nbytes/W on every link."""
    return _ring_seconds(nbytes, cluster, gather=False)


def allgather_seconds(nbytes: float, cluster: Cluster) -> float:
    """A ring all-gather of every worker's ``nbytes``: W-1 steps, each moving nbytes on every link."""
    return _ring_seconds(nbytes, cluster, gather=True)


def _allreduce(workload: Workload, cluster: Cluster, strategy: Strategy) -> Prediction:
    """DDP's schedule: buckets fill in backward order and are all-reduced one at a time as they fill;
    the next forward waits for all of them. Steady state is one forward + backward + the exposed tail."""
    ratio = COMPRESSION_RATIO[strategy.compression]
    clock, busy_until, pending, ready_at = sum(workload.forward_s), 0.0, 0.0, 0.0
    buckets: list[tuple[float, float]] = []  # (ready time, bytes)
    for seconds, grads in zip(workload.backward_s, workload.backward_grads):
        clock += seconds
        for p in grads:
            pending += workload.param_bytes[p] / ratio
            ready_at = clock
            if pending >= strategy.bucket_bytes:
                buckets.append((ready_at, pending))
                pending = 0.0
    if pending:
        buckets.append((ready_at, pending))
    for ready, nbytes in buckets:
        busy_until = max(busy_until, ready) + allreduce_seconds(nbytes, cluster)
    exposed = max(0.0, busy_until - clock)
    # then the optimizer step (DDP: every worker, once every bucket is reduced), before the next forward
    return _prediction(workload, cluster, strategy, clock + exposed + workload.worker_update_s, exposed, 0.0)


class _CollectiveSim:
    """tandem's collective kvstore (``kvstore/collective/scheduler.py``) on identical workers, so one
    worker stands for all: they submit, agree and issue alike, and a collective completes everywhere
    at once. Backward segments' gradients are submitted together once ``send_bucket_elements`` of
    them (by default one slice's worth) are finished, the rest at the end of backward. A round (an
    all-reduce of a few integers, one at a time) agrees on them and on the completions so far, then
    issues from the priority queue while fewer than ``water_mark`` collectives are in flight (one
    where none is). ``ordered``: each send's slices, by priority, are issued after the earlier
    sends' under the same cap, without rounds.
    The ring runs one collective at a time (gloo's process group has two threads: a latency-bound
    collective can overlap the next, which this does not model). In rounds, a completion with slices
    still queued asks for a round.

    A collective (a round too) takes ``allreduce_seconds`` on the ring and its worker's CPU ``2 (W-1)``
    steps of a send and a receive (``single_message_s`` each, ``byte_s`` per byte); fp16 and bf16
    slices are all-reduced in 16 bits, int8, int4 and 2-bit codes all-gathered (``allgather_seconds``, ``W-1`` steps). It ends
    once both are done. That CPU shares the worker's cores with its compute (``CPU``; on a shared
    host each worker has ``cores / W`` of them), so communication slows compute where cores are
    few. Every wait of the compute is exposed communication (``idle_s`` is 0): rounds, the ring and
    the CPU they take."""

    def __init__(self, workload: Workload, cluster: Cluster, strategy: Strategy, iterations: int) -> None:
        self.w, self.c, self.s, self.iterations = workload, cluster, strategy, iterations
        self.events = Events()
        self.ratio = COMPRESSION_RATIO[strategy.compression]
        size = strategy.slice_size
        self.slices = [[min(size, b // 4 - start) for start in range(0, b // 4, size)] for b in workload.param_bytes]
        machine = cluster.machine
        share = cluster.workers if machine.shared_host else 1  # identical workers split a shared host evenly
        self.cpu = CPU(self.events, machine.cores / share, machine.background / share)
        self.ring: deque[list[tuple[int, int, int]]] = deque()  # issued, waiting for the ring
        self.ring_busy = False
        self.submitted: list[tuple[int, int, int]] = []  # (param, slice, iteration) sent, not yet agreed (or queued: ordered)
        self.bucket: list[int] = []  # finished gradients (params) the trainer holds until a slice's worth
        self.bucket_numel = 0
        self.queue: list[tuple[int, int, int, int]] = []  # heap of (param, slice, order, iteration): -param is the priority
        self.calls: deque[list[tuple[int, int, int, int]]] = deque()  # ordered: each send's heap, in submission order
        self.order = 0
        self.in_flight, self.completed_unseen = 0, 0  # issued, not yet freed (ordered: by its completion; else by a round); completed since the last round
        self.rounding = False
        self.missing = [0] * len(workload.names)
        self.loop = _ComputeLoop(workload, self.events, self.cpu, iterations, self.segment_done,
                                 updates=_updates_on_workers(strategy))
        self.backward_end: list[float] = []
        self.sends: list[tuple[float, int, int]] = []
        self.charged = 0.0  # CPU seconds of this worker's collectives

    def collective(self, nbytes: float, done: Callable[[], None], gather: bool = False) -> None:
        """An all-reduce of ``nbytes`` (``gather``: an all-gather of each worker's ``nbytes``): ``done``
        once the ring's time has passed and this worker's CPU for it is spent."""
        machine = self.c.machine
        steps, moved = _ring_steps(nbytes, self.c.workers, gather)
        cpu_s = steps * 2 * machine.single_message_s + 2 * moved * machine.byte_s  # each step a send and a receive
        seconds = _ring_seconds(nbytes, self.c, gather)
        left = [2]

        def part() -> None:
            left[0] -= 1
            if left[0] == 0:
                done()

        self.events.at(self.events.now + seconds, part)
        self.charged += cpu_s
        self.cpu.run(cpu_s, part)

    def segment_done(self, iteration: int, index: int) -> None:
        n_forward = len(self.w.forward_s)
        if index >= n_forward:
            grads = self.w.backward_grads[index - n_forward]
            self.bucket += grads
            self.bucket_numel += sum(sum(self.slices[param]) for param in grads)
            # the trainer's send bucket (TANDEM_SEND_BUCKET_ELEMENTS), the rest when backward ends
            bucket = self.s.slice_size if self.s.send_bucket_elements < 0 else self.s.send_bucket_elements
            if self.bucket_numel >= bucket or self.loop.is_last(index):
                for param in self.bucket:  # kv.batched(): one send (one round sees them all)
                    self.missing[param] = len(self.slices[param])
                    self.submitted.extend((param, number, iteration) for number in range(len(self.slices[param])))
                    if not self.slices[param]:  # nothing to sum (the store skips empty tensors)
                        self.loop.back[param] = iteration
                self.bucket, self.bucket_numel = [], 0
            if self.s.ordered and self.submitted:
                call = [(param, number, order, iteration)
                        for order, (param, number, iteration) in enumerate(self.submitted, self.order)]  # fmt: skip
                self.order += len(call)
                heapq.heapify(call)
                self.calls.append(call)
                self.submitted = []
                self.issue_ordered()
            elif self.submitted:  # a segment that sends no gradient has nothing to agree on
                self.round()
        if self.loop.is_last(index):
            self.backward_end.append(self.events.now)

    def round(self) -> None:
        """Start a round unless one runs (its end looks whether there is something new to agree on)."""
        if self.rounding:
            return
        self.rounding, agreed, seen = True, self.submitted, self.completed_unseen
        self.submitted, self.completed_unseen = [], 0

        def agreed_now() -> None:
            self.rounding = False
            for param, number, iteration in agreed:
                heapq.heappush(self.queue, (param, number, self.order, iteration))
                self.order += 1
            self.in_flight -= seen  # the completions this round saw free their credit
            while self.queue and self.under_credit():
                self.issue()
            if self.submitted or (self.queue and self.completed_unseen):  # the scheduler's _wants_round
                self.round()

        self.collective(0.0, agreed_now)

    def under_credit(self) -> bool:
        """One more collective may be issued: fewer than ``water_mark`` in flight, or none."""
        return self.in_flight < self.s.water_mark or self.in_flight == 0

    def issue_ordered(self) -> None:
        while self.calls and self.under_credit():
            self.issue(self.calls[0])
            if not self.calls[0]:
                self.calls.popleft()

    def issue(self, queue: list[tuple[int, int, int, int]] | None = None) -> None:
        """The next collective: the head of the queue (the round's, or an ordered send's), fused with the
        slices behind it while they fit in one slice."""
        queue = self.queue if queue is None else queue
        param, number, _, iteration = heapq.heappop(queue)
        unit, numel = [(param, number, iteration)], self.slices[param][number]
        while queue and numel + self.slices[queue[0][0]][queue[0][1]] <= self.s.slice_size:
            following, following_number, _, following_iteration = heapq.heappop(queue)
            unit.append((following, following_number, following_iteration))
            numel += self.slices[following][following_number]
        self.in_flight += 1
        self.sends.extend((self.events.now, p, n) for p, n, _ in unit)
        self.ring.append(unit)
        self.next_on_ring()

    def next_on_ring(self) -> None:
        if self.ring and not self.ring_busy:
            self.ring_busy, unit = True, self.ring.popleft()
            numel = sum(self.slices[param][number] for param, number, _ in unit)
            self.collective(numel * 4 / self.ratio, partial(self.complete, unit), gather=self.s.compression in GATHERED)

    def complete(self, unit: list[tuple[int, int, int]]) -> None:
        self.ring_busy = False
        self.next_on_ring()
        for param, _, iteration in unit:
            self.missing[param] -= 1
            if self.missing[param] == 0:
                self.loop.back[param] = iteration
        if self.s.ordered:  # this worker's own credit: no round
            self.in_flight -= 1
            self.issue_ordered()
        else:
            self.completed_unseen += 1
            if self.queue:
                self.round()
        self.loop.advance()

    def run(self) -> Prediction:
        self.loop.advance()
        self.events.run()
        iteration_s, measured, waits = _steady_state(self.backward_end, self.loop.waits)
        waited = sum(b - a for a, b in waits) / measured
        found = _prediction(self.w, self.c, self.s, iteration_s, waited, 0.0, self.sends)
        found.worker_cpu_s = found.compute_s + self.charged / self.iterations
        return found
