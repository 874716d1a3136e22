"""The CPU a step's bytes cost on their own: a floor under any parameter-server data plane here.

A parameter-server step moves every gradient from each worker to the servers and every parameter
back (``bench/p3.py``'s parameter-server modes: 2 workers, 2 servers, each server holding half of
the model). On this machine all four processes and the kernel's network stack share the same cores,
so the bytes' own CPU cost (sockets, TCP, the veth pairs, the bridge, the ``tc`` shaping) is time
the workers' compute cannot have. This bench moves exactly those bytes with nothing else: plain TCP
sockets in the same namespaces (``tandem.netns``), each worker sending its half-model to each
server and each server answering every worker with its half once both have sent (a synchronous
push, then pull), one thread per connection, ``sendall`` and ``recv_into`` on preallocated buffers.
It reads the machine's busy CPU time (``/proc/stat``: user, nice, system, irq, softirq; not idle,
iowait or steal) before and after ``--steps`` such exchanges and reports core-milliseconds per step:
the whole machine's, so run it on a quiet one.

The floor: with a worker's compute taking ``compute`` ms of one core (as bench/p3.py measures it,
both workers computing at once), a step of a data plane that costs at least ``bytes`` core-ms can
be no shorter than ``max(compute, wire, (2 * compute + bytes) / cores)``, however it overlaps;
its best share of bench/p3.py's ideal (``batch / max(compute, wire)``) is the ideal step over
that. ``--compute-ms MODEL=MS`` passes the compute time of a bench/p3.py run; without it the
compute is measured here (the model's step, eager, both workers at once, one thread each).

Reproduce: python bench/cpu_floor.py --rates 1gbit   (as root, for the namespaces; under a minute)
Writes bench/out/cpu_floor.md and cpu_floor.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import bar_plot, command_line, interleaved_medians, markdown_table, write_report  # noqa: E402
from bench.p3 import MODELS, SERVERS, WORKERS, _model, _report, _results, eager_step  # noqa: E402

PORT = 45_820
TIMEOUT = 300
BUSY_FIELDS = (0, 1, 2, 5, 6)  # /proc/stat cpu: user, nice, system, irq, softirq (not idle 3, iowait 4, steal 7)

PEER = r"""
import socket, sys, threading
role, index, half, steps, port, workers = (sys.argv[1], *map(int, sys.argv[2:7]))
addresses = sys.argv[7:]
TIMEOUT = 120

def receive(connection, buffer):
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        count = connection.recv_into(view[got:])
        if count == 0:
            raise ConnectionError("peer closed")
        got += count

if role == "server":
    listener = socket.create_server((addresses[0], port + index))
    listener.settimeout(TIMEOUT)
    print("ready", flush=True)
    connections = []
    for _ in range(workers):
        connection, _ = listener.accept()
        connection.settimeout(TIMEOUT)
        connections.append(connection)
    pushed = [bytearray(half) for _ in connections]
    pulled = bytes(half)
    both_pushed = threading.Barrier(len(connections), timeout=TIMEOUT)

    def serve(i):
        try:
            for _ in range(steps):
                receive(connections[i], pushed[i])  # the worker's push
                both_pushed.wait()  # synchronous: the round's sum exists once every worker has pushed
                connections[i].sendall(pulled)  # the pull
        except BaseException as error:  # a thread's error does not end the process: say it, and fail
            errors.append(error)
            both_pushed.abort()

    errors = []
    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(connections))]
    for thread in threads: thread.start()
    for thread in threads: thread.join()
    if errors:
        sys.exit(f"server {index} failed: {errors[0]!r}")
else:
    connections = [socket.create_connection((address, port + i), timeout=TIMEOUT) for i, address in enumerate(addresses)]
    gradient, parameters = bytes(half), [bytearray(half) for _ in connections]
    print("ready", flush=True)
    sys.stdin.readline()  # go

    def exchange(i):
        try:
            for _ in range(steps):
                connections[i].sendall(gradient)
                receive(connections[i], parameters[i])
        except BaseException as error:
            errors.append(error)

    errors = []
    threads = [threading.Thread(target=exchange, args=(i,)) for i in range(len(connections))]
    for thread in threads: thread.start()
    for thread in threads: thread.join()
    print("failed" if errors else "done", flush=True)
    if errors:
        sys.exit(f"worker {index} failed: {errors[0]!r}")
