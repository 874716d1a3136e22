"""The collective store's scheduler: slices all-reduced by priority, the same on every worker.

One process group runs its collectives in the order they are issued, and the slices of every
worker's i-th collective are summed together: all workers must issue the same slices in the same
order. Yet *when* a gradient is ready differs between workers, so a plain priority queue (issue the
highest-priority slice ready here) would issue different slices on each. Workers therefore agree
before they issue (as Horovod's coordinator does), in *rounds*: one small all-reduce (MIN) on a
control group of what each worker has, per key: how many operations were submitted, and how many
of its issued slices completed. The result is the same everywhere: an operation submitted by every
worker is *agreed* and its slices join the ready queue (highest priority first, FIFO on ties, never
reordered within a key: ``LanePriorityQueue``); a slice completed everywhere frees its credit. Then
every worker issues, from the same queue under the same credit, the same slices
(``all_reduce(slice, async_op=True)`` on the data group), at most ``water_mark`` collectives in
flight (always one where none is): the backlog stays in the queue, where a later higher-priority
slice overtakes it (P3; ByteScheduler's credit). Slices queued one behind the other share one
collective while together they fit in one slice (``_next_unit``): a small model's many small
gradients cost a few collectives per step, not one each.

Rounds cost time on a busy link: the round's small all-reduce waits behind the data already
queued there (milliseconds at 1 Gbit/s), and for every worker's scheduler to join it. An operation
submitted ``ordered`` skips them, as DDP's buckets do: where every worker submits the same
operations in the same order (one program, driving its store from one thread), the order of
submission is the same everywhere, so each worker issues in that order without asking: the slices
of one ``submit`` call by priority (fused as above), calls one after another, under its own credit
(collectives completed *here*). What it gives up is P3's overtaking across calls: a later call's
slices wait behind the earlier calls' backlog, since whether that backlog has left yet differs
between workers. Both kinds may follow each other: an ordered call waits until every operation
submitted before it in rounds has been issued, and operations submitted in rounds after an ordered
call join the rounds once that call is issued here, so every worker issues one sequence.

A worker starts a round when it has something new to say: an operation not yet agreed, or a slice
completed since the last round while slices wait. Every other worker eventually has the same to say
(in a synchronous job every worker submits the same operations), so rounds pair up and none waits
forever; one round runs at a time. Thread safety: ``submit`` from any thread (ordered calls: in one
order on every worker, so from one thread of control, as a Trainer's segments are); one scheduler thread
runs the rounds and issues; collectives complete on the group's threads (CUDA slices: on a
completion thread, once they have run on the GPU; untested, see ``_complete_cuda``).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tandem import trace
from tandem.kvstore.base import Handle
from tandem.kvstore.compression import (
    GradientCompression,
    add_to_residuals,
    decode_parts,
    encode_parts,
    summable,
)
from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.flat import elements
from tandem.kvstore.ps.p3_queue import LanePriorityQueue

POLL_SECONDS = 0.2  # how often an idle scheduler looks whether it should stop


@dataclass(eq=False)
class Operation:
    """One all-reduce of a key's value, cut into slices; ``target`` (flat) receives the sum."""

    index: int  # the key's index (init order: the same on every worker)
    key: Any
    value: torch.Tensor  # flat, what this worker contributes
    target: torch.Tensor  # flat, where the sum lands (may be ``value`` itself)
    slice_size: int
    priority: int
    water_mark: int  # the cap in force when it was submitted (the tuner may change it between steps)
    handle: Handle
    compression: GradientCompression | None = None
    ordered: bool = False  # issued in submission order without rounds (see the module docstring)

    def slices(self) -> list[tuple[int, int]]:
        numel = self.value.numel()
        return [(start, min(start + self.slice_size, numel)) for start in range(0, numel, self.slice_size)]

    def count_slices(self) -> int:
        return -(-self.value.numel() // self.slice_size)


@dataclass(eq=False)
class _Slice:
    operation: Operation
    start: int
    stop: int
    number: int  # its place among the operation's slices (for the trace)


@dataclass
class _State:
    """What this worker knows; ``agreed*`` and the queue are the same on every worker after a round."""

    submitted: list[int] = field(default_factory=list)  # per key: operations submitted here
    agreed: list[int] = field(default_factory=list)  # per key: operations submitted everywhere
    waiting: list[deque[Operation]] = field(default_factory=list)  # per key: submitted here, not yet agreed
    completed: int = 0  # collectives completed here (a collective carries one slice or several fused)
    agreed_completed: int = 0  # collectives completed everywhere
    issued: int = 0  # collectives issued (the same count everywhere at each round)
    credit: int = 1  # collectives allowed in flight: the water mark of the last agreed operation
    # behind an ordered call, in submission order: ordered calls' slices (a queue each) and later
    # calls in rounds (their operations, counted as submitted once the calls before them are issued)
    pending: deque[LanePriorityQueue[_Slice] | list[Operation]] = field(default_factory=deque)


class Scheduler:
    """Agrees on and issues the slices of submitted operations (see the module docstring)."""

    def __init__(self, rank: int, size: int, control: Any, data: Any, timeout: float,
                 on_error: Callable[[BaseException], None]) -> None:  # fmt: skip
        """``on_error(error)`` is called once, from the thread that met it, when a collective fails; the
        caller then ends everything with ``fail`` (with an error naming the cause, where it can)."""
        self.rank, self.size, self.control, self.data = rank, size, control, data
        self.timeout, self.on_error = timeout, on_error
        self._state = _State()
        self._ready: LanePriorityQueue[_Slice] = LanePriorityQueue()
        self._cond = threading.Condition()
        self._residuals: dict[Any, torch.Tensor] = {}  # gradient compression's, per key index (scheduler thread)
        self._stopping = False
        self._failed: BaseException | None = None
        self._broken = False  # a collective failed: no round runs again
        self._live: set[Operation] = set()  # submitted, not yet done (failed together if the job fails)
        self.rounds = 0
        self._row = f"collective (worker {rank})"
        self._cuda_done: queue.SimpleQueue[tuple[Any, Any, _Done] | None] | None = None  # see _complete_cuda
        self._thread = threading.Thread(target=self._run, name=f"tandem-collective-{rank}", daemon=True)
        self._thread.start()

    def add_key(self) -> int:
        """Room for one more key (every worker adds its keys in the same order); returns its index."""
        with self._cond:
            state = self._state
            state.submitted.append(0)
            state.agreed.append(0)
            state.waiting.append(deque())
            return len(state.submitted) - 1

    def submit(self, operations: list[Operation]) -> None:
        """Queue ``operations`` together: for agreement (one round sees them all), or, ``ordered``, as one call
        issued after the earlier ones; never blocks. Each
        handle completes once every slice of its operations is summed."""
        with self._cond:
            if self._failed is not None:
                raise self._failed
            if self._stopping:
                raise KVStoreError("this kvstore is closing; no new operations")
            if len({operation.ordered for operation in operations}) > 1:
                raise KVStoreError("one call mixes ordered operations and operations in rounds: set store.ordered "
                                   "outside kv.batched() blocks")  # fmt: skip
            self._live.update(operations)
            if operations and operations[0].ordered:
                in_order: LanePriorityQueue[_Slice] = LanePriorityQueue()
                for operation in operations:
                    _queue_slices(in_order, operation)
                if in_order:
                    self._state.pending.append(in_order)
            else:
                self._state.pending.append(operations)
                self._promote()
            self._cond.notify_all()
        by_handle: dict[int, tuple[Handle, list[Operation]]] = {}  # a call's operations share one handle: one callback
        for operation in operations:
            by_handle.setdefault(id(operation.handle), (operation.handle, []))[1].append(operation)
        for handle, done in by_handle.values():
            handle.add_done_callback(partial(self._forget, done))

    def _promote(self) -> None:
        """Calls in rounds at the head of ``pending`` join the rounds (under the lock)."""
        state = self._state
        while state.pending and isinstance(head := state.pending[0], list):
            state.pending.popleft()
            for operation in head:
                state.submitted[operation.index] += 1
                state.waiting[operation.index].append(operation)

    def _forget(self, operations: list[Operation], handle: Handle) -> None:
        with self._cond:
            self._live.difference_update(operations)

    # -- the scheduler thread --------------------------------------------------------------------
    def _unagreed(self) -> bool:
        return any(mine > agreed for mine, agreed in zip(self._state.submitted, self._state.agreed))

    def _wants_round(self) -> bool:
        state = self._state
        if self._unagreed():
            return True
        return bool(self._ready) and state.completed > state.agreed_completed

    def _may_issue_ordered(self) -> bool:
        """An ordered call is next, every operation before it is issued, and this worker's credit allows one more."""
        state = self._state
        if not state.pending or self._ready or self._unagreed():
            return False
        head = state.pending[0]
        assert isinstance(head, LanePriorityQueue)  # calls in rounds at the head were promoted
        return _under_credit(state.issued, state.completed, head.peek().operation.water_mark)

    def _run(self) -> None:
        try:
            while True:
                issue = []
                with self._cond:
                    while not (self._may_issue_ordered() or self._wants_round()) or self._broken:
                        if self._stopping or self._broken:
                            return
                        self._cond.wait(POLL_SECONDS)
                    state = self._state
                    while self._may_issue_ordered():  # no round: the same sequence on every worker
                        head = state.pending[0]
                        assert isinstance(head, LanePriorityQueue)
                        issue.append(_next_unit(head))
                        state.issued += 1
                        if not head:
                            state.pending.popleft()
                            self._promote()
                    if not issue:
                        keys = len(state.submitted)  # and its negation: MIN gives the fewest and the most keys
                        mine = torch.tensor([keys, -keys, *state.submitted, state.completed], dtype=torch.int64)
                if issue:
                    for unit in issue:
                        self._issue(unit)
                else:
                    self._round(mine)
        except BaseException as error:  # noqa: BLE001 - every waiter learns of it through its handle
            self.broken(error)

    def _round(self, mine: torch.Tensor) -> None:
        """One agreement (MIN over workers), then issue what it allows."""
        start = trace.now_us()
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # the enum member is what it takes
        self.control.allreduce([mine], options).wait(timedelta(seconds=self.timeout))
        self.rounds += 1
        fewest, most, *agreed = mine.tolist()
        if fewest != -most:
            raise KVStoreError(f"the workers' schedulers know different numbers of keys ({fewest} to {-most}): every "
                               f"worker must init the same keys, and init only when its operations are done")  # fmt: skip
        with self._cond:
            if self._broken:  # the job failed during the agreement: issue nothing
                return
            state = self._state
            for index, count in enumerate(agreed[:-1]):  # in key order: the queue is the same everywhere
                for _ in range(count - state.agreed[index]):
                    operation = state.waiting[index].popleft()
                    state.credit = operation.water_mark
                    _queue_slices(self._ready, operation)
                state.agreed[index] = count
            state.agreed_completed = agreed[-1]
            issue = []
            while self._ready and _under_credit(state.issued, state.agreed_completed, state.credit):
                issue.append(_next_unit(self._ready))
                state.issued += 1
        if trace.enabled():
            trace.record("agree", start, trace.now_us(), "comm", {"issue": len(issue)}, self._row)
        for unit in issue:
            self._issue(unit)

    def _issue(self, unit: list[_Slice]) -> None:
        start = trace.now_us()
        first = unit[0]
        compression = first.operation.compression
        finish: Callable[[], None]
        if compression is not None:
            summed = summable(compression)  # 16-bit floats are all-reduced as they are; int8, int4, 2-bit codes all-gathered
            totals = add_to_residuals(self._residuals, [(part.operation.index, part.operation.value, part.start, part.stop)
                                                        for part in unit])  # fmt: skip
            sent = encode_parts(compression, totals, self.size if summed else 1)  # the unit's slices as one message
            if summed:  # half the bytes of an all-gather from 4 workers on: a ring all-reduce moves 2(n-1)/n
                work = self.data.allreduce([sent])
                finish = _Unfuse(unit, sent)  # the copy widens the 16-bit sum into each target
            else:
                gathered = [torch.empty_like(sent) for _ in range(self.size)]
                work = self.data.allgather([gathered], [sent])
                finish = _Decode(unit, compression, gathered)
        elif len(unit) == 1:
            operation = first.operation
            target = elements(operation.target, first.start, first.stop)
            if not _same_memory(operation.target, operation.value):  # pushpull without out: sums in place
                target.copy_(elements(operation.value, first.start, first.stop))
            work = self.data.allreduce([target])
            finish = _nothing
        else:
            fused = torch.cat([elements(part.operation.value, part.start, part.stop) for part in unit])  # copied: summed in place
            work = self.data.allreduce([fused])
            finish = _Unfuse(unit, fused)
        cuda = first.operation.target.is_cuda
        done = _Done(self, [part.operation.handle for part in unit], finish, cuda)
        if cuda:
            self._complete_cuda(work, done)
        else:
            work.get_future().add_done_callback(done)
        if trace.enabled():
            name = f"issue {first.operation.key}[{first.number}]" + (f" + {len(unit) - 1} fused" if len(unit) > 1 else "")
            trace.record(name, start, trace.now_us(), "comm",
                         {"key": str(first.operation.key), "slice": first.number, "fused": len(unit),
                          "priority": first.operation.priority}, self._row)  # fmt: skip

    def _complete_cuda(self, work: Any, done: _Done) -> None:
        """A CUDA slice completes only once its collective has run on the GPU (UNTESTED: no GPU here).

        NCCL's future completes when the collective is enqueued, not when it has run: a part
        completed then would free its credit and let the caller read the sum too early. So the
        current stream waits for the collective (``work.wait()``: no CPU wait), an event is recorded
        after it, and a completion thread synchronises the events in issue order and then finishes
        each slice (decode, count, complete the part)."""
        work.wait()
        event = torch.cuda.Event()
        event.record()
        if self._cuda_done is None:
            self._cuda_done = queue.SimpleQueue()
            threading.Thread(target=self._cuda_completions, args=(self._cuda_done,),
                             name=f"tandem-collective-cuda-{self.rank}", daemon=True).start()  # fmt: skip
        self._cuda_done.put((work.get_future(), event, done))

    def _cuda_completions(self, waiting: queue.SimpleQueue[tuple[Any, Any, _Done] | None]) -> None:
        while (item := waiting.get()) is not None:
            future, event, done = item
            try:
                event.synchronize()
                future.wait()
            except BaseException as error:  # noqa: BLE001 - the store names the cause
                self.broken(error)
                continue
            done(future)

    @property
    def issued(self) -> int:
        """Data collectives issued so far."""
        with self._cond:
            return self._state.issued

    def _completed(self) -> None:
        with self._cond:
            self._state.completed += 1
            if self._ready or self._state.pending:
                self._cond.notify_all()

    def broken(self, error: BaseException) -> None:
        """A collective failed with ``error``: no round runs again; ``on_error`` hears of it (once)."""
        with self._cond:
            first, self._broken = not self._broken, True
            self._cond.notify_all()
        if first:
            self.on_error(error)

    def fail(self, error: BaseException) -> None:
        """The job failed: every operation not yet done fails with ``error`` (once), and no round runs again.

        Operations issued and still in flight fail through their handles too (a failed handle ignores
        its later parts)."""
        with self._cond:
            if self._failed is not None:
                return
            self._failed, self._broken = error, True
            self._drain()
            pending, self._live = self._live, set()
            self._cond.notify_all()
        for operation in pending:
            operation.handle.fail(error)

    def _drain(self) -> list[_Slice]:
        parts = []
        for waiting in (self._ready, *self._state.pending):
            while isinstance(waiting, LanePriorityQueue) and waiting:
                parts.append(waiting.pop())
        self._state.pending.clear()  # their operations fail through _live
        return parts

    def idle(self) -> bool:
        """Nothing submitted here waits for agreement or to be issued."""
        with self._cond:
            state = self._state
            return not self._ready and not state.pending and not self._unagreed()

    def stop(self, timeout: float) -> None:
        """Stop the scheduler thread once it has nothing to do (or at once where the job failed)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout)
        if self._cuda_done is not None:
            self._cuda_done.put(None)  # after what is queued: the completion thread ends once those are done


def _same_memory(one: torch.Tensor, other: torch.Tensor) -> bool:
    """The two flat tensors are the same memory (views of one tensor may be different objects)."""
    return one.data_ptr() == other.data_ptr() and one.numel() == other.numel() and one.dtype == other.dtype


def _nothing() -> None:
    pass


def _under_credit(issued: int, completed: int, credit: int) -> bool:
    """One more collective may be issued: fewer than ``credit`` in flight, or none (a cap never stalls)."""
    return issued - completed < credit or issued == completed


def _queue_slices(queue: LanePriorityQueue[_Slice], operation: Operation) -> None:
    """``operation``'s slices, in the queue by its priority, in its key's lane (never reordered within a key)."""
    for number, (begin, end) in enumerate(operation.slices()):
        queue.put(_Slice(operation, begin, end, number), operation.priority, operation.index)


def _next_unit(ready: LanePriorityQueue[_Slice]) -> list[_Slice]:
    """The next collective: the highest-priority ready slice, fused with the slices queued behind it
    while they fit in its operation's slice size. Small gradients then share one all-reduce (as
    Horovod's tensor fusion and DDP's buckets do), since a collective's fixed cost dwarfs a small
    tensor's wire time; a unit is still at most one slice, so P3's preemption grain is kept. The
    queue is the same on every worker, so the units are too."""
    first = ready.pop()
    unit, numel = [first], first.stop - first.start
    operations = {first.operation.index: first.operation}  # per key, the operation whose slices are in the unit
    while ready:
        following = ready.peek()
        size = following.stop - following.start
        if numel + size > first.operation.slice_size or not _fusible(first.operation, following.operation):
            break
        if following.operation.compression is not None \
                and operations.setdefault(following.operation.index, following.operation) is not following.operation:
            break  # a key's second operation: its residual is the first's, encoded together it would count twice
        unit.append(ready.pop())
        numel += size
    return unit


def _fusible(first: Operation, other: Operation) -> bool:
    """Slices of the two operations may share one collective: the same encoding, dtype and device."""
    return (first.compression is other.compression and first.value.dtype == other.value.dtype
            and first.target.device == other.target.device)  # fmt: skip


class _Unfuse:
    """A fused unit's completion: each slice's piece of the summed buffer, into its operation's target
    (widened to the target's dtype where the buffer is a 16-bit compressed sum)."""

    __slots__ = ("unit", "fused")

    def __init__(self, unit: list[_Slice], fused: torch.Tensor) -> None:
        self.unit, self.fused = unit, fused

    def __call__(self) -> None:
        targets = [elements(part.operation.target, part.start, part.stop) for part in self.unit]
        torch._foreach_copy_(targets, list(self.fused.split([target.numel() for target in targets])))  # one op


class _Decode:
    """A compressed unit's completion: the sum in rank order of every worker's decoded message, into
    each slice's target."""

    __slots__ = ("unit", "compression", "gathered")

    def __init__(self, unit: list[_Slice], compression: GradientCompression, gathered: list[torch.Tensor]) -> None:
        self.unit, self.compression, self.gathered = unit, compression, gathered

    def __call__(self) -> None:
        sizes, dtype = [part.stop - part.start for part in self.unit], self.unit[0].operation.target.dtype
        total = decode_parts(self.compression, self.gathered[0], sizes, dtype)
        for message in self.gathered[1:]:
            total.add_(decode_parts(self.compression, message, sizes, dtype))
        _Unfuse(self.unit, total)()


class _Done:
    """A unit's future callback (on the group's thread): finish the unit, count it, complete each slice's part."""

    __slots__ = ("scheduler", "handles", "finish", "cuda")

    def __init__(self, scheduler: Scheduler, handles: list[Handle], finish: Callable[[], None], cuda: bool) -> None:
        self.scheduler, self.handles, self.finish, self.cuda = scheduler, handles, finish, cuda

    def __call__(self, future: Any) -> None:
        try:
            future.value()  # raises the collective's error
            self.finish()
            if self.cuda:  # finish queued copies (unfuse, decode): they land before anyone reads the sum
                torch.cuda.current_stream().synchronize()
        except BaseException as error:  # noqa: BLE001 - reported to the store, which names the cause
            self.scheduler.broken(error)
            return
        self.scheduler._completed()
        for handle in self.handles:
            handle.part_done()
