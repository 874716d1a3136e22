"""The bandwidth-limited test network: real namespaces, veths, a bridge and tc, on this machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tandem import netns

pytestmark = pytest.mark.skipif(
    not netns.available()[0], reason=f"no network namespaces: {netns.available()[1]}"
)
RATE = 50_000_000  # bits/s


def _leftovers(pid: int) -> list[str]:
    """Namespaces and root links of process ``pid`` that still exist."""
    names = netns._namespaces() + netns._root_links()
    return [name for name in names if name.startswith(f"tandem-{pid}-") or name.startswith(f"td{pid:x}n")]


def test_rate_limits_both_directions_and_unshaped_is_much_faster() -> None:
    with netns.Network(num_hosts=3, rate="50mbit") as net:
        assert net.shaped and net.isolated and len({host.address for host in net.hosts}) == 3
        one_way = netns.throughput(net.hosts[1], net.hosts[0], seconds=1.0)
        other_way = netns.throughput(net.hosts[0], net.hosts[2], seconds=1.0)
    with netns.Network(num_hosts=2) as free:
        assert free.isolated and not free.shaped
        unshaped = netns.throughput(free.hosts[1], free.hosts[0], seconds=0.5)
    for measured in (one_way, other_way):
        assert 0.3 * RATE < measured < 2 * RATE, f"{measured / 1e6:.1f} Mbit/s through a 50 Mbit/s link"
    assert unshaped > 3 * RATE, f"unshaped {unshaped / 1e6:.1f} Mbit/s is not well above the shaped rate"


RECEIVE_SCRIPT = """
import socket, sys
server = socket.create_server((sys.argv[1], 45720))
server.settimeout(30)
print("ready", flush=True)
connection, _ = server.accept()
connection.settimeout(30)
received = 0
while received < int(sys.argv[2]):
    chunk = connection.recv(1 << 20)
    if not chunk:
        break
    received += len(chunk)
connection.sendall(b"!")  # all here: the sender's clock stops
"""
SEND_SCRIPT = """
import socket, sys, time
start = time.perf_counter()
connection = socket.create_connection((sys.argv[1], 45720), timeout=30)
connection.sendall(bytes(int(sys.argv[2])))
assert connection.recv(1) == b"!"
print(time.perf_counter() - start, flush=True)
"""


def test_a_message_smaller_than_a_step_is_not_let_through_at_memory_speed() -> None:
    # 200 KB at 10 Mbit/s is 160 ms of wire: a token bucket that held 128 KiB (as tbf's once did)
    # delivered it in about 60 ms. Timed by the sender, from connecting to the receiver's reply, so
    # a loaded machine can only make it slower: no real link of this rate delivers it faster
    size, rate = 200_000, 10_000_000
    with netns.Network(num_hosts=2, rate="10mbit") as net:
        address = net.hosts[0].address
        receiver = subprocess.Popen(net.hosts[0].command([sys.executable, "-c", RECEIVE_SCRIPT, address, str(size)]),
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
            sent = subprocess.run(net.hosts[1].command([sys.executable, "-c", SEND_SCRIPT, address, str(size)]),
                                  check=True, timeout=30, capture_output=True, text=True)  # fmt: skip
            seconds = float(sent.stdout)
        finally:
            receiver.kill()
            receiver.wait()
    wire = size * 8 / rate
    assert seconds > 0.75 * wire, f"{size} bytes crossed a 10 Mbit/s link in {seconds * 1e3:.0f} ms, under its wire time"


def test_root_namespace_is_reachable_from_hosts() -> None:
    with netns.Network(num_hosts=1, rate="100mbit") as net:
        assert netns.throughput(net.hosts[0], net.root, seconds=0.3) > 0
        assert net.root.command(["true"]) == ["true"]
        assert net.hosts[0].command(["true"])[:3] == ["ip", "netns", "exec"]


def test_nothing_left_after_exit_or_exception() -> None:
    with netns.Network(num_hosts=2, rate="10mbit") as net:
        sleeper = subprocess.Popen(net.hosts[0].command(["sleep", "60"]))
        assert _leftovers(os.getpid())
    assert sleeper.wait(timeout=10) != 0  # processes left inside are killed with the namespace
    assert _leftovers(os.getpid()) == []
    with pytest.raises(RuntimeError, match="inside"):
        with netns.Network(num_hosts=2):
            raise RuntimeError("failure inside the network")
    assert _leftovers(os.getpid()) == []


CHILD = """
import sys, time
from tandem import netns
net = netns.Network(num_hosts=2, rate="10mbit")
print("up", flush=True)
time.sleep(60)
"""


def _child_with_network() -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "up"
    assert _leftovers(child.pid)
    return child


def test_sigterm_cleans_up() -> None:
    child = _child_with_network()
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=10) == -signal.SIGTERM
    assert _leftovers(child.pid) == []


def test_a_crashed_run_is_removed_by_the_next_network() -> None:
    child = _child_with_network()
    child.kill()  # SIGKILL: no handler runs, the namespaces stay behind
    child.wait(timeout=10)
    assert _leftovers(child.pid)
    with netns.Network(num_hosts=1):
        deadline = time.monotonic() + 5
        while _leftovers(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _leftovers(child.pid) == []


JOB = """
import os, sys, torch
import tandem.kvstore as kvstore
if kvstore.is_server():
    sys.exit(kvstore.serve("dist_sync"))
kv = kvstore.create("dist_sync")
assert os.environ["TANDEM_MASTER_ADDR"].startswith("10.231."), os.environ["TANDEM_MASTER_ADDR"]
assert kv.addresses[0].endpoint.startswith("tcp://10.231."), kv.addresses
kv.init("w", torch.zeros(1000))
out = torch.empty(1000)
kv.pushpull("w", torch.ones(1000), out=out).wait(timeout=30)
assert torch.equal(out, torch.full((1000,), 2.0))
print("netns job OK", kv.rank)
kv.close()
"""


def test_launch_runs_every_process_in_its_own_namespace() -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [sys.executable, "-m", "tandem.launch", "-n", "2", "-s", "1", "--netns-rate", "200mbit", "--grace", "2",
               "--", sys.executable, "-c", JOB]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": repo, "TANDEM_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("netns job OK") == 2, result.stdout
    assert _leftovers(os.getpid()) == []
