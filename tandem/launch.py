"""``tandem launch -n W -s S -- python train.py``: run a parameter-server job on this machine.

The launcher hosts the rendezvous store (torch's ``TCPStore``), then starts the *same command* S
times with ``TANDEM_ROLE=server`` and W times with ``TANDEM_ROLE=worker`` (ps-lite style: in a
server process the script runs the server's entry point, ``tandem.kvstore.serve(kind)``, as
``tandem train`` does; ``python -m tandem.kvstore.ps`` is the same for tools).
Every output line is prefixed with its process, e.g. ``[worker 0] loss 0.25``.

The job fails fast: when any process exits nonzero the launcher names it, stops the others
(SIGTERM, then SIGKILL after ``--grace`` seconds) and exits nonzero; with ``--max-restarts N`` it
then starts every process again, up to N times (the script resumes from its checkpoint:
``Trainer.fit(checkpoint_dir=...)``), and exits 0 once an attempt finishes. When every worker exits 0 the
servers finish on their own (each worker says goodbye) and the launcher returns 0. With ``-s 0`` the
job has workers only (the ``collective`` kvstore: ``tandem launch -n 2 -s 0 -- python -m tandem
train --kvstore collective``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, Any

from tandem.env import knob

PREFIX = "[tandem launch]"
POLL_SECONDS = 0.05


@dataclass
class _Child:
    role: str
    rank: int
    process: subprocess.Popen[bytes]
    reader: threading.Thread | None = field(default=None)

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tandem launch``; ``run`` takes the parsed namespace."""
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="worker processes (required)")
    parser.add_argument("-s", "--num-servers", type=int, default=1,
                        help="server processes (0 for a job of workers only: kvstore='collective')")
    parser.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="extra environment for every process"
    )
    parser.add_argument(
        "--master-addr", default=None, help="address of the rendezvous store (unset: TANDEM_MASTER_ADDR)"
    )
    parser.add_argument("--master-port", type=int, default=0, help="its port; 0 picks a free one")
    parser.add_argument("--curve", action="store_true",
                        help="encrypt every worker-server link with ZeroMQ CURVE: fresh keys per job, each process "
                             "given only its role's secret key (docs/security.md)")  # fmt: skip
    parser.add_argument("--no-secret", action="store_true",
                        help="do not make a per-job TANDEM_PS_SECRET when none is set: messages go unauthenticated "
                             "(only on a network where every host is trusted)")  # fmt: skip
    parser.add_argument(
        "--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping"
    )
    parser.add_argument(
        "--p3", action="store_true",
        help="priority-based parameter propagation: dist_sync/dist_async stores become dist_p3 ones (docs/p3.md)",
    )
    parser.add_argument(
        "--netns-rate", default=None, metavar="RATE",
        help="run every process in its own network namespace, its link shaped to RATE both ways (e.g. 100mbit; "
        "'none': no shaping); needs root and iproute2, else falls back to loopback with a warning (unset: loopback)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, metavar="N",
        help="when a process dies, stop the others and start the whole job again, up to N times (the script "
        "resumes from its checkpoint: Trainer.fit(checkpoint_dir=...)); 0: fail fast",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every process runs")


def _validate(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit(f"{PREFIX} no command: use `tandem launch -n 2 -s 1 -- python train.py`")
    if args.num_workers < 1 or args.num_servers < 0:
        raise SystemExit(
            f"{PREFIX} need -n >= 1 and -s >= 0, got -n {args.num_workers} -s {args.num_servers}"
        )
    if args.grace < 0:
        raise SystemExit(f"{PREFIX} --grace must be >= 0, got {args.grace}")
    if args.max_restarts < 0:
        raise SystemExit(f"{PREFIX} --max-restarts must be >= 0, got {args.max_restarts}")
    for item in args.env:
        if "=" not in item or item.startswith("="):
            raise SystemExit(f"{PREFIX} --env takes NAME=VALUE, got {item!r}")
    return command


def _base_env(args: argparse.Namespace, master_addr: str, master_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(item.split("=", 1) for item in args.env)
    processes = args.num_workers + args.num_servers
    threads = int(env.get("TANDEM_NUM_THREADS") or 0) or max(1, (os.cpu_count() or 1) // processes)
    if args.p3:  # like MXNet's launch.py --p3: the script's dist_sync store becomes a P3 store
        env["TANDEM_KVSTORE_P3"] = "1"
    if not env.get("TANDEM_PS_SECRET") and not args.no_secret:  # secure by default: this job's messages only
        env["TANDEM_PS_SECRET"] = secrets.token_hex(32)
    if args.curve:
        from tandem.kvstore.ps.curve import new_job_keys

        keys = new_job_keys()
        env.update({**keys["server"], **keys["worker"]})  # _start takes away the other role's secret key
    env.update(
        TANDEM_NUM_WORKERS=str(args.num_workers),
        TANDEM_NUM_SERVERS=str(args.num_servers),
        TANDEM_MASTER_ADDR=master_addr,
        TANDEM_MASTER_PORT=str(master_port),
        TANDEM_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",  # lines reach the prefixer as they are printed
    )
    return env


_OTHER_ROLES_SECRET_KEY = {"server": "TANDEM_PS_CURVE_WORKER_SECRET_KEY", "worker": "TANDEM_PS_CURVE_SERVER_SECRET_KEY"}


def _forward(child: _Child, stream: IO[bytes], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            sys.stdout.write(f"[{child.name}] {line}\n")
            sys.stdout.flush()


def _start(role: str, rank: int, command: list[str], env: dict[str, str], lock: threading.Lock,
           host: Any = None) -> _Child:  # fmt: skip
    child_env = {**env, "TANDEM_ROLE": role, "TANDEM_RANK": str(rank)}
    child_env.pop(_OTHER_ROLES_SECRET_KEY[role], None)  # a worker must not be able to act as a server
    if host is not None:  # its own network namespace: servers bind to that host's address
        child_env["TANDEM_BIND_ADDR"] = host.address
        command = host.command(command)
    process = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    child = _Child(role, rank, process)
    assert process.stdout is not None
    child.reader = threading.Thread(target=_forward, args=(child, process.stdout, lock), daemon=True)
    child.reader.start()
    return child


def _describe_exit(child: _Child, code: int) -> str:
    if code < 0:
        return f"{child.name} (pid {child.process.pid}) was killed by {signal.Signals(-code).name}"
    return f"{child.name} (pid {child.process.pid}) exited with code {code}"


def _signal_group(child: _Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.process.pid, sig)  # the whole session: helpers the script spawned go too
    except (ProcessLookupError, PermissionError):
        pass


def _stop(children: list[_Child], grace: float) -> None:
    """SIGTERM every live process group, then SIGKILL whatever is left after ``grace`` seconds."""
    alive = [child for child in children if child.process.poll() is None]
    for child in alive:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(child.process.poll() is None for child in alive) and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    for child in alive:
        _signal_group(child, signal.SIGKILL)
        child.process.wait(timeout=10)
    for child in children:
        if child.reader is not None:
            child.reader.join(timeout=2)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # shell convention for "killed by signal N"


def _supervise(children: list[_Child], grace: float, server_wait: float, lock: threading.Lock,
               attempt: str = "") -> tuple[int, bool]:  # fmt: skip
    """Wait for the job: the first failure stops everything; workers all done means success. Returns the
    exit code and whether a process died (which a restart may cure; servers that outlive the workers it
    would not). ``attempt`` ("attempt 2 of 3: ") starts what is said about a death."""
    workers = [child for child in children if child.role == "worker"]
    workers_done_at: float | None = None
    while True:
        for child in children:
            code = child.process.poll()
            if code is not None and code != 0:
                others = sum(1 for other in children if other is not child and other.process.poll() is None)
                _say(lock, f"{attempt}{_describe_exit(child, code)}; stopping the other {others} process(es)")
                _stop(children, grace)
                return _exit_code(code), True
        if workers_done_at is None and all(worker.process.poll() == 0 for worker in workers):
            workers_done_at = time.monotonic()
        if all(child.process.poll() is not None for child in children):
            return 0, False
        if workers_done_at is not None and time.monotonic() - workers_done_at > server_wait:
            _say(
                lock, f"servers still running {server_wait:.0f} s after every worker finished; stopping them"
            )
            _stop(children, grace)
            return 1, False
        time.sleep(POLL_SECONDS)


def _run_attempts(args: argparse.Namespace, command: list[str], env: dict[str, str], hosts: list[Any],
                  lock: threading.Lock, children: list[_Child]) -> int:  # fmt: skip
    """Start every process and supervise them; after a death, start them all again while ``--max-restarts``
    allows. ``children`` holds the current attempt's processes (what an interrupt stops).

    Each attempt's processes get ``TANDEM_RESTART_ATTEMPT`` (0, 1, ...): they name their rendezvous keys
    with it, so that none reads what the last attempt left in the store (its dead servers' endpoints)."""
    attempts = args.max_restarts + 1
    for attempt in range(attempts):
        label = f"attempt {attempt + 1} of {attempts}: " if attempts > 1 else ""
        attempt_env = {**env, "TANDEM_RESTART_ATTEMPT": str(attempt)}
        children.clear()  # the last attempt's processes are all stopped
        for rank in range(args.num_servers):
            children.append(_start("server", rank, command, attempt_env, lock, hosts[rank]))
        for rank in range(args.num_workers):
            children.append(_start("worker", rank, command, attempt_env, lock, hosts[args.num_servers + rank]))
        code, died = _supervise(children, args.grace, server_wait=knob("TANDEM_PS_TIMEOUT") + args.grace, lock=lock,
                                attempt=label)  # fmt: skip
        if code == 0 or not died:
            return code
        if attempt + 1 < attempts:
            _say(lock, f"restarting every process (attempt {attempt + 2} of {attempts}); the job resumes from "
                       f"its last checkpoint")  # fmt: skip
        elif attempts > 1:
            _say(lock, f"giving up: all {attempts} attempts failed (--max-restarts {args.max_restarts})")
    return code


def _say(lock: threading.Lock, text: str) -> None:
    with lock:
        print(f"{PREFIX} {text}", file=sys.stdout, flush=True)


def _stop_on_sigterm() -> signal.Handlers | Any:
    """Make SIGTERM to the launcher stop the job like Ctrl-C does (no orphaned processes); returns the old handler."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        return None  # signal handlers can only be set from the main thread
    return signal.signal(signal.SIGTERM, interrupt)


def run(args: argparse.Namespace) -> int:
    """Run the job described by ``args``; returns the exit code (0 when every process finished cleanly)."""
    command = _validate(args)
    import torch.distributed as dist  # imported late: `tandem --help` should not pay for torch

    network = _network(args)
    hosts = network.hosts if network is not None else [None] * (args.num_servers + args.num_workers)
    # in namespaces the store listens in the root namespace, which every host reaches over the bridge
    master_addr = network.root_address if network is not None else args.master_addr or knob("TANDEM_MASTER_ADDR")
    listener = _listen(master_addr, args.master_port)  # the given address only: torch's store binds every interface
    port = listener.getsockname()[1]
    store = dist.TCPStore(master_addr, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                          master_listen_fd=listener.detach())  # fmt: skip  # the store owns the socket now
    env = _base_env(args, master_addr, store.port)
    lock = threading.Lock()
    children: list[_Child] = []
    previous = _stop_on_sigterm()
    try:
        return _run_attempts(args, command, env, hosts, lock, children)
    except KeyboardInterrupt:
        _say(lock, "interrupted; stopping every process")
        _stop(children, args.grace)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        del store  # closes the rendezvous store only after every child is gone
        if network is not None:
            network.close()


def _listen(address: str, port: int) -> socket.socket:
    """A listening TCP socket on ``address`` alone, for the rendezvous store to serve on."""
    try:
        listener = socket.create_server((address, port), family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                                        backlog=128)  # fmt: skip
    except OSError as error:
        raise SystemExit(f"{PREFIX} cannot listen on {address}:{port} for the rendezvous store ({error}); "
                         f"--master-addr must be an address of this machine") from None  # fmt: skip
    return listener


def _network(args: argparse.Namespace) -> Any:
    """The namespaces of --netns-rate, one host per process (servers first), or None without it."""
    if args.netns_rate is None:
        return None
    from tandem import netns  # imported only where namespaces are asked for

    try:
        return netns.Network(args.num_servers + args.num_workers, rate=None if args.netns_rate == "none" else args.netns_rate)
    except ValueError as error:
        raise SystemExit(f"{PREFIX} --netns-rate: {error}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem launch", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
