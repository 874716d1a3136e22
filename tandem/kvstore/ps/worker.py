"""The worker side of ``dist_sync`` / ``dist_async``: plans each key into slices and sends them.

Each push, pull or pushpull becomes one request per slice (``placement``), all completing one
``Handle`` (for one key in one slice, the commonest case, the handle is the request's reply
callback too). Pulled slices are received straight into the caller's tensor by the receiving
thread (the IO thread, or the thread waiting on the handle), which is why results are only
visible after ``wait``.
"""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch

from tandem.env import knob
from tandem.kvstore import compression
from tandem.kvstore.base import Handle, Key, KVStore, Receiver, normalize, reduce_sum
from tandem.kvstore.compression import COMPRESSIBLE, Compressor, GradientCompression
from tandem.kvstore.config import DistOptions
from tandem.kvstore.errors import KVStoreError, KVStoreTimeout, ProtocolError, RequestRefused, second_init
from tandem.kvstore.flat import elements
from tandem.kvstore.ps.client import Client, Submission, message_text
from tandem.kvstore.ps.placement import Placement, RangePlacement, Slice
from tandem.kvstore.ps.protocol import Command, Header, Message, Role, tensor_bytes, tensor_from_bytes
from tandem.kvstore.ps.server import hello_info
from tandem.kvstore.ps.topology import Topology, connect_store, gather_over_workers, server_addresses
from tandem.kvstore.slots import optimizer_to_json

CACHE_LIMIT = 65536  # request headers and plans remembered (a job has a few per key)
Item = tuple[Key, torch.Tensor, list[torch.Tensor]]  # key, value to send, tensors receiving the result
_PUSHES = frozenset({Command.PUSH, Command.PUSHPULL})  # what gradient compression applies to (never INIT)
T = TypeVar("T")


