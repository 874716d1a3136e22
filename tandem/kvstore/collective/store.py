"""``kvstore="collective"``: the workers all-reduce their gradients among themselves; no servers.

A push or pushpull of a key is an all-reduce (sum over workers) of its value, cut into slices of
``slice_size`` elements, issued by the scheduler (``scheduler.py``) in priority order with at most
``water_mark`` collectives in flight (each one slice, or small slices fused up to one slice's
size), the same collectives in the same order on every worker: agreed in rounds, or, with
``ordered`` (a Trainer's where nothing overtakes: TANDEM_COLLECTIVE_ORDERED), in the order every
worker submits them. What a
dist_sync store without a server-side optimizer stores, this one computes: the sum of the round's
pushes, which ``pushpull`` writes into ``out`` and ``pull`` returns. Optimizers run on the workers
(the Trainer applies each parameter's update to the summed gradient on every worker, so the
parameters stay identical everywhere). Gradient compression compresses each worker's slice (with
its error-feedback residual). fp16 and bf16 slices are all-reduced in 16 bits, as DDP's fp16 and
bf16 hooks do (fp16 values clamped so that the sum of every worker's stays in range); the
all-reduce gives every worker the same sum. int8, int4 and 2-bit codes cannot be summed as they are:
those slices are all-gathered, and every worker decodes and sums the same values in rank order.
Slices that share a collective are encoded as one message (int8 and int4 blocks never straddle two slices). ``slice_size="auto"`` tunes the slice size,
water mark and send timing with P3's tuner, its scores averaged over the workers through the
rendezvous store, so that every worker switches at the same step.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.env import knob
from tandem.kvstore.base import Handle, Key, KVStore, normalize
from tandem.kvstore.collective.group import Group, Monitor, data_group, exit_later, gather, gloo_group
from tandem.kvstore.collective.scheduler import Operation, Scheduler
from tandem.kvstore.compression import COMPRESSIBLE, GradientCompression
from tandem.kvstore.config import DistOptions, P3Options
from tandem.kvstore.errors import KVStoreError, PeerFailure, RequestRefused, second_init
from tandem.kvstore.flat import flat_view
from tandem.kvstore.ps.p3_tuner import AutoTuner, Config, start_slice_size, tuner_for
from tandem.kvstore.ps.topology import connect_store

# the tuner's send timings here (a Trainer's "auto"): "ordered" is "during", issued in order without rounds
ORDERED_TIMING = "ordered"
COLLECTIVE_SEND_TIMINGS = ("during", ORDERED_TIMING, "after", "serial")
_STORES_CREATED = itertools.count()  # names each store's keys in the rendezvous store (workers create them in step)


class CollectiveKVStore(KVStore):
    """A worker's collective store (see the module docstring). Drive it from one thread; handles may
    be waited on anywhere. ``init``, ``barrier`` and ``set_gradient_compression`` are collective.

    Example:
        ```python
        kv = tandem.kvstore.create("collective")       # under tandem launch -n 2 -s 0, or torchrun
        kv.init("w", torch.zeros(3))                   # worker 0's value, on every worker
        kv.pushpull("w", grad, out=summed).wait()      # summed: the sum of every worker's grad
        ```
    """

    kind = "collective"

    def __init__(self, group: Group, options: DistOptions, p3: P3Options, name: str | None = None) -> None:
        """``name``: what the workers' stores meet under in the rendezvous store (default: the how-manieth
        store this process makes, the same on every worker when they make them in step)."""
        self.group, self.options, self.p3 = group, options, p3
        self.wait_timeout = float(knob("TANDEM_PS_WAIT_TIMEOUT"))
        self.rendezvous = connect_store(group, options.rendezvous_timeout)
        name = str(next(_STORES_CREATED)) if name is None else name
        self.prefix = f"tandem/collective/{group.incarnation}/{name}/"
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        # the monitor's own client: a heartbeat must not queue behind this thread's blocking waits
        self.monitor = Monitor(connect_store(group, options.rendezvous_timeout), self.prefix, group, options.heartbeat, options.timeout, self._fail)
        connect = max(options.rendezvous_timeout, self.wait_timeout)
        self._control = gloo_group(self.rendezvous, f"{self.prefix}control/", group, connect)  # the scheduler's rounds
        self._main = gloo_group(self.rendezvous, f"{self.prefix}main/", group, connect)  # init, from the caller's thread
        self.monitor.start()
        self._scheduler: Scheduler | None = None  # made at the first init, with a data group for the values' device
        self._keys: dict[Key, tuple[int, tuple[int, ...], torch.dtype]] = {}  # key -> index, shape, dtype
        self._latest: dict[Key, torch.Tensor] = {}  # key -> its last sum (flat), what pull returns
        self._last: dict[Key, Handle] = {}  # key -> the handle of its last push
        self._held: list[Operation] | None = None  # inside batched(): operations not yet submitted
        self._calls = 0  # collective calls through the rendezvous store: names each one's keys
        self._compression: GradientCompression | None = None
        self.slice_size, self.water_mark = start_slice_size(p3), p3.water_mark
        self.send_timing = "during"  # read by the trainer each step (p3_tuner.SEND_TIMINGS)
        # issue in submission order, without agreement rounds (scheduler.py): only where every worker
        # submits the same operations in the same order (a Trainer sets it: TANDEM_COLLECTIVE_ORDERED)
        self.ordered = False
        self.tune_order = False  # the tuner's send timing ORDERED_TIMING chooses it (a Trainer's "auto")
        self.tuner: AutoTuner | None = tuner_for(p3, self._apply, self._agree)
        atexit.register(self._close_at_exit)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def num_workers(self) -> int:
        return self.group.size

    @property
    def num_servers(self) -> int:
        return 0  # no server processes

    @property
    def send_bucket_elements(self) -> int:
        """What a trainer's send waits for by default (TANDEM_SEND_BUCKET_ELEMENTS=-1): one slice of
        finished gradients, so that a segment's few small gradients share a collective (and, in
        rounds, each agreement round issues at least one full collective)."""
        return int(self.slice_size)

    @property
    def send_timings(self) -> tuple[str, ...]:
        """The send timings the tuner may choose from here, from the most overlap to none: ``during`` in
        rounds (later sends overtake, P3), ``ordered`` (during, in order, no rounds), ``after``, ``serial``."""
        return COLLECTIVE_SEND_TIMINGS

    @property
    def rounds(self) -> int:
        """Agreement rounds run so far (one small all-reduce each; see ``scheduler.py``)."""
        return self._scheduler.rounds if self._scheduler is not None else 0

    @property
    def collectives(self) -> int:
        """Data collectives issued so far (each carries one slice, or several small ones fused)."""
        return self._scheduler.issued if self._scheduler is not None else 0

    # -- the tuner -------------------------------------------------------------------------------
    def _apply(self, config: Config) -> None:
        """A tuner point: taken by the operations submitted from now on (the same step on every worker)."""
        self.slice_size, self.water_mark = config.slice_size, config.water_mark
        self.send_timing = "during" if config.send_timing == ORDERED_TIMING else config.send_timing
        if self.tune_order:  # rounds only where a later send may overtake (during backward): one call needs none
            self.ordered = config.send_timing != "during"

    def _agree(self, cost: float) -> float:
        values = self.gather("tuner", repr(cost))
        return statistics.fmean(float(value) for value in values)  # same values, same order: same result

    def gather(self, what: str, text: str) -> list[str]:
        """Every worker's ``text`` for this call (collective), in rank order; ends with the job."""
        return gather(self.rendezvous, self._name(what), self.rank, self.num_workers, text, self.wait_timeout,
                      self._check_failed)  # fmt: skip

    def _check_failed(self) -> None:
        """Raise the job's failure, if it failed (here, or by another worker's abort)."""
        if self._failure is None and self.rendezvous.check([f"{self.prefix}abort"]):
            self._fail(PeerFailure(f"the job was stopped: {self.rendezvous.get(f'{self.prefix}abort').decode()}"))
        if self._failure is not None:
            raise self._failure

    def _name(self, what: str) -> str:
        self._calls += 1
        return f"{self.prefix}{what}/{self._calls}"

    # -- collective set-up -----------------------------------------------------------------------
    def init(self, keys: Key | Sequence[Key], values: Any) -> None:
        """Collective: every worker inits the same keys, in the same order, with the same shapes and
        dtypes, and the same slice size (checked: a difference names the key and both shapes, or both
        slice sizes); worker 0's values are stored. A key is initialised once: a second init, with
        the same shape or another, raises ``RequestRefused`` naming the key and both shapes and dtypes."""
        self._check_usable()
        items = normalize(keys, values, "init")
        for key, tensors in items:  # a second init is refused, as by every store (errors.second_init)
            if key in self._keys:
                _, shape, dtype = self._keys[key]
                raise RequestRefused(second_init(key, (shape, dtype), (tuple(tensors[0].shape), tensors[0].dtype)))
        # the scheduler's agreement covers every key: settle first, so no worker adds one mid-round
        self._settle()
        mine = [(repr(key), list(tensors[0].shape), str(tensors[0].dtype)) for key, tensors in items]
        slicing = "auto" if self.tuner is not None else str(self.slice_size)  # cuts every worker's slices alike
        everyone = [json.loads(text) for text in self.gather("init", json.dumps([slicing, mine]))]
        for rank, (theirs, _) in enumerate(everyone):
            if theirs != everyone[0][0]:
                raise KVStoreError(f"the workers' slice sizes differ: {everyone[0][0]} on worker 0 but {theirs} on "
                                   f"worker {rank}; every worker must set the same slice_size (the same "
                                   f"kvstore options and TANDEM_KVSTORE_SLICE_THRESHOLD)")  # fmt: skip
        _check_same(mine, [keys for _, keys in everyone])
        if self._scheduler is None:
            device = items[0][1][0].device if items else torch.device("cpu")
            data = data_group(self.rendezvous, f"{self.prefix}data/", self.group, self.wait_timeout, device)
            self._scheduler = Scheduler(self.rank, self.num_workers, self._control, data, self.wait_timeout,
                                        self._collective_failed)  # fmt: skip
        for key, tensors in items:
            value = tensors[0].detach().reshape(-1).clone()
            self._main.broadcast([value], dist.BroadcastOptions()).wait(timedelta(seconds=self.wait_timeout))
            self._keys[key] = (self._scheduler.add_key(), tuple(tensors[0].shape), tensors[0].dtype)
            self._latest[key] = value

    def set_gradient_compression(self, params: Any) -> None:
        """Collective: compress every worker's slices (see the module docstring); the workers must agree."""
        config = GradientCompression.parse(params)
        texts = self.gather("compression", f"{config.type}:{config.threshold}")
        if len(set(texts)) != 1:
            raise KVStoreError(f"the workers set different gradient compressions {texts} (by rank); every "
                               f"worker of a collective job must set the same")  # fmt: skip
        self._compression = config if config.enabled else None

    def set_optimizer(self, optimizer: Any) -> None:
        raise KVStoreError("the collective kvstore has no servers to run an optimizer: update on the workers "
                           "(tandem.Trainer does: the optimizer runs on each worker, on the summed gradients)")  # fmt: skip

    # -- data ------------------------------------------------------------------------------------
    def push(self, keys: Key | Sequence[Key], values: Any, priority: int = 0) -> Handle:
        return self._submit(keys, values, None, priority, "push")

    def pushpull(self, keys: Key | Sequence[Key], values: Any, out: Any = None, priority: int = 0) -> Handle:
        return self._submit(keys, values, values if out is None else out, priority, "pushpull")

    def _submit(self, keys: Key | Sequence[Key], values: Any, out: Any, priority: int, what: str) -> Handle:
        self._check_usable()
        assert self._scheduler is not None  # every key was initialised (_lookup), which made it
        items = normalize(keys, values, what)
        outs = normalize(keys, out, what) if out is not None else [(key, []) for key, _ in items]
        if self.tuner is not None:
            for key, _ in items:  # before any is submitted: a switch applies to the whole call
                self.tuner.observe(key)
        operations, copies = [], []
        for (key, tensors), (_, targets) in zip(items, outs):
            index = self._lookup(key, tensors[0], what)
            for target in targets:
                self._lookup(key, target, what)
            value = _flat_sum(tensors)
            first = targets[0] if targets else None
            lands = first is not None and first.is_contiguous() and first.device == value.device
            target = flat_view(first) if lands else torch.empty_like(value)  # type: ignore[arg-type]
            copies += [(target, other) for other in targets[1 if lands else 0 :]]
            self._latest[key] = target
            compression = self._compression if value.dtype in COMPRESSIBLE else None
            operations.append(Operation(index, key, value, target, self.slice_size, priority, self.water_mark,
                                        None, compression, self.ordered))  # type: ignore[arg-type]  # fmt: skip
        parts = sum(operation.count_slices() for operation in operations)
        handle = Handle(f"{what} of {_describe([key for key, _ in items])}", parts,
                        (lambda: _copy_out(copies)) if copies else None)  # fmt: skip
        for operation in operations:
            operation.handle = handle
            self._last[operation.key] = handle
        operations = [operation for operation in operations if operation.value.numel()]
        if self._held is not None:
            self._held += operations
        elif operations:
            self._scheduler.submit(operations)
        return handle

    @contextmanager
    def batched(self) -> Iterator[None]:
        """The operations of the requests made inside reach the scheduler together when it ends, as
        one call (in rounds, one agreement covers them all), and their small slices share
        collectives. From the thread that
        drives the store; ``init``, ``barrier`` and ``close`` inside the block raise (they would wait
        for requests that have not left)."""
        if self._held is not None:  # nested: the outer block submits
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                assert self._scheduler is not None  # operations exist only once a key was initialised
                try:
                    self._scheduler.submit(held)
                except BaseException as error:  # their handles were given out: they fail, not hang
                    for operation in held:
                        operation.handle.fail(error)
                    raise

    def pull(self, keys: Key | Sequence[Key], out: Any, priority: int = 0) -> Handle:
        """The keys' last sums (their init values before any push), once the pushes before it are done.

        No copy is kept of a sum written into a caller's tensor: after ``pushpull(key, ..., out=x)``
        (or without ``out``: into the pushed value) pull reads ``x`` itself, so it returns what ``x``
        holds then; change ``x`` and pull returns the change. A ``push``'s sum is the store's own."""
        self._check_usable()
        items = normalize(keys, out, "pull")
        copies = []
        for key, targets in items:
            for target in targets:
                self._lookup(key, target, "pull")
                copies.append((self._latest[key], target))
        before = {id(handle): handle for key, _ in items if (handle := self._last.get(key)) is not None}
        handle = Handle(f"pull of {_describe([key for key, _ in items])}", len(before) + 1,
                        lambda: _copy_out(copies))  # fmt: skip
        for earlier in before.values():
            earlier.add_done_callback(lambda done: handle.fail(done.error) if done.error else handle.part_done())
        handle.part_done()
        return handle

    def _lookup(self, key: Key, tensor: torch.Tensor, what: str) -> int:
        known = self._keys.get(key)
        if known is None:
            raise RequestRefused(f"{what} of key {key!r}: key was never initialised; call init first "
                                 f"(with the same keys on every worker)")  # fmt: skip
        index, shape, dtype = known
        if tensor.shape != shape or tensor.dtype != dtype:  # (torch.Size equals the tuple)
            raise RequestRefused(f"{what} of key {key!r}: got shape {tuple(tensor.shape)} {tensor.dtype}, but the "
                                 f"key was initialised as {shape} {dtype}")  # fmt: skip
        return index

    def barrier(self) -> None:
        """Collective: once this worker's operations are done, wait for every worker to get here."""
        self._settle()
        self.gather("barrier", "")

    def _settle(self) -> None:
        if self._held is not None:
            raise KVStoreError("init, barrier and close wait for this worker's requests, but requests made inside "
                               "kv.batched() leave only when the block ends: call them after it")  # fmt: skip
        for handle in list(self._last.values()):
            handle.wait()

    def save_server_state(self, path: str) -> None:
        raise KVStoreError("the collective kvstore has no server state: the workers hold the parameters and the "
                           "optimizer state (save them with tandem.Trainer.save)")  # fmt: skip

    def load_server_state(self, path: str) -> None:
        self.save_server_state(path)

    # -- failures and closing --------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise KVStoreError("this kvstore is closed; create a new one")
        if self._failure is not None:
            raise self._failure

    def _collective_failed(self, error: BaseException) -> None:
        """A collective failed: gloo says a peer's connection closed, not whose. Give the heartbeats
        their timeout to name the peer, then fail with that (or with the collective's own error)."""

        def settle() -> None:
            deadline = time.monotonic() + self.options.timeout + 2 * self.options.heartbeat
            while self._failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            self._fail(PeerFailure(f"a collective of the job failed and no worker was found dead: {error}"))

        threading.Thread(target=settle, name="tandem-collective-settle", daemon=True).start()

    def _fail(self, failure: BaseException) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
        if self._scheduler is not None:
            self._scheduler.fail(failure)
        print(f"tandem kvstore, worker {self.rank}: {failure}", file=sys.stderr, flush=True)
        self.monitor.post_abort(f"worker {self.rank}: {failure}")
        self.monitor.stop(closed=False)
        if self.options.exit_on_failure and not self._closed:
            exit_later(self.rank, str(failure))

    def close(self) -> None:
        self._close()

    def _close(self, abort_reason: str = "") -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if abort_reason:
            self.monitor.post_abort(abort_reason)
        elif self._failure is None:
            try:
                self._settle()
            except KVStoreError:
                pass  # the failure is reported where the handle is waited on
        if self._scheduler is not None:
            self._scheduler.stop(timeout=self.options.timeout)
        self.monitor.stop(closed=not abort_reason)
        self._release_groups()

    def _release_groups(self) -> None:
        """Drop the process groups here, on the closing thread. Left to the interpreter's exit, a group
        that ran collectives may be torn down on one of its own threads, which aborts the process."""
        if self._scheduler is not None:
            self._scheduler.data = self._scheduler.control = None
        self._control = self._main = None
        gc.collect()  # the groups' futures and callbacks may sit in reference cycles

    def _close_at_exit(self) -> None:
        """At interpreter exit: done, or, if the script dies of an exception, tell the others why."""
        error = getattr(sys, "last_value", None)  # set when an uncaught exception ended the main thread
        self._close(abort_reason=f"worker {self.rank} died of {type(error).__name__}: {error}" if error else "")


