"""KVStore throughput on loopback: push+pull of one tensor, beside a raw ZeroMQ echo and a gloo allreduce.

Cases, all measured in one run and interleaved round by round (median of --runs rounds):
- raw zmq: send N bytes to an echo process (DEALER -> ROUTER) and receive them back, zero-copy;
- raw zmq push+pull: the least a push then a pull can do over ZeroMQ from Python: a tagged push
  the peer keeps and acknowledges, then a pull answered with it, received into ``out``;
- minimal worker: a kvstore server process driven by the least a worker can do from Python: a
  DEALER that says hello, then sends pre-encoded push and pull headers and receives the pull's
  value into ``out`` on the calling thread (no IO thread, no handles, no per-request encoding).
  It separates the server's cost from the worker's. With ``TANDEM_PS_SECRET`` set (every case then
  runs with it) it also seals each request under its session and checks each reply's tag;
- kvstore 1s / 2s: a ``dist_sync`` store with one worker (this process) and 1 or 2 server
  processes: ``push`` then ``pull`` of an N-byte float32 tensor (the result copied into ``out``);
  ``pushpull`` (one message each way) is shown too;
- gloo: ``torch.distributed.all_reduce`` of N bytes between this process and one helper.
Throughput is N / (time of one round trip); every case moves N bytes out and N bytes back.
Arrays of >= 1M elements (4 MB) are split over the servers, as ps-lite does.

Reproduce: .venv/bin/python bench/kvstore.py  (options: --runs, --sizes; see --help)
Writes bench/out/kvstore.png and bench/out/kvstore.md.

``--step`` (Linux) instead measures one training-like step of many small messages: a ``pushpull``
of ``--keys`` keys of ``--key-bytes`` each (dist_sync, 1 and 2 servers), and of one tensor that
``dist_p3`` cuts into as many slices (2 servers): wall time, messages per step (both directions,
counted at the worker), and the CPU of the worker and of the servers per step and per slice
(``TANDEM_PS_COALESCE_BYTES=0`` sends every slice as its own message; ``--coalesce-bytes 0 262144``
runs both, interleaved). Writes bench/out/kvstore_step.md.

``--cpu`` (Linux) instead says where the time of one operation goes: per case, the CPU that the
caller's and the peer's threads spent per operation (``/proc/<pid>/task/*/schedstat``), split into
libzmq's IO threads and the interpreter's threads. Writes bench/out/kvstore_cpu.md.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import bar_plot, command_line, interleaved_medians, markdown_table, write_report  # noqa: E402
from tandem.kvstore.config import DistOptions, P3Options  # noqa: E402
from tandem.kvstore.ps.auth import Session, attempt_key, handshake_tag, new_nonce  # noqa: E402
from tandem.kvstore.ps.curve import password_of, present_password  # noqa: E402
from tandem.kvstore.ps.p3 import P3KVStore  # noqa: E402
from tandem.kvstore.ps.protocol import (  # noqa: E402
    Command,
    Header,
    Role,
    decode_header,
    encode_header,
    seal,
    split_tag,
    tensor_bytes,
)
from tandem.kvstore.ps.server import hello_info  # noqa: E402
from tandem.kvstore.ps.topology import Topology, restart_count, server_addresses  # noqa: E402
from tandem.kvstore.ps.transport import ZERO_COPY_BYTES, payload_size  # noqa: E402
from tandem.kvstore.ps.worker import DistKVStore  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
TARGET_SECONDS = 0.15  # per case per round: enough repetitions to average out timer noise


def _child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_NUM_THREADS": "1", **extra}


def echo_main(port_file: str) -> None:
    """Child: echo every multipart message back to its sender, zero-copy."""
    socket = zmq.Context().socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    Path(port_file).write_text(str(port))
    while True:
        frames = socket.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            return
        socket.send_multipart(frames, copy=False)


def store_main(port_file: str) -> None:
    """Child: a bare push/pull peer: keeps each pushed frame (acknowledged), answers pulls with it."""
    socket = zmq.Context().socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    Path(port_file).write_text(str(port))
    kept = zmq.Frame(b"")
    while True:
        peer, tag, *payload = socket.recv_multipart(copy=False)
        if tag.bytes == b"stop":
            return
        if tag.bytes == b"push":
            kept = payload[0]
            socket.send_multipart([peer, b"ack"], copy=False)
        else:
            socket.send_multipart([peer, b"value", kept], copy=False)


def gloo_main(port: int) -> None:
    """Child: rank 1 of a gloo group; runs as many all_reduces of as many bytes as rank 0 announces."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
    order = torch.zeros(2, dtype=torch.int64)
    while True:
        dist.broadcast(order, src=0)
        nbytes, count = int(order[0]), int(order[1])
        if nbytes == 0:
            break
        data = torch.ones(nbytes // 4)
        for _ in range(count):
            dist.all_reduce(data)
    dist.destroy_process_group()


class Processes:
    """Children of the benchmark; all stopped at exit."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], env: dict[str, str]) -> int:
        """Start a child; returns its pid."""
        self.children.append(subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT))
        return self.children[-1].pid

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            child.wait(timeout=10)


def raw_peer(processes: Processes, tmp: Path, role: str) -> tuple[zmq.Socket, int]:
    """A DEALER connected to a new ``echo_main`` or ``store_main`` child (``role``), and its pid."""
    port_file = tmp / f"{role}-{os.getpid()}.port"
    port_file.unlink(missing_ok=True)
    pid = processes.start([__file__, "--child", role, str(port_file)], _child_env())
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {role} process did not start within 60 s")
        time.sleep(0.05)
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(f"tcp://127.0.0.1:{port_file.read_text()}")
    return socket, pid


def raw_round_trip(socket: zmq.Socket) -> Callable[[memoryview], None]:
    def round_trip(payload: memoryview) -> None:
        socket.send(payload, 0, payload.nbytes < ZERO_COPY_BYTES)
        socket.recv(copy=False)

    return round_trip


def raw_push_pull(socket: zmq.Socket, push: bytes = b"push", pull: bytes = b"pull") -> Callable[[memoryview, memoryview], None]:
    """A push (first frame ``push``, then the payload) and a pull (``pull``); the pull's value lands in ``out``."""

    def push_pull(payload: memoryview, out: memoryview) -> None:
        socket.send(push, zmq.SNDMORE)
        socket.send(payload, 0, payload.nbytes < ZERO_COPY_BYTES)
        socket.send(pull)
        socket.recv()  # the push's acknowledgement
        socket.recv()  # the pull's first frame; its value follows, received in place as a kvstore pull is
        socket.recv_into(out)

    return push_pull


def server_job(processes: Processes, servers: int, kind: str = "dist_sync",
               **env: str) -> tuple[Topology, dist.TCPStore, list[int]]:  # fmt: skip
    """``servers`` server processes (pids) of a ``kind`` job whose only worker is this process."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    child = _child_env(TANDEM_NUM_WORKERS="1", TANDEM_NUM_SERVERS=str(servers), TANDEM_MASTER_ADDR="127.0.0.1",
                       TANDEM_MASTER_PORT=str(store.port), TANDEM_ROLE="server", **env)  # fmt: skip
    pids = [processes.start(["-m", "tandem.kvstore.ps", "--kind", kind], {**child, "TANDEM_RANK": str(rank)})
            for rank in range(servers)]  # fmt: skip
    return Topology("worker", 0, 1, servers, "127.0.0.1", store.port, servers + 1), store, pids


def kvstore_job(processes: Processes, servers: int) -> tuple[DistKVStore, dist.TCPStore, list[int]]:
    """This process as the only worker of a dist_sync job with ``servers`` server processes (pids)."""
    topology, store, pids = server_job(processes, servers)
    return DistKVStore(topology, DistOptions.from_env("dist_sync")), store, pids


class MinimalWorker:
    """The only worker of a one-server job, doing no more than the protocol needs (see the module doc).

    It sends no heartbeats, so its server is started with a long ``TANDEM_PS_TIMEOUT``. With a secret
    it does what the protocol then needs as well: a hello with a nonce, each request sealed under the
    session both nonces make, each reply's tag checked (``tandem.kvstore.ps.auth``).
    """

    def __init__(self, processes: Processes) -> None:
        topology, self._store, (self.server_pid,) = server_job(processes, 1, TANDEM_PS_TIMEOUT="3600")
        options = DistOptions.from_env("dist_sync")
        (address,) = server_addresses(self._store, 1, options.rendezvous_timeout)
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)  # the server's ROUTER names it
        self.socket.setsockopt(zmq.RCVTIMEO, 60_000)  # a bench must not hang on a dead server
        self.secret, self.session = attempt_key(options.secret_bytes, restart_count()) if options.secret else b"", None
        if self.secret:  # a server with a secret admits only this login (tandem.kvstore.ps.curve)
            present_password(self.socket, password_of(self.secret))
        self.socket.connect(address.endpoint)
        nonce = new_nonce()
        hello = json.dumps({**hello_info(topology, options), "nonce": nonce.hex()}).encode()
        answer = self.request(Header(Command.HELLO, 1, Role.WORKER, 0), hello)
        if self.secret:
            self.session = Session(self.secret, nonce, bytes.fromhex(json.loads(answer)["nonce"]), 0, is_server=False)

    def _seal(self, head: bytes, payloads: list[Any]) -> bytes:
        """``head`` as the server accepts it: unsigned without a secret, else sealed (a hello with the secret)."""
        return seal(head, payloads, self.session, self.secret) if self.secret else head

    def _check(self, head: bytes, payloads: list[Any]) -> Header:
        """The header of a reply, its tag checked over ``payloads`` when the job has a secret."""
        header = decode_header(head)
        if not self.secret:
            return header
        body, tag = split_tag(head)
        if header.command is Command.HELLO:
            problem = None if hmac.compare_digest(tag, handshake_tag(self.secret, body, payloads)) else "bad hello tag"
        else:
            assert self.session is not None  # opened by the answer to hello
            problem = self.session.check(header.sequence, body, tag, payloads)
        if problem is not None:
            raise RuntimeError(f"the server's reply failed its check: {problem}")
        return header

    def request(self, header: Header, payload: Any = None) -> bytes:
        """Send one request and check its reply (control and init requests: not timed); its payload, if any."""
        payloads = [] if payload is None else [payload]
        head = encode_header(header, len(payloads), payload_size(payloads))
        self.socket.send_multipart([self._seal(head, payloads), *payloads])
        reply_head, *frames = self.socket.recv_multipart()
        if self._check(reply_head, frames).error:
            raise RuntimeError(f"the server refused {header.describe()}")
        return frames[0] if frames else b""

    def push_pull(self, key: str, value: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """Init ``key``, then the timed operation: push ``value``, pull into ``out`` (headers encoded once)."""
        numel = value.numel()

        def header(command: Command) -> Header:
            return Header(command, 1, Role.WORKER, 0, key=key, dtype=value.dtype, shape=(numel,), slice_start=0, slice_stop=numel)

        self.request(header(Command.INIT), tensor_bytes(value))
        push, pull = encode_header(header(Command.PUSH), 1, numel * 4), encode_header(header(Command.PULL))
        value_bytes, out_bytes = tensor_bytes(value), tensor_bytes(out)
        if self.secret:
            return lambda: self._signed_push_pull(push, pull, value_bytes, out_bytes)
        operation = raw_push_pull(self.socket, push, pull)
        return lambda: operation(value_bytes, out_bytes)

    def _signed_push_pull(self, push: bytes, pull: bytes, payload: memoryview, out: memoryview) -> None:
        """``raw_push_pull`` with each request sealed and each reply's tag checked (the pull's value still
        received in place; the server may answer both in one BATCH: its index, then the value)."""
        socket = self.socket
        socket.send(self._seal(push, [payload]), zmq.SNDMORE)
        socket.send(payload, 0, payload.nbytes < ZERO_COPY_BYTES)
        socket.send(self._seal(pull, []))
        pulled = False
        while not pulled:
            head = socket.recv()
            frames: list[Any] = [socket.recv()] if decode_header(head).command is Command.BATCH else []
            if socket.get(zmq.RCVMORE):  # the pull's value
                socket.recv_into(out)
                frames.append(out)
                pulled = True
            self._check(head, frames)

    def close(self) -> None:
        self.request(Header(Command.BYE, 1, Role.WORKER, 0))


def gloo_group(processes: Processes) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    processes.start([__file__, "--child", "gloo", str(store.port)], _child_env())
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    return store


def gloo_allreduce(data: torch.Tensor, count: int) -> None:
    dist.broadcast(torch.tensor([data.numel() * 4, count]), src=0)
    for _ in range(count):
        dist.all_reduce(data)


def measure(cases: dict[str, Callable[[int], None]], count: int, runs: int) -> dict[str, float]:
    """Median seconds per operation of each case; one batch of ``count`` operations per case per round."""
    batches = {name: partial(case, count) for name, case in cases.items()}  # a case runs its batch itself (gloo announces it)
    return {name: seconds / count for name, seconds in interleaved_medians(batches, repeats=runs, warmup=1).items()}


def byte_buffer(numel: int) -> memoryview:
    """The bytes of a fresh float32 tensor of ``numel`` ones (what the raw cases send and receive into)."""
    return memoryview(torch.ones(numel).numpy()).cast("B")


def kvstore_push_pull(kv: DistKVStore, key: str, value: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """One kvstore operation as the benchmark counts it: push ``value``, then pull into ``out`` and wait."""

    def push_pull() -> None:
        kv.push(key, value)
        kv.pull(key, out).wait()

    return push_pull


def size_cases(size: int, echo: Callable[[memoryview], None], raw_store: Callable[[memoryview, memoryview], None],
               minimal: MinimalWorker, stores: dict[str, DistKVStore]) -> dict[str, Callable[[int], None]]:  # fmt: skip
    numel = size // 4
    payload, raw_out = byte_buffer(numel), byte_buffer(numel)
    value, out, data = torch.ones(numel), torch.empty(numel), torch.ones(numel)

    def repeat(operation: Callable[[], None]) -> Callable[[int], None]:
        def loop(count: int) -> None:
            for _ in range(count):
                operation()

        return loop

    cases: dict[str, Callable[[int], None]] = {
        "raw zmq": repeat(lambda: echo(payload)),
        "raw zmq push+pull": repeat(lambda: raw_store(payload, raw_out)),
        "minimal worker push+pull": repeat(minimal.push_pull(f"bench-{size}", value, out)),
    }
    for label, kv in stores.items():
        key = f"bench-{size}"
        kv.init(key, value)
        cases[f"kvstore {label} push+pull"] = repeat(kvstore_push_pull(kv, key, value, out))
        cases[f"kvstore {label} pushpull"] = repeat(lambda kv=kv, key=key: kv.pushpull(key, value, out=out).wait())
    cases["gloo allreduce"] = lambda count: gloo_allreduce(data, count)
    return cases


def run(sizes: list[int], runs: int, tmp: Path) -> dict[int, dict[str, float]]:
    processes = Processes()
    try:
        echo, raw_store = raw_round_trip(raw_peer(processes, tmp, "echo")[0]), raw_push_pull(raw_peer(processes, tmp, "store")[0])
        minimal = MinimalWorker(processes)
        (kv1, store1, _), (kv2, store2, _) = kvstore_job(processes, 1), kvstore_job(processes, 2)
        gloo_store = gloo_group(processes)
        results: dict[int, dict[str, float]] = {}
        for size in tqdm(sizes, desc="sizes", unit="size"):
            cases = size_cases(size, echo, raw_store, minimal, {"1s": kv1, "2s": kv2})
            seconds = measure(cases, _count(size), runs)
            results[size] = {name: size / value / 1e9 for name, value in seconds.items()}
        dist.broadcast(torch.tensor([0, 0]), src=0)  # tells the gloo helper to stop
        dist.destroy_process_group()
        minimal.close()
        kv1.close()
        kv2.close()
        del store1, store2, gloo_store
        return results
    finally:
        processes.stop()


def thread_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of ``pid``'s interpreter threads, and of its libzmq IO threads (``ZMQbg/*``).

    Linux only. ``schedstat`` counts nanoseconds (``stat`` counts 10 ms ticks: too coarse for one
    round). A thread that ends between two readings takes its time with it.
    """
    python = zeromq = 0
    tasks = Path(f"/proc/{pid}/task")
    for thread in os.listdir(tasks):
        try:
            name = (tasks / thread / "comm").read_text()
            nanoseconds = int((tasks / thread / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        if name.startswith("ZMQbg"):
            zeromq += nanoseconds
        else:
            python += nanoseconds
    return python / 1e9, zeromq / 1e9


CPU_COLUMNS = ["wall us/op", "caller Python us/op", "caller ZeroMQ us/op", "peer Python us/op", "peer ZeroMQ us/op"]


def cpu_profile(size: int, runs: int, tmp: Path) -> str:
    """Per case, the medians of wall time and of each side's CPU per operation, as a markdown table."""
    processes = Processes()
    try:
        echo_socket, echo_pid = raw_peer(processes, tmp, "echo")
        store_socket, store_pid = raw_peer(processes, tmp, "store")
        minimal = MinimalWorker(processes)
        kv, store, (server_pid,) = kvstore_job(processes, 1)
        echo, raw_store = raw_round_trip(echo_socket), raw_push_pull(store_socket)
        numel = size // 4
        payload, raw_out = byte_buffer(numel), byte_buffer(numel)
        value, out = torch.ones(numel), torch.empty(numel)
        kv.init("cpu", value)
        cases: dict[str, tuple[Callable[[], None], int]] = {
            "raw zmq": (lambda: echo(payload), echo_pid),
            "raw zmq push+pull": (lambda: raw_store(payload, raw_out), store_pid),
            "minimal worker push+pull": (minimal.push_pull("cpu", value, out), minimal.server_pid),
            "kvstore 1s push+pull": (kvstore_push_pull(kv, "cpu", value, out), server_pid),
        }
        count = 3 * _count(size)  # 3x the throughput rounds (0.1-0.3 s at 1 MB): per-thread CPU is noisier than wall time
        samples: dict[str, list[list[float]]] = {name: [] for name in cases}
        for operation, _ in cases.values():
            for _ in range(count):  # warm up
                operation()
        for _ in tqdm(range(runs), desc=f"cpu {_label(size)}", unit="round"):
            for name, (operation, peer) in cases.items():
                before = (time.perf_counter(), *thread_cpu_seconds(os.getpid()), *thread_cpu_seconds(peer))
                for _ in range(count):
                    operation()
                after = (time.perf_counter(), *thread_cpu_seconds(os.getpid()), *thread_cpu_seconds(peer))
                samples[name].append([(end - start) / count * 1e6 for start, end in zip(before, after)])
        minimal.close()
        kv.close()
        del store
    finally:
        processes.stop()
    rows = []
    for name, measured in samples.items():
        medians = [statistics.median(column) for column in zip(*measured)]
        rows.append([name, *[f"{median:.0f}" for median in medians], f"{sum(medians[1:]):.0f}"])
    table = markdown_table(["case", *CPU_COLUMNS, "CPU us/op (sum)"], rows)
    return (f"{_label(size)}, medians of {runs} interleaved rounds of {count} operations. Caller: this "
            f"process (for the kvstore, the worker: its caller and IO threads); peer: the echo, the bare "
            f"push/pull process or the server (of the minimal worker, or of the kvstore).\n\n{table}")  # fmt: skip


STEP_COLUMNS = ["wall us/step", "messages/step", "worker CPU us/step", "servers CPU us/step",
                "CPU us/slice", "CPU us/message"]  # fmt: skip


def _messages(kv: DistKVStore) -> int:
    """Messages the worker's transport sent and received so far (older builds: one per request and reply)."""
    client = getattr(kv._client, "_client", kv._client)  # P3's sender stands in front of the client
    transport = client.transport
    if not hasattr(transport, "sent"):  # a build without counters: count sends and receptions here
        counts = transport.__dict__.setdefault("_bench_counts", [0])
        if "send" not in transport.__dict__:
            send, receive = transport.send, transport._receive

            def counted_send(*args: Any, **kwargs: Any) -> Any:
                counts[0] += 1
                return send(*args, **kwargs)

            def counted_receive(*args: Any, **kwargs: Any) -> Any:
                counts[0] += 1
                return receive(*args, **kwargs)

            transport.send, transport._receive = counted_send, counted_receive
        return int(counts[0])
    return int(transport.sent + transport.received)


def _cpu(pids: list[int]) -> float:
    return sum(sum(thread_cpu_seconds(pid)) for pid in pids)


def step_cases(processes: Processes, keys: int, numel: int,
               label: str) -> dict[str, tuple[DistKVStore, Callable[[], None], list[int]]]:  # fmt: skip
    """The ``--step`` cases: stores (and their server processes) made with the environment as it is now."""
    cases: dict[str, tuple[DistKVStore, Callable[[], None], list[int]]] = {}
    for servers in (1, 2):
        kv, _, pids = kvstore_job(processes, servers)
        names = [f"k{index}" for index in range(keys)]
        values, outs = [torch.ones(numel) for _ in names], [torch.empty(numel) for _ in names]
        kv.init(names, values)
        cases[f"dist_sync {servers}s: pushpull of {keys} keys{label}"] = (
            kv, lambda kv=kv, names=names, values=values, outs=outs: kv.pushpull(names, values, out=outs).wait(), pids)
    topology, _, pids = server_job(processes, 2, "dist_p3")
    p3 = P3KVStore(topology, DistOptions.from_env("dist_sync"), P3Options(numel, 10))
    value, out = torch.ones(numel * keys), torch.empty(numel * keys)
    p3.init("flat", value)
    cases[f"dist_p3 2s: pushpull of 1 key in {keys} slices{label}"] = (
        p3, lambda: p3.pushpull("flat", value, out=out).wait(), pids)
    return cases


def step_profile(keys: int, key_bytes: int, runs: int, coalesce: list[int] | None) -> str:
    """The ``--step`` table (see the module doc); with ``coalesce``, the cases under each TANDEM_PS_COALESCE_BYTES."""
    processes = Processes()
    try:
        numel = key_bytes // 4
        cases: dict[str, tuple[DistKVStore, Callable[[], None], list[int]]] = {}
        if coalesce is None:
            cases = step_cases(processes, keys, numel, "")
        for limit in coalesce or []:
            os.environ["TANDEM_PS_COALESCE_BYTES"] = str(limit)  # read by the servers started now and the stores
            cases.update(step_cases(processes, keys, numel, f", coalesce {limit}"))
        count = max(5, int(0.3e9 / (keys * key_bytes * 2)))  # ~0.3 s per round at ~1 GB/s
        samples: dict[str, list[list[float]]] = {name: [] for name in cases}
        for _, operation, _ in cases.values():  # warm up
            for _ in range(count):
                operation()
        for _ in tqdm(range(runs), desc="step", unit="round"):
            for name, (kv, operation, peers) in cases.items():
                before = (time.perf_counter(), _messages(kv), sum(thread_cpu_seconds(os.getpid())), _cpu(peers))
                for _ in range(count):
                    operation()
                after = (time.perf_counter(), _messages(kv), sum(thread_cpu_seconds(os.getpid())), _cpu(peers))
                wall, messages, worker, server = [(end - start) / count for start, end in zip(before, after)]
                total = (worker + server) * 1e6
                samples[name].append([wall * 1e6, messages, worker * 1e6, server * 1e6, total / keys,
                                      total / max(messages, 1)])  # fmt: skip
        for kv, _, _ in cases.values():
            kv.close()
    finally:
        processes.stop()
    rows = [[name, *[f"{statistics.median(column):.0f}" if index != 1 else f"{statistics.median(column):.1f}"
                     for index, column in enumerate(zip(*measured))]]
            for name, measured in samples.items()]  # fmt: skip
    setting = os.environ.get("TANDEM_PS_COALESCE_BYTES", "") if coalesce is None else "as named"
    table = markdown_table(["case", *STEP_COLUMNS], rows)
    return (f"{keys} slices of {_label(key_bytes)} per step, one worker (this process), medians of {runs} "
            f"interleaved rounds of {count} steps; TANDEM_PS_COALESCE_BYTES {setting or 'default'}. CPU: every "
            f"thread of the worker and of the servers.\n\n{table}")


def _count(size: int) -> int:
    """Operations per timed batch: about TARGET_SECONDS at ~1 GB/s, at least 3."""
    return max(3, min(300, int(TARGET_SECONDS * 1e9 / max(size, 1) / 2)))


def _label(size: int) -> str:
    return f"{size // MIB} MB" if size >= MIB else f"{size // KIB} KB"


def report(results: dict[int, dict[str, float]], runs: int) -> str:
    names = list(next(iter(results.values())))
    ratio_cases = {"push+pull 1s / raw": "kvstore 1s push+pull", "push+pull 2s / raw": "kvstore 2s push+pull",
                   "pushpull 1s / raw": "kvstore 1s pushpull", "minimal worker / raw": "minimal worker push+pull"}  # fmt: skip
    headers = ["size", *[f"{name} GB/s" for name in names], *ratio_cases]
    rows = []
    for size, throughput in results.items():
        ratios = [throughput[case] / throughput["raw zmq"] for case in ratio_cases.values()]
        rows.append([_label(size), *[throughput[name] for name in names], *[f"{ratio:.0%}" for ratio in ratios]])
    table = markdown_table(headers, rows)
    micro = markdown_table(["size", *[f"{name} us" for name in names]],
                           [[_label(size), *[f"{size / throughput[name] / 1e3:.0f}" for name in names]]
                            for size, throughput in results.items()])  # fmt: skip
    note = f"Medians of {runs} interleaved rounds; GB/s = tensor bytes / round-trip time (1e9 bytes per GB)."
    return f"{table}\n\nThe same medians as microseconds per operation (one round trip, or push then pull):\n\n{micro}\n\n{note}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 25, not 7-9: a size's rounds span ~30 s instead of ~10, so one slow phase of this shared machine
    # moves its median less (9-round runs put 1 MB at 65-81 % of the echo on one day, 25-round ones 72-81 %)
    parser.add_argument("--runs", type=int, default=25, help="rounds per size (median; >= 5)")
    parser.add_argument("--sizes", type=int, nargs="+", help="tensor sizes in bytes (default: 4 KB to 64 MB; 1 MB with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="where the time goes: CPU per operation of each side's threads")
    parser.add_argument("--step", action="store_true", help="a step of many small slices: messages and CPU per step")
    parser.add_argument("--keys", type=int, default=64, help="--step: keys (slices) per step")
    parser.add_argument("--key-bytes", type=int, default=4 * KIB, help="--step: bytes per key (slice)")
    parser.add_argument("--coalesce-bytes", type=int, nargs="+",
                        help="--step: run the cases under each of these TANDEM_PS_COALESCE_BYTES, interleaved")  # fmt: skip
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        role, argument = args.child
        {"echo": echo_main, "store": store_main}.get(role, lambda port: gloo_main(int(port)))(argument)
        return
    if args.runs < 5:
        parser.error("--runs must be >= 5 (medians)")
    torch.set_num_threads(1)
    print(f"command: {command_line()}")
    tmp = ROOT / "bench" / "out" / "kvstore-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    if args.step:
        text = step_profile(args.keys, args.key_bytes, args.runs, args.coalesce_bytes)
        print(text)
        print(f"wrote {write_report('kvstore_step', text)}")
        return
    if args.cpu:
        text = "\n\n".join(cpu_profile(size, args.runs, tmp) for size in args.sizes or [MIB])
        print(text)
        print(f"wrote {write_report('kvstore_cpu', text)}")
        return
    results = run(args.sizes or DEFAULT_SIZES, args.runs, tmp)
    text = report(results, args.runs)
    print(text)
    path = write_report("kvstore", text)
    labels = [_label(size) for size in results]
    series = {name: [results[size][name] for size in results] for name in next(iter(results.values()))}
    plot = bar_plot("kvstore", "push+pull throughput on loopback (1 worker)", labels, series, "GB/s")
    print(f"wrote {path} and {plot}")


if __name__ == "__main__":
    main()