class DistKVStore(KVStore):
    """A worker's store. Thread safety: drive it from one thread; handles may be waited on anywhere."""

    def __init__(self, topology: Topology, options: DistOptions, placement: Placement | None = None) -> None:
        self.topology, self.options, self.kind = topology, options, options.kind
        # slots cut to fit a frame whatever their dtype (8 bytes an element at most)
        self.placement = placement or RangePlacement(topology.num_servers, options.bigarray_bound,
                                                     options.max_frame_bytes // 8)  # fmt: skip
        self.rendezvous = connect_store(topology, options.rendezvous_timeout)  # kept: P3's tuner agrees through it
        self.addresses = server_addresses(self.rendezvous, topology.num_servers, options.rendezvous_timeout,
                                          options.secret_bytes)  # fmt: skip
        self._client = Client(self.addresses, topology.rank, options, hello_info(topology, options))
        self._initialised: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}  # key -> its shape and dtype
        self._headers: dict[tuple[Any, ...], Header] = {}  # see _header
        self._plans: dict[tuple[Any, ...], list[Slice]] = {}  # see _plan
        self._compressor: Compressor | None = None  # see set_gradient_compression
        self._closed = False
        self._gathers = 0  # gather calls so far (see gather)
        try:
            self._client.connect()
        except BaseException:
            self._client.close(timeout=1.0)
            raise
        atexit.register(self._close_at_exit)  # servers finish cleanly even if the script forgets close()

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def num_workers(self) -> int:
        return self.topology.num_workers

    @property
    def num_servers(self) -> int:
        return self.topology.num_servers

    def _header(self, command: Command, key: Key, tensor: torch.Tensor, part: Slice, priority: int,
                compressed: bool = False) -> Header:  # fmt: skip
        """The request header, made once per request kind: its frame is packed once too (``encode_header``)."""
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        return _remember(self._headers, (command, type(key), key, priority, dtype, shape, part.start, part.stop,
                                         compressed),
                         lambda: Header(command, 0, Role.WORKER, self.rank, key=key, priority=priority, dtype=dtype,
                                        shape=shape, slice_start=part.start, slice_stop=part.stop,
                                        compressed=compressed))  # fmt: skip

    def _compresses(self, command: Command, value: torch.Tensor) -> bool:
        """Whether this request's value travels compressed: pushed gradients of float keys, when asked."""
        return self._compressor is not None and command in _PUSHES and value.dtype in COMPRESSIBLE

    def _payloads(self, command: Command, key: Key, flat: torch.Tensor, part: Slice, compressed: bool) -> list[memoryview]:
        """The frames carrying ``flat[part]`` (none for a pull; a descriptor and the data when compressed)."""
        if command is Command.PULL:
            return []
        if compressed:
            assert self._compressor is not None  # ensured by _compresses
            return self._compressor.encode(key, flat, part.start, part.stop)
        return [tensor_bytes(elements(flat, part.start, part.stop))]

    def _plan(self, key: Key, numel: int) -> list[Slice]:
        """``placement.plan``, remembered: a plan depends only on the placement, the key and its size."""
        return _remember(self._plans, (self.placement, type(key), key, numel), lambda: self.placement.plan(key, numel))

    def _check_usable(self) -> None:
        if self._closed:
            raise KVStoreError("this kvstore is closed; create a new one")
        if self._client.failure is not None:
            raise self._client.failure

    def _send_tensors(self, command: Command, items: list[Item],
                      priority: int, what: str) -> Handle:  # fmt: skip
        """One request per slice of every (key, value to send, tensors receiving the result) item."""
        self._check_usable()
        if len(items) == 1:  # the common case (one key, one slice) takes a path with a third of the objects
            key, value, targets = items[0]
            slices = self._plan(key, value.numel())
            whole = len(slices) == 1 and slices[0].numel == value.numel()
            if whole and (not targets or (len(targets) == 1 and _lands_directly(targets[0]))):
                return self._send_one(command, key, value, targets[0] if targets else None, slices[0], priority, what)
        plans = [(key, value, targets, self._plan(key, value.numel())) for key, value, targets in items]
        receivers = [_receiver(targets, value) if targets else (None, None) for _, value, targets, _ in plans]
        finishers = [finish for _, finish in receivers if finish is not None]
        parts = sum(len(slices) for *_, slices in plans)
        handle = Handle(what, parts, partial(_run_all, finishers) if finishers else None, self._client)
        requests: list[Submission] = []
        for (key, value, _, slices), (receive, _) in zip(plans, receivers):
            flat = value if value.dim() == 1 else value.reshape(-1)
            compressed = self._compresses(command, value)
            for part in slices:
                payloads = self._payloads(command, key, flat, part, compressed)
                requests.append((part.server, self._header(command, key, value, part, priority, compressed),
                                 payloads, _Reply(handle, receive, part), handle.fail))  # fmt: skip
        self._client.submit_many(requests)  # those bound for one server go together (coalesced)
        return handle

    def _send_one(self, command: Command, key: Key, value: torch.Tensor, target: torch.Tensor | None, part: Slice,
                  priority: int, what: str) -> Handle:  # fmt: skip
        """``_send_tensors`` of one key in one slice, its result (if any) landing in ``target``."""
        request = _OneRequest(what, self._client, part.server, target)
        compressed = self._compresses(command, value)
        payloads = self._payloads(command, key, value.view(-1), part, compressed)
        self._client.submit(part.server, self._header(command, key, value, part, priority, compressed), payloads,
                            request, request.fail)  # fmt: skip
        return request

    def init(self, keys: Key | Sequence[Key], values: Any) -> None:
        items = normalize(keys, values, "init")
        for key, tensors in items:
            if key in self._initialised:
                raise RequestRefused(second_init(key, self._initialised[key], (tuple(tensors[0].shape), tensors[0].dtype)))
        for key, tensors in items:
            itemsize, most = tensors[0].element_size(), self.options.max_frame_bytes
            if any(part.numel * itemsize > most for part in self._plan(key, tensors[0].numel())):
                raise KVStoreError(f"init: a slice of key {key!r} would carry more than {most} bytes, the frame limit "
                                   f"of every socket (TANDEM_PS_MAX_FRAME_BYTES); make slices smaller (slice_size) "
                                   f"or raise the limit on every process")  # fmt: skip
        self._initialised.update((key, (tuple(tensors[0].shape), tensors[0].dtype)) for key, tensors in items)
        if self.rank == 0:  # one copy is enough; the barrier makes it visible to every worker
            self._send_tensors(Command.INIT, [(k, reduce_sum(v), []) for k, v in items], 0, "init").wait()
        self.barrier()

    def push(self, keys: Key | Sequence[Key], values: Any, priority: int = 0) -> Handle:
        items: list[Item] = [
            (key, reduce_sum(tensors), []) for key, tensors in normalize(keys, values, "push")
        ]
        return self._send_tensors(Command.PUSH, items, priority, "push")

    def pull(self, keys: Key | Sequence[Key], out: Any, priority: int = 0) -> Handle:
        items = [(key, targets[0], targets) for key, targets in normalize(keys, out, "pull")]
        return self._send_tensors(Command.PULL, items, priority, "pull")

    def pushpull(self, keys: Key | Sequence[Key], values: Any, out: Any = None, priority: int = 0) -> Handle:
        sent = normalize(keys, values, "pushpull")
        received = sent if out is None else normalize(keys, out, "pushpull")
        for (key, tensors), (_, targets) in zip(sent, received):
            if targets[0].shape != tensors[0].shape or targets[0].dtype != tensors[0].dtype:
                raise KVStoreError(f"pushpull of key {key!r}: out {tuple(targets[0].shape)} {targets[0].dtype} "
                                   f"differs from values {tuple(tensors[0].shape)} {tensors[0].dtype}")  # fmt: skip
        items: list[Item]
        items = [(key, reduce_sum(tensors), targets) for (key, tensors), (_, targets) in zip(sent, received)]
        # results must not overwrite what is still being sent: send from a private copy
        items = [(key, value.clone() if value.data_ptr() == targets[0].data_ptr() else value, targets)
                 for key, value, targets in items]  # fmt: skip
        return self._send_tensors(Command.PUSHPULL, items, priority, "pushpull")

    def _broadcast(self, command: Command, *texts: str) -> list[str]:
        """Rank 0 sends a control request (``texts`` its payloads) to every server and waits; then all
        workers meet at a barrier. Returns, on rank 0, each server's reply text ("" if none); elsewhere []."""
        self._check_usable()
        replies = []
        if self.rank == 0:
            payloads = [memoryview(text.encode()) for text in texts]
            for server in range(self.num_servers):
                header = Header(command, 0, Role.WORKER, self.rank)
                reply = self._client.call(server, header, payloads, self.options.rendezvous_timeout)
                replies.append(message_text(reply))
        self.barrier()
        return replies

    def set_optimizer(self, optimizer: Any) -> None:
        self._broadcast(Command.SET_OPTIMIZER, optimizer_to_json(optimizer))

    def set_gradient_compression(self, params: GradientCompression | dict[str, Any] | str | None) -> None:
        """Compress this worker's pushes from now on (``tandem.kvstore.compression``): ``{"type": "2bit",
        "threshold": 0.5}`` (MXNet's form), ``"fp16"``, ``"bf16"``, ``"int8"``, ``"int4"``, or None / ``"none"`` to stop.

        Not collective: servers decode whatever arrives. Call it on every worker before the first push
        so that all workers' gradients are treated alike. Residuals start at zero (stopping drops them).
        """
        config = GradientCompression.parse(params)
        self._compressor = Compressor(config) if config.enabled else None

    @property
    def gradient_compression(self) -> GradientCompression:
        return self._compressor.config if self._compressor is not None else GradientCompression()

    def gather(self, what: str, text: str) -> list[str]:
        self._check_usable()
        self._gathers += 1  # each call its own keys: the store names every key once
        return gather_over_workers(self.rendezvous, f"gather/{what}/{self._gathers}", self.rank, self.num_workers,
                                   text, knob("TANDEM_PS_WAIT_TIMEOUT"))  # fmt: skip

    def barrier(self) -> None:
        self._check_usable()
        request = _OneRequest("barrier", self._client, 0, None)  # a handle that is its reply callback
        self._client.submit(0, Header(Command.BARRIER, 0, Role.WORKER, self.rank), [], request, request.fail)
        request.wait()

    def _settle(self) -> None:
        """Wait for this worker's outstanding requests, then for everyone's: no round is half-merged after."""
        limit = knob("TANDEM_PS_WAIT_TIMEOUT")
        deadline = time.monotonic() + limit
        self._client.wake_receiver()  # this thread polls below without driving
        while self._client.outstanding():
            self._check_usable()
            if time.monotonic() > deadline:
                raise KVStoreTimeout(f"outstanding kvstore requests did not finish within {limit:.1f} s")
            time.sleep(0.002)
        self.barrier()

    def save_server_state(self, path: str) -> None:
        self._checkpoint(Command.SAVE, path)

    def load_server_state(self, path: str) -> None:
        self._checkpoint(Command.LOAD, path)

    def _checkpoint(self, command: Command, *texts: str) -> list[str]:
        """SAVE or LOAD between steps: once every request is answered, ``_broadcast`` it (same return)."""
        self._settle()
        return self._broadcast(command, *texts)

    def close(self) -> None:
        self._close()

    def _close(self, abort_reason: str = "") -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if abort_reason and hasattr(
            self._client, "abort"
        ):  # P3's sender stands in for the client, maybe without it
            self._client.abort(abort_reason, timeout=self.options.timeout)
        else:
            self._client.close(timeout=self.options.timeout)

    def _close_at_exit(self) -> None:
        """At interpreter exit: a goodbye, or, if the script dies of an exception, an ABORT naming it.

        Without this a crashed worker would look finished, and the others would wait for its pushes.
        """
        error = getattr(sys, "last_value", None)  # set when an uncaught exception ended the main thread
        reason = f"worker {self.rank} died of {type(error).__name__}: {error}" if error is not None else ""
        self._close(abort_reason=reason)


