"""The KVStore API shared by the local and the distributed stores, and the ``Handle`` of async ops.

Semantics follow MXNet's kvstore: ``push`` sends values (a list of values for one key is summed
first, one per device), ``pull`` copies the stored value out, ``pushpull`` does both in one trip.
push/pull are asynchronous: they return a ``Handle``; tensors passed to them must not be modified,
and ``out`` tensors must not be read, until the handle is done.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from tandem.env import knob
from tandem.kvstore.compression import GradientCompression
from tandem.kvstore.errors import KVStoreError, KVStoreTimeout

Key = int | str
Values = torch.Tensor | Sequence[torch.Tensor]


class Receiver(Protocol):
    """Whoever receives a store's replies (the distributed store's ``Client``), as a ``Handle`` sees it."""

    def drive(self, handle: Handle, deadline: float) -> None:
        """Receive replies on the calling thread until ``handle`` is done or ``deadline`` (or return
        at once where another thread receives)."""

    def wake_receiver(self) -> None:
        """Make sure replies are received although this thread will wait without driving."""


class Handle:
    """Completion of one asynchronous kvstore operation, made of ``parts`` network requests.

    Thread safety: parts complete (``part_done``/``fail``) from the kvstore's IO thread, or from a
    waiting thread that receives replies itself (``receiver.drive``), while any thread may call
    ``wait``/``done``. ``on_complete`` runs once, in the thread finishing the last part.

    ``receiver``, when given, is asked by ``wait`` to ``drive``: receive replies on the waiting
    thread until the handle is done (the distributed store's ``Client.drive``), which saves the
    hand-off from a receiving thread to the waiter on every reply. A waiter that does not drive
    (``wait(drive=False)``, a done callback) calls ``receiver.wake_receiver()`` instead, since the
    store's IO thread leaves receiving to drivers once one has driven.

    Why a bare lock and not ``threading.Event``: the lock is held while the operation runs and
    released once when it ends, so ``wait`` is one lock acquisition and finishing is one release;
    an Event goes through a Condition, allocating a waiter lock per wait, which is a measurable
    part of a small request's round trip.

    Example:
        ```python
        handle = kv.pushpull("w", grad, out=param)
        handle.add_done_callback(lambda h: print("done", h.error))   # must not block
        handle.wait(timeout=30)          # raises the operation's error, or KVStoreTimeout
        ```
    """

    def __init__(self, what: str, parts: int, on_complete: Callable[[], None] | None = None,
                 receiver: Receiver | None = None) -> None:  # fmt: skip
        self.what = what
        self._receiver = receiver
        self._remaining = parts
        self._on_complete = on_complete
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # guards _remaining, _finished and _callbacks
        self._running = threading.Lock()  # held until the operation finishes or fails
        self._running.acquire()
        self._finished = False
        self._callbacks: list[Callable[[Handle], None]] = []
        if parts == 0:
            self._finish()

    def part_done(self) -> None:
        with self._lock:
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def fail(self, error: BaseException) -> None:
        """Record the first error; the handle is done at once (other parts are ignored).

        Example:
            ```python
            handle = Handle("push of key 'w'", parts=2)   # what a store returns
            handle.fail(KVStoreError("server 1 stopped answering"))
            handle.done(), handle.error                      # True, that error; handle.wait() raises it
            ```
        """
        with self._lock:
            if self._finished:
                return
            self._error = error
            self._mark_finished()
        self._run_callbacks()

    def _mark_finished(self) -> None:
        """Under ``_lock``: wake every waiter, once."""
        self._finished = True
        self._running.release()

    def _finish(self) -> None:
        try:
            if self._on_complete is not None and self._error is None:
                self._on_complete()
        except BaseException as error:  # noqa: BLE001 - surfaced to the waiting caller instead
            self._error = error
        with self._lock:
            if self._finished:  # failed meanwhile
                return
            self._mark_finished()
        if self._callbacks:
            self._run_callbacks()

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Run ``callback(handle)`` once when the operation finishes or fails (at once if it already has).

        It runs in the thread completing the operation (the kvstore's receiving thread) or in the caller's
        thread if already done; keep it short and non-blocking. ``handle.error`` says whether it failed.

        Example:
            ```python
            handle = kv.push("w", grad)
            handle.add_done_callback(lambda h: print("push failed:", h.error) if h.error else None)
            ```
        """
        with self._lock:
            waiting = not self._finished
            if waiting:
                self._callbacks.append(callback)
        if not waiting:
            callback(self)
        elif self._receiver is not None:
            self._receiver.wake_receiver()  # the callback waits on replies nobody may drive

    def _run_callbacks(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    @property
    def error(self) -> BaseException | None:
        """The operation's error once done (None while running or after success).

        Example:
            ```python
            handle = kv.push("w", grad)
            if handle.done() and handle.error is not None:
                print("push failed:", handle.error)
            ```
        """
        return self._error if self._finished else None

    def done(self) -> bool:
        """True once the operation finished or failed; never blocks (a poller counts as a waiter).

        Example:
            ```python
            handle = kv.pushpull("w", grad, out=param)
            while not handle.done():
                do_other_work()
            ```
        """
        if self._finished:
            return True
        if self._receiver is not None:
            self._receiver.wake_receiver()  # whoever polls waits on replies nobody may drive
        return False

    def wait(self, timeout: float | None = None, drive: bool = True) -> None:
        """Block until done; raise the operation's error, or ``KVStoreTimeout`` after ``timeout`` seconds.

        ``timeout=None`` means ``TANDEM_PS_WAIT_TIMEOUT`` (300 s): a dead peer is reported sooner by
        heartbeats, so this only bounds waits on peers that are alive but stuck.

        ``drive=False`` leaves the replies to the store's IO thread, for a waiter that has other
        work to return to at once: it is woken as soon as its own operation is done, while the
        IO thread goes on receiving the others' replies (see ``DistributedTrainer._apply``).

        Example:
            ```python
            kv.pull("w", out).wait()           # out holds the value now
            kv.push("w", grad).wait(timeout=5) # KVStoreTimeout after 5 s
            ```
        """
        if not self._finished:
            limit = knob("TANDEM_PS_WAIT_TIMEOUT") if timeout is None else timeout
            deadline = time.monotonic() + limit
            if self._receiver is not None:
                if drive:
                    self._receiver.drive(self, deadline)  # returns once done, or at once if another thread receives
                else:
                    self._receiver.wake_receiver()
            if not self._running.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                raise KVStoreTimeout(f"{self.what} did not finish within {limit:.1f} s (TANDEM_PS_WAIT_TIMEOUT)")
            self._running.release()  # the next waiter (any thread) passes too
        if self._error is not None:
            raise self._error.with_traceback(None)  # the failing thread's frames only confuse the caller

    @classmethod
    def completed(cls, what: str) -> Handle:
        return cls(what, 0)


def normalize(keys: Key | Sequence[Key], values: Any, what: str) -> list[tuple[Key, list[torch.Tensor]]]:
    """Pair every key with its list of tensors (one per device) and check the types, naming the fix."""
    if (type(keys) is str or type(keys) is int) and isinstance(values, torch.Tensor):  # the common case, cheaply
        return [(keys, [values])]
    if not isinstance(keys, Sequence) or isinstance(keys, str):
        return [(_check_key(keys), _tensor_list(keys, values, what))]
    keys = list(keys)
    if not isinstance(values, Sequence) or isinstance(values, torch.Tensor) or len(values) != len(keys):
        raise KVStoreError(f"{what}: {len(keys)} keys need a list of {len(keys)} values (one per key)")
    return [(_check_key(key), _tensor_list(key, value, what)) for key, value in zip(keys, values)]


def _check_key(key: Any) -> Key:
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise KVStoreError(f"kvstore keys are int or str, got {type(key).__name__} {key!r}")
    return key


def _tensor_list(key: Key, value: Any, what: str) -> list[torch.Tensor]:
    tensors = (
        [value] if isinstance(value, torch.Tensor) else list(value) if isinstance(value, Sequence) else None
    )
    if not tensors or not all(isinstance(tensor, torch.Tensor) for tensor in tensors):
        raise KVStoreError(
            f"{what} of key {key!r}: expected a tensor or a non-empty list of tensors, got {value!r}"
        )
    first = tensors[0]
    for tensor in tensors[1:]:
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise KVStoreError(
                f"{what} of key {key!r}: the per-device values differ ({tuple(first.shape)}/{first.dtype} vs "
                f"{tuple(tensor.shape)}/{tensor.dtype}); pass tensors of one shape and dtype"
            )
    return tensors


def reduce_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of per-device values as one contiguous CPU tensor (no copy for a single CPU tensor)."""
    first = tensors[0]
    if len(tensors) == 1 and first.is_cpu and not first.requires_grad and first.is_contiguous():
        return first  # already what is sent: skip three no-op torch calls
    total = first.detach().to("cpu").contiguous()
    if len(tensors) > 1:
        total = total.clone()
        for tensor in tensors[1:]:
            total.add_(tensor.detach().to("cpu"))
    return total


class KVStore(ABC):
    """Key-value store for data-parallel training; see the module docstring for the semantics.

    Thread safety: one thread should drive a store; handles may be waited on from any thread.
    Collective calls (``init``, ``set_optimizer``, ``barrier``, ``save/load_server_state``) must be
    made by every worker in the same order.

    Example:
        ```python
        kv = tandem.kvstore.create("local")        # or "dist_sync" in a worker of a job
        kv.init(["w", "b"], [torch.zeros(3), torch.zeros(1)])
        kv.set_optimizer(tandem.optim.SGD(lr=0.1))  # updates run where the values are stored
        w, b = torch.empty(3), torch.empty(1)
        kv.pushpull(["w", "b"], [torch.ones(3), torch.ones(1)], out=[w, b]).wait()   # w is [-0.1, -0.1, -0.1]
        kv.close()
        ```
    """

    kind: str = "base"

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def num_workers(self) -> int: ...

    @property
    @abstractmethod
    def num_servers(self) -> int: ...

    @abstractmethod
    def init(self, keys: Key | Sequence[Key], values: Any) -> None:
        """Set initial values (collective, blocking); initialising a key twice raises.

        Example:
            ```python
            kv.init("w", torch.zeros(3))
            kv.init(["a", "b"], [torch.zeros(2), torch.ones(4)])     # several keys at once
            ```
        """

    @abstractmethod
    def push(self, keys: Key | Sequence[Key], values: Any, priority: int = 0) -> Handle:
        """Send values (summed per key over devices) to be aggregated; asynchronous.

        Example:
            ```python
            handle = kv.push("w", grad, priority=-1)   # among queued requests, higher priority goes first
            handle.wait()                              # grad may be changed again only after this
            ```
        """

    @abstractmethod
    def pull(self, keys: Key | Sequence[Key], out: Any, priority: int = 0) -> Handle:
        """Copy the current values into ``out`` (visible after ``wait``); asynchronous.

        Example:
            ```python
            kv.pull(["w", "b"], out=[w, b]).wait()     # w and b hold the stored values now
            ```
        """

    @abstractmethod
    def pushpull(self, keys: Key | Sequence[Key], values: Any, out: Any = None, priority: int = 0) -> Handle:
        """Push then pull in one trip; ``out=None`` writes the result into ``values``; asynchronous.

        Example:
            ```python
            # data-parallel SGD with the optimizer on the servers: gradients in, parameters out
            kv.pushpull("w", param.grad / kv.num_workers, out=param.data).wait()
            ```
        """

    def batched(self) -> AbstractContextManager[None]:
        """Requests made while the block is open may be held and sent together when it ends: fewer,
        larger messages. Handles and results are as without it; at the block's end the requests
        leave as they would have (under the same limits): do not wait inside the block on a request
        made in it, which has not left yet. Only a store whose requests queue by priority
        (``dist_p3``) holds them; elsewhere this does nothing.

        Example:
            ```python
            with kv.batched():                # one message per server, not one per key
                handles = [kv.pushpull(k, g, out=p) for k, g, p in zip(keys, grads, params)]
            ```
        """
        return nullcontext()

    @abstractmethod
    def set_optimizer(self, optimizer: Any) -> None:
        """Run updates with ``optimizer`` (a ``tandem.optim.Optimizer``) where values are stored (collective).

        Example:
            ```python
            kv.set_optimizer(tandem.optim.SGD(lr=0.1))
            kv.push("w", grad).wait()         # the stored w is now w - 0.1 * grad
            ```
        """

    def set_gradient_compression(self, params: Any) -> None:
        """Compress pushed gradients (``{"type": "2bit", "threshold": 0.5}``, "fp16", "bf16", "int8", "int4"; see
        ``tandem.kvstore.compression``). Only distributed stores compress: bytes cost nothing here.

        Example:
            ```python
            kv = tandem.kvstore.create("dist_sync")          # a worker of a job
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})   # or "fp16", "bf16", "int8", "int4"
            ```
        """
        if not GradientCompression.parse(params).enabled:
            return
        raise KVStoreError(f"the {self.kind} kvstore does not compress gradients (no network to save); "
                           f"use a dist_* kvstore, or drop the compression setting")  # fmt: skip

    @abstractmethod
    def barrier(self) -> None:
        """Block until every worker reached the barrier (collective).

        Example:
            ```python
            kv.barrier()                      # every worker has got here
            ```
        """

    def gather(self, what: str, text: str) -> list[str]:
        """Every worker's ``text``, in rank order, on every worker (collective: each worker calls it
        with the same ``what``, the same number of times, in the same order). Alone: ``[text]``.

        Example:
            ```python
            steps = kv.gather("resume-step", str(step))   # ["120", "120"] on both workers of a job
            ```
        """
        return [text]

    @abstractmethod
    def save_server_state(self, path: str) -> None:
        """Checkpoint stored values and optimizer state under directory ``path`` (collective).

        Example:
            ```python
            kv.save_server_state("ckpt/kvstore")
            ```
        """

    @abstractmethod
    def load_server_state(self, path: str) -> None:
        """Restore what ``save_server_state`` wrote (collective); keys must have been ``init``-ed.

        Example:
            ```python
            kv.init("w", torch.zeros(3))      # the same keys as when saved
            kv.load_server_state("ckpt/kvstore")
            ```
        """

    @abstractmethod
    def close(self) -> None:
        """Finish outstanding work and release resources; idempotent.

        Example:
            ```python
            kv.close()
            with tandem.kvstore.create("local") as kv:   # or as a context manager: closed on exit
                kv.init("w", torch.zeros(3))
            ```
        """

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