def _check_same(mine: list[Any], everyone: list[list[Any]]) -> None:
    """Every worker's init (key, shape, dtype) list equals worker 0's; else name the first difference."""
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for ours, other in zip(first, theirs):
            if ours != other:
                key, shape, dtype = ours
                other_key, other_shape, other_dtype = other
                what = (f"key {key} is {tuple(shape)} {dtype} on worker 0 but {tuple(other_shape)} {other_dtype} on "
                        f"worker {rank}") if key == other_key else f"worker 0 inits {key} where worker {rank} inits {other_key}"  # fmt: skip
                raise KVStoreError(f"the workers' parameters differ: {what}; every worker must init the same keys "
                                   f"in the same order with the same shapes (the same model)")  # fmt: skip
        if len(theirs) != len(first):
            raise KVStoreError(f"worker 0 inits {len(first)} keys but worker {rank} {len(theirs)}; every worker "
                               f"must init the same keys (the same model)")  # fmt: skip


def _flat_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of per-device values, flat (a view of a single contiguous value: no copy)."""
    total = flat_view(tensors[0])
    for tensor in tensors[1:]:
        total = total + flat_view(tensor).to(total.device)
    return total


def _copy_out(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for source, target in copies:
        target.copy_(source.view(target.shape))


def _describe(keys: list[Key]) -> str:
    return f"key {keys[0]!r}" if len(keys) == 1 else f"{len(keys)} keys ({keys[0]!r}, ...)"