def _remember(cache: dict[Any, T], key: Any, make: Callable[[], T]) -> T:
    """``cache[key]``, made on first use; a full cache starts over. Races between threads only lose entries."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= CACHE_LIMIT:
            cache.clear()
        value = cache[key] = make()
    return value


def _run_all(functions: list[Callable[[], None]]) -> None:
    for function in functions:
        function()


def _receiver(
    targets: list[torch.Tensor], like: torch.Tensor
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Where replies land (the first target when it is contiguous CPU memory) and what copies it onward."""
    first = targets[0]
    direct = _lands_directly(first)
    landing = first if direct else torch.empty(like.shape, dtype=like.dtype)
    rest = targets[1:] if direct else targets
    if not rest:
        return landing.view(-1), None

    def copy_onward() -> None:
        for target in rest:
            target.copy_(landing)

    return landing.view(-1), copy_onward


def _copy_value(message: Message, target: torch.Tensor, server: int) -> None:
    """A reply's value into ``target`` (flat), where the receiver could not land it there in place."""
    if message.header.compressed:  # a sum of compressed pushes, compressed back (the server's _compress_value)
        try:
            target.copy_(compression.decode(message.payloads, target.dtype, target.numel()))
        except ProtocolError as error:
            raise KVStoreError(f"server {server} answered with bad compressed values: {error}") from None
        return
    if len(message.payloads) != 1:
        raise KVStoreError(f"server {server} answered without a value payload")
    target.copy_(tensor_from_bytes(message.payloads[0], target.dtype, target.numel()))


