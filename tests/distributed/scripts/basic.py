"""Sums, odd shapes, big-array splitting and error responses; every worker checks its own results."""

from __future__ import annotations

import sys
import threading
import time

import torch

import tandem.kvstore as kvstore
from tandem.kvstore import KVStoreError, RemoteError
from tandem.kvstore.ps.protocol import Command

if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve("dist_sync"))
kv = kvstore.create("dist_sync")
rank, workers = kv.rank, kv.num_workers
total = workers * (workers + 1) / 2  # every worker pushes rank + 1
shapes = {"odd": (7, 3, 5), 0: (), 1: (1,), "big": (1000,), 7: (3, 4)}  # TANDEM_KVSTORE_BIGARRAY_BOUND=100
kv.init(list(shapes), [torch.zeros(shape) for shape in shapes.values()])

# push then pull, every key at once
kv.push(list(shapes), [torch.full(shape, rank + 1.0) for shape in shapes.values()]).wait()
outs = [torch.empty(shape) for shape in shapes.values()]
kv.pull(list(shapes), outs).wait()
for key, out in zip(shapes, outs):
    assert torch.equal(out, torch.full(shapes[key], total)), (key, out)

# pushpull of a tensor that varies along its elements (catches misplaced slices)
big = torch.arange(1000.0) * (rank + 1)
result = torch.empty(1000)
kv.pushpull("big", big, out=result).wait()
assert torch.equal(result, torch.arange(1000.0) * total), result

# two devices' values are summed before sending; a pull fills several outputs; non-contiguous output
kv.pushpull(7, [torch.ones(3, 4), torch.ones(3, 4)]).wait()
pair = [torch.empty(3, 4), torch.empty(4, 3).t()]
kv.pull(7, pair).wait()
assert all(torch.equal(out, torch.full((3, 4), 2.0 * workers)) for out in pair), pair

# pushes of temporaries, several in flight: the store keeps what it sends (from the tensor's own
# memory) alive until the server has it, though the caller dropped it at once
kv.init("temporary", torch.zeros(1 << 20))
outs_in_flight = [torch.empty(1 << 20) for _ in range(3)]
handles = [kv.pushpull("temporary", torch.full((1 << 20,), (rank + 1.0) * (round + 1)), out=out)
           for round, out in enumerate(outs_in_flight)]  # fmt: skip
for round, (handle, out) in enumerate(zip(handles, outs_in_flight)):
    handle.wait()
    assert torch.equal(out, torch.full((1 << 20,), total * (round + 1))), (round, out)

# who receives replies: a waiting thread receives them itself (rank 0's pushpull is answered only
# once every worker pushed, and the others push only once rank 0 waits); replies that no thread
# drives still arrive, for a poller of done() and for a done callback (the IO thread, asleep since a
# driver took over, is woken, or takes them over after 50 ms: not at its heartbeat, 20 s in this
# job, since each waits at most 10 s); two threads may wait at once
kv.init("late", torch.zeros(4))
late = torch.empty(4)
if rank == 0:

    def say_when_waiting() -> None:
        for _ in range(30_000):
            if kv._client._driver_active:
                kv.rendezvous.set("basic: rank 0 waits", "1")
                return
            time.sleep(0.001)

    watcher = threading.Thread(target=say_when_waiting)
    if workers > 1:  # alone, the reply may well come before the wait
        watcher.start()
    driven = kv._client.driven
    kv.pushpull("late", torch.ones(4), out=late).wait()
    if workers > 1:
        watcher.join()
        assert kv._client.driven > driven, "the waiting thread did not receive its reply itself"
else:
    kv.rendezvous.wait(["basic: rank 0 waits"])
    kv.pushpull("late", torch.ones(4), out=late).wait()
assert torch.equal(late, torch.full((4,), float(workers))), late
kv.pull("odd", outs[0]).wait()  # a driver again: the IO thread sleeps now
unwaited = kv.pull("odd", outs[0])
deadline = time.monotonic() + 10
while not unwaited.done() and time.monotonic() < deadline:
    time.sleep(0.01)
assert unwaited.done(), "a reply whose handle was polled was not received"
kv.pull("odd", outs[0]).wait()
called = threading.Event()
kv.pull("odd", outs[0]).add_done_callback(lambda handle: called.set())
assert called.wait(10), "a done callback did not run though nobody waited on its handle"
pulled = [torch.empty(1000), torch.empty(1000)]
threads = [threading.Thread(target=lambda out=out: kv.pull("big", out).wait()) for out in pulled]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(timeout=60)
assert not any(thread.is_alive() for thread in threads), "two threads waiting at once did not both finish"
assert all(torch.equal(out, torch.arange(1000.0) * total) for out in pulled), pulled

# errors come back to the caller and the servers keep serving
for bad, match in [
    (lambda: kv.push("odd", torch.zeros(3)).wait(), "got shape"),
    (lambda: kv.push("odd", torch.zeros(7, 3, 5, dtype=torch.float64)).wait(), "float64"),
    (lambda: kv.pull("never", torch.zeros(2)).wait(), "never initialised"),
    (lambda: kv.init("odd", torch.zeros(7, 3, 5)), "already initialised"),
]:
    try:
        bad()
    except KVStoreError as error:
        assert match in str(error), (match, error)
    else:
        raise AssertionError(f"expected an error matching {match!r}")
if rank == 0:  # the server's own double-init check, bypassing the worker-side one
    try:
        kv._send_tensors(Command.INIT, [("odd", torch.zeros(7, 3, 5), [])], 0, "init").wait()
    except RemoteError as error:
        assert "already initialised" in str(error), error
    else:
        raise AssertionError("server accepted a double init")
kv.barrier()
kv.pull("odd", outs[0]).wait()
assert torch.equal(outs[0], torch.full((7, 3, 5), total))
print(f"basic OK rank {rank} of {workers} workers, {kv.num_servers} servers")
kv.close()