"""


def busy_core_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (every core, every namespace: one kernel)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    return sum(int(fields[i]) for i in BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def exchange(rate: str, parameters: int, steps: int) -> tuple[float, float]:
    """Wall seconds and busy core-seconds of ``steps`` push/pull exchanges of a ``parameters`` model
    (float32) between WORKERS workers and SERVERS servers in shaped namespaces."""
    from tandem import netns

    half = parameters * 4 // SERVERS
    with netns.Network(num_hosts=WORKERS + SERVERS, rate=None if rate == "none" else rate) as net:
        servers, workers = net.hosts[WORKERS:], net.hosts[:WORKERS]
        addresses = [host.address for host in servers]
        python = [sys.executable, "-c", PEER]
        started: list[subprocess.Popen[str]] = []
        try:
            for index, host in enumerate(servers):
                started.append(subprocess.Popen(host.command([*python, "server", str(index), str(half), str(steps),
                                                              str(PORT), str(WORKERS), host.address]),
                                                stdout=subprocess.PIPE, text=True))  # fmt: skip
                assert started[-1].stdout is not None
                if started[-1].stdout.readline().strip() != "ready":
                    raise RuntimeError(f"server {index} did not start")
            peers = [subprocess.Popen(host.command([*python, "worker", str(index), str(half), str(steps), str(PORT),
                                                    str(WORKERS), *addresses]),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for index, host in enumerate(workers)]  # fmt: skip
            started += peers
            for peer in peers:
                assert peer.stdout is not None
                if peer.stdout.readline().strip() != "ready":
                    raise RuntimeError("a worker did not connect")
            busy, start = busy_core_seconds(), time.perf_counter()
            for peer in peers:
                assert peer.stdin is not None
                peer.stdin.write("go\n")
                peer.stdin.flush()
            for peer in peers:
                assert peer.stdout is not None
                if peer.stdout.readline().strip() != "done":
                    raise RuntimeError("a worker failed (its error is above)")
            wall, busy = time.perf_counter() - start, busy_core_seconds() - busy
            for process in started:
                if process.wait(timeout=TIMEOUT) != 0:
                    raise RuntimeError("a server failed (its error is above)")
            return wall, busy
        finally:
            for process in started:
                if process.poll() is None:
                    process.kill()
                    process.wait()


def compute_job(model: str, steps: int) -> None:
    """One worker's eager training step (1 thread), timed: what bench/p3.py's compute column runs."""
    import torch

    torch.set_num_threads(1)
    module, loss_fn, batch, _ = _model(model)
    step = eager_step(module, loss_fn, batch, torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9))
    _report(**interleaved_medians({"seconds": step}, repeats=steps, warmup=3))


def measure_compute(model: str, steps: int) -> float:
    """Median step seconds of WORKERS workers computing at once (as in bench/p3.py's jobs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--compute-job", model, str(steps)],
                                  env=env, stdout=subprocess.PIPE, text=True) for _ in range(WORKERS)]  # fmt: skip
    try:
        outputs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    finally:
        for process in processes:  # none outlives a timeout
            if process.poll() is None:
                process.kill()
                process.wait()
    values = [report["seconds"] for report in _results("".join(outputs))]
    if len(values) != WORKERS:
        raise RuntimeError(f"compute of {model} failed:\n{''.join(outputs)[-2000:]}")
    return max(values)


def compute_ms(text: str) -> tuple[str, float]:
    """argparse's check of ``MODEL=MS``."""
    model, equals, milliseconds = text.partition("=")
    try:
        if model not in MODELS or not equals:
            raise ValueError(text)
        return model, float(milliseconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want MODEL=MS, MODEL one of {', '.join(MODELS)}") from None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--compute-job":
        compute_job(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rates", nargs="+", default=["1gbit"], help="tc rates, or 'none' for unshaped")
    parser.add_argument("--steps", type=int, default=40, help="exchanges per run")
    parser.add_argument("--runs", type=int, default=5, help="runs (median; >= 5)")
    parser.add_argument("--compute-ms", nargs="*", default=[], metavar="MODEL=MS", type=compute_ms,
                        help="a worker's compute time per model (bench/p3.py's); measured here where not given")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be >= 5 (medians of at least 5 runs)")
    from tandem import netns
    from tandem.netns import parse_rate

    available, reason = netns.available()
    if not available:
        parser.error(f"needs network namespaces: {reason}")
    given = {name: milliseconds / 1e3 for name, milliseconds in args.compute_ms}
    cores = len(os.sched_getaffinity(0))  # the cores this process may use (cgroups and affinity included)
    rows, labels, floors, ideals = [], [], [], []
    for model in args.models:
        parameters = sum(p.numel() for p in _model(model)[0].parameters())
        compute = given[model] if model in given else measure_compute(model, 20)
        for rate in args.rates:
            runs = [exchange(rate, parameters, args.steps) for _ in range(args.runs)]
            wall = statistics.median(w for w, _ in runs) / args.steps
            busy = statistics.median(b for _, b in runs) / args.steps
            wire = 0.0 if rate == "none" else parameters * 4 * 8 / parse_rate(rate)
            ideal_step = max(compute, wire)
            floor_step = max(compute, wire, (WORKERS * compute + busy) / cores)
            rows.append([model, rate, f"{parameters * 4 * WORKERS * 2 / 1e6:.1f}", wall * 1e3, busy * 1e3,
                         compute * 1e3, wire * 1e3, ideal_step * 1e3, floor_step * 1e3, ideal_step / floor_step])  # fmt: skip
            labels.append(f"{model} {rate}")
            floors.append(ideal_step / floor_step)
            ideals.append(1.0)
    headers = ["model", "link", "MB moved per step", "push, then pull: ms per step", "busy core-ms per step",
               "compute ms (one worker)", "wire ms", "ideal step ms", "floor step ms", "best share of ideal"]  # fmt: skip
    table = markdown_table(headers, rows)
    note = (f"{WORKERS} workers x {SERVERS} servers, each server half the model (float32); median of {args.runs} runs "
            f"x {args.steps} push/pull exchanges; {cores} cores; floor step = max(compute, wire, (workers x compute + "
            "busy) / cores); best share of ideal = ideal step / floor step")  # fmt: skip
    report = write_report("cpu_floor", f"{note}\n\n{table}")
    plot = bar_plot("cpu_floor", "the bytes' own CPU: best reachable share of the ideal", labels,
                    {"ideal": ideals, "best reachable": floors}, "share of ideal")  # fmt: skip
    print(f"\n{note}\n{table}\n\nwritten {report} and {plot}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