def _lands_directly(target: torch.Tensor) -> bool:
    """Whether replies can be received straight into ``target`` (see ``_receiver``)."""
    return target.device.type == "cpu" and target.is_contiguous()


@dataclass
class _Reply:
    """Completes one slice of a handle; for pulls, ``landing`` lets the receiver take the value in place."""

    handle: Handle
    target: torch.Tensor | None  # the flat tensor the reply's values belong in
    part: Slice
    landing: memoryview | None = None  # bytes of target[part], read by Client when registering the request

    def __post_init__(self) -> None:
        if self.target is not None and self.part.numel:
            self.landing = tensor_bytes(elements(self.target, self.part.start, self.part.stop))

    def __call__(self, message: Message) -> None:
        if self.target is not None and not message.landed:
            _copy_value(message, self.target[self.part.start : self.part.stop], self.part.server)
        self.handle.part_done()


class _OneRequest(Handle):
    """The handle of a one-request operation, and that request's reply callback: one object, not three.

    ``landing`` (the bytes of ``target``) is where ``Client`` receives a pull's reply in place.
    """

    def __init__(self, what: str, receiver: Receiver, server: int, target: torch.Tensor | None) -> None:
        super().__init__(what, 1, receiver=receiver)
        self.server, self.target = server, target
        self.landing = tensor_bytes(target) if target is not None and target.numel() else None

    def __call__(self, message: Message) -> None:
        if self.target is not None and not message.landed:
            _copy_value(message, self.target.view(-1), self.server)
        self.part_done()
