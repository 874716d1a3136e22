"""Data-parallel training on the parameter server: a step's gradients go to the servers, their
replies become the parameters.

Three modes, selectable for comparison (``Trainer(..., communication=...)``):
  - ``baseline``: backward completes, then every gradient is pushed, then every parameter pulled.
  - ``overlap``: each gradient is sent (pushpull, whole tensor, FIFO) the moment the backward
    segment that finishes it ends (PaddlePaddle's overlap).
  - ``p3``: the same on the ``dist_p3`` (or ``collective``) store: slices, priority ``-layer_index`` (layers nearest the
    input first), a cap on slices in flight. With ``slice_size="auto"`` the store's tuner may decide
    to hold the gradients until backward ends (``send_timing``), where overlap costs more CPU than it
    saves wire time: ``after``, still sent by priority and applied per segment by the next forward,
    or ``serial``, one pushpull of them all (in forward order, so by priority) that the step waits for.
Where the store asks for it (the collective store: one slice's worth; ``TANDEM_SEND_BUCKET_ELEMENTS``),
``overlap`` and ``p3`` hold finished gradients until a bucket of them is full, the rest until backward
ends: small gradients then share collectives. Segments end in graph order (the executor orders
them), so every worker submits the same sends in the same order, and the collective store may issue
them in that order without agreement rounds (``ordered``; ``TANDEM_COLLECTIVE_ORDERED``: ``auto``
for ``overlap``, and for ``p3`` where its tuner chooses the ``ordered`` timing).
In ``overlap`` and ``p3`` the next forward starts each segment as soon as the parameters *it* reads
are back: before pushing a forward segment, the step's ``before_segment`` hook waits for those
parameters' replies and pushes one engine op that writes them all (one fused optimizer update; it
writes each parameter's engine var, a tied parameter going by its first name). The engine runs that
write before the forward segments that read the parameters, while earlier segments already run;
segments whose parameters are not back yet are not pushed yet. Writes are only pushed from the next step's hooks, after the executor waited for
every segment of this step, so no backward segment (which reads forward-made views of the weights)
sees a new value.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch

from tandem import kvstore, trace
from tandem.env import knob
from tandem.executor import Segment, StepHooks
from tandem.graph.train_graph import Phase
from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.kinds import SERVERLESS_KINDS
from tandem.kvstore.ps.p3_tuner import SEND_TIMINGS
from tandem.step import StepResult, TrainStep
from tandem.update.base import Apply, Update

MODES = ("baseline", "overlap", "p3")


def resolve_mode(communication: str, kind: str) -> str:
    """The mode ``communication`` means on a store of ``kind`` (the kind ``kvstore.create`` makes: see
    ``kvstore.resolve_kind``); "auto" is p3 on the P3 kinds, sync or async, and overlap elsewhere."""
    p3_kinds = (*kvstore.P3_FOR.values(), *SERVERLESS_KINDS)  # the stores that slice and prioritise
    mode = ("p3" if kind in p3_kinds else "overlap") if communication == "auto" else communication
    if mode not in MODES:
        raise ValueError(f"communication must be 'auto' or one of {MODES}, got {communication!r}")
    if mode == "p3" and kind not in p3_kinds:
        raise ValueError(f"communication='p3' needs kvstore='dist_p3', 'dist_p3_async' or 'collective' (slices "
                         f"and priorities; or tandem launch --p3), got {kind!r}")  # fmt: skip
    return mode


def check_combination(store: kvstore.KVStoreConfig, communication: str, update_on_kvstore: bool) -> None:
    """Refuse, with the reason and the fix, a kvstore kind, communication mode and update location that
    would not train correctly; called by ``TrainerConfig``, so at ``Trainer(...)``, before any job is joined.

    Every other combination trains (docs/distributed.md#which-combinations-train, tested by
    tests/unit/test_combinations.py): training alone (``local``), both settings have no effect; on
    ``collective`` the optimizer always runs on the workers (there are no servers). Refused:

    - ``communication="p3"`` on a kind that does not slice (``dist_sync``, ``dist_async`` without
      ``tandem launch --p3``): ``resolve_mode``'s error;
    - ``update_on_kvstore=False`` on an asynchronous kind (``dist_async``, ``dist_p3_async``): its servers
      store each push as it arrives, so a worker's pushpull returns the gradient it just sent, never
      the sum over the workers, and every worker would train on its own gradients alone (MXNet refuses it too).

    Example:
        ```python
        store = tandem.kvstore.KVStoreConfig.resolve("dist_async")
        check_combination(store, "auto", update_on_kvstore=True)    # fine: the servers run the optimizer
        check_combination(store, "auto", update_on_kvstore=False)   # ValueError: ... keep update_on_kvstore=True
        ```
    """
    if not store.distributed:
        return  # nothing is sent: the update runs here whatever the settings say
    resolve_mode(communication, store.kind)
    if store.dist is not None and not store.dist.sync and not update_on_kvstore:
        raise ValueError(
            f"kvstore={store.kind!r} with update_on_kvstore=False (tandem train --update-on workers) would train "
            f"every worker on its own gradients only: an asynchronous server stores each push as it arrives, so "
            f"a pushpull returns the gradient this worker just sent, never the sum over the workers, and the "
            f"replicas drift apart. Keep update_on_kvstore=True (the default; --update-on servers: the servers "
            f"run the optimizer), or update on the workers with a synchronous kind ('dist_sync', 'dist_p3', "
            f"'collective')"
        )


class DistributedUpdate(Update):
    """Sends a step's gradients to a distributed kvstore and writes the replies into the parameters.
    Driven by the training thread; the gradient hook and the writes run on the engine's.

    With ``server_optimizer`` the servers run it and reply with the parameters; without, they reply
    with the sum of the workers' gradients, and ``apply`` updates the parameters here.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], apply: Apply, store: Any, mode: str,
                 server_optimizer: Any = None) -> None:  # fmt: skip
        super().__init__(params, apply, store)
        self.mode = mode
        self.server_optimizer = server_optimizer
        self._names: list[str] = []
        self._received: dict[str, torch.Tensor] = {}
        self._pending: dict[str, Any] = {}  # parameter name -> kvstore handle of its reply
        self._priority: dict[str, int] = {}
        self._attached: set[int] = set()
        self._held: list[tuple[str, torch.Tensor]] = []  # gradients kept until backward ends
        self._in_backward = False  # the hook has reached this step's backward segments
        self._batch_segments = knob("TANDEM_PS_BATCH_SEGMENTS")
        self._bucket_knob = knob("TANDEM_SEND_BUCKET_ELEMENTS")
        self._bucket: list[tuple[str, torch.Tensor]] = []  # finished gradients waiting for a full bucket
        self._bucket_numel = 0
        self._expected_sends: list[list[str]] | None = None  # collective store: each segment's sends, agreed
        self._sends_this_step = 0

    @classmethod
    def join(cls, params: Mapping[str, torch.Tensor], apply: Apply, optimizer: Any, kind: str | kvstore.KVStoreConfig,
             communication: str = "auto", update_on_kvstore: bool = True,
             gradient_compression: str | dict[str, Any] | None = None,
             clip_grad_norm: float | None = None) -> DistributedUpdate:  # fmt: skip
        """Join the job the environment describes as a worker (``kvstore.create(kind)``; ``kind`` a kind or a
        resolved ``kvstore.KVStoreConfig``). A ``collective`` job has no servers: the optimizer runs here
        whatever ``update_on_kvstore`` says."""
        config = kvstore.KVStoreConfig.of(kind)
        check_combination(config, communication, update_on_kvstore)  # Trainer(...) checked it already: other callers
        mode = resolve_mode(communication, config.kind)
        if config.kind in SERVERLESS_KINDS:
            update_on_kvstore = False  # no servers: every worker updates with the summed gradients
        if update_on_kvstore and isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("update_on_kvstore=True runs the optimizer on the servers: pass a tandem.optim "
                            "optimizer, or update_on_kvstore=False to keep a torch.optim optimizer here")
        if clip_grad_norm is not None:
            raise ValueError("clip_grad_norm is not supported with a distributed kvstore yet: gradients leave "
                             "per layer, before a global norm exists; clip inside loss_fn or drop the option")
        store = kvstore.create(config)
        store.set_gradient_compression(gradient_compression)
        return cls(params, apply, store, mode, server_optimizer=optimizer if update_on_kvstore else None)

    def shard(self, dataset: Any) -> Any:
        from tandem.data import shard

        return shard(dataset, self.rank, self.num_workers)

    # -- set-up: once per captured step --------------------------------------------------------
    def hooks(self, step: TrainStep) -> StepHooks:
        self._sends_this_step = 0  # before each run
        if id(step) not in self._attached:
            self._attached.add(id(step))
            self._attach(step)
        return super().hooks(step)

    def _attach(self, step: TrainStep) -> None:
        params = self.params
        self._names = list(step.graph.grads)  # parameter (forward) order
        self._priority = {name: -index for index, name in enumerate(self._names)}
        values = [params[n].detach() for n in self._names]
        self.store.init(self._names, values)  # collective: every worker starts from worker 0's values
        if self.server_optimizer is not None:
            self.store.set_optimizer(self.server_optimizer)
        self.store.pull(self._names, [params[n].data for n in self._names]).wait()
        self._received = {n: torch.empty_like(params[n]) for n in self._names}
        if self.mode != "baseline":
            step.add_segment_hook(self._send)
        tuner = getattr(self.store, "tuner", None)
        timings = SEND_TIMINGS
        if hasattr(self.store, "ordered"):  # segments end in graph order: every worker submits one sequence
            setting = str(knob("TANDEM_COLLECTIVE_ORDERED"))
            if setting not in ("auto", "1", "0"):
                raise ValueError(f"TANDEM_COLLECTIVE_ORDERED={setting!r}: use auto, 1 (in order) or 0 (rounds)")
            # in order where nothing overtakes (overlap sends in production order); p3 keeps its rounds
            self.store.ordered = setting == "1" or (setting == "auto" and self.mode != "p3")
            if setting == "auto" and self.mode == "p3" and tuner is not None:
                self.store.tune_order, timings = True, self.store.send_timings
            self._agree_on_sends(step, setting)
        if self.mode == "p3" and tuner is not None:
            tuner.tune_send_timing(timings)  # only a trainer can hold gradients until backward ends

    def _agree_on_sends(self, step: TrainStep, setting: str) -> None:
        """Collective, at attach: every worker groups its sends alike (else a clear error, not a hang or a
        sum of the wrong gradients): ordered collective sends are only summed right where every worker's
        are the same, since the store issues each send's slices as one sequence."""
        segments = [list(segment.gradients) for segment in step.executor.segments if segment.gradients]
        self._expected_sends = segments  # checked while sends go in order (the tuner may switch)
        mine = {"TANDEM_COLLECTIVE_ORDERED": setting, "communication": self.mode,
                "TANDEM_SEND_BUCKET_ELEMENTS": self._bucket_knob, "TANDEM_PS_BATCH_SEGMENTS": self._batch_segments,
                "sends": segments}  # fmt: skip
        everyone = [json.loads(text) for text in self.store.gather("sends", json.dumps(mine))]
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                difference = _first_difference(everyone[0], theirs)
                raise KVStoreError(f"worker {rank} groups its gradient sends differently from worker 0 ({difference}); "
                                   f"ordered collective sends need the same model, segment options (bulk_*) and "
                                   f"TANDEM_COLLECTIVE_ORDERED, TANDEM_SEND_BUCKET_ELEMENTS and "
                                   f"TANDEM_PS_BATCH_SEGMENTS on every worker")  # fmt: skip

    def _check_send(self, names: list[str]) -> None:
        """Each step's segments must send as the agreed first step's did (a step captured again for a batch
        of another layout may cut its segments elsewhere)."""
        expected, index = self._expected_sends, self._sends_this_step
        assert expected is not None
        self._sends_this_step += 1
        if self.store.ordered and (index >= len(expected) or expected[index] != names):
            agreed = expected[index] if index < len(expected) else "nothing more"
            raise KVStoreError(f"this step's segment {index} sends {names}, where the workers agreed on {agreed}: "
                               f"ordered collective sends need the same groups on every worker and every step "
                               f"(a batch of another layout was captured again and cut elsewhere?); set "
                               f"TANDEM_COLLECTIVE_ORDERED=0 to agree in rounds instead")  # fmt: skip

    # -- communication ---------------------------------------------------------------------------
    @property
    def _send_timing(self) -> str:
        """When this step's gradients leave (p3_tuner.SEND_TIMINGS): the P3 store's tuner may change it
        between steps; other stores always send during backward."""
        return str(getattr(self.store, "send_timing", "during"))

    def _send(self, gradients: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Segment hook (engine thread): send the gradients this segment finished now, together (one
        message per server where the store batches), or hold them; each reply lands in _received[name]."""
        if self._expected_sends is not None:
            self._check_send([name for name, _ in gradients])
        if self.mode == "p3" and self._send_timing != "during":
            self._held.extend(gradients)
            return
        bucket_elements = self._bucket_elements
        if bucket_elements > 0:  # fewer, larger sends: fused collectives (in rounds, fewer rounds) or messages
            self._bucket.extend(gradients)
            self._bucket_numel += sum(grad.numel() for _, grad in gradients)
            if self._bucket_numel < bucket_elements:
                return
            gradients, self._bucket, self._bucket_numel = self._bucket, [], 0
        self._pushpull_together(gradients)

    @property
    def _bucket_elements(self) -> int:
        """Elements of finished gradients a send waits for (TANDEM_SEND_BUCKET_ELEMENTS; -1: the store's
        ``send_bucket_elements``, 0 where it has none). Read each segment: a tuner may resize slices."""
        elements = int(self._bucket_knob)
        return elements if elements >= 0 else int(getattr(self.store, "send_bucket_elements", 0))

    def _pushpull_together(self, gradients: Sequence[tuple[str, torch.Tensor]]) -> None:
        """``_pushpull`` each, in one ``batched()`` block of the store (TANDEM_PS_BATCH_SEGMENTS)."""
        with self.store.batched() if self._batch_segments else nullcontext():
            for name, grad in gradients:
                self._pushpull(name, grad)

    def _pushpull(self, name: str, grad: torch.Tensor) -> None:
        start = trace.now_us()
        priority = self._priority[name] if self.mode == "p3" else 0
        self._pending[name] = self.store.pushpull(name, self._outgoing(grad), out=self._received[name], priority=priority)
        if trace.enabled():
            trace.record(f"send {name}", start, trace.now_us(), category="comm", args={"priority": priority})

    def _outgoing(self, grad: torch.Tensor) -> torch.Tensor:
        # Servers sum the workers' pushes: with mean-reduced losses, send grad / workers for the global mean.
        return grad / self.num_workers if self.server_optimizer is not None else grad

    def _before_segment(self) -> Callable[[Segment], None]:
        return self._gate

    def _gate(self, segment: Segment) -> None:
        """Before a segment is pushed (training thread): make its parameters' replies take effect."""
        if segment.phase == Phase.FORWARD:
            self._in_backward = False
            names = segment.parameters
        elif not self._in_backward:
            # The first backward segment: settle the previous step's replies no forward segment read.
            # Only here: once backward segments run, their hooks add *this* step's gradients to
            # _pending, and applying those mid-backward would change weights backward still reads.
            self._in_backward = True
            names = list(self._pending)
        else:
            return
        self._apply([name for name in names if name in self._pending])

    def _apply(self, names: list[str]) -> None:
        """Wait for the replies of ``names``, then push one engine op that writes them all (one fused
        update: the segment that reads them waits for every one of them anyway)."""
        if not names:
            return
        for name in names:
            start = time.perf_counter()
            # bounded by TANDEM_PS_WAIT_TIMEOUT; a dead peer is reported sooner by heartbeats. Not driven:
            # this thread must get back to feeding the engine, and the other parameters' replies are
            # better received meanwhile by the IO thread (driving made p3 steps ~10 % slower: docs/distributed.md)
            self._pending[name].wait(drive=False)
            waited = time.perf_counter() - start
            if trace.enabled() and waited > 0:
                trace.record(f"wait {name}", trace.now_us() - waited * 1e6, trace.now_us(), category="comm")
        for name in names:  # only once all arrived: a failed wait leaves every reply pending
            del self._pending[name]
        label = f"apply {names[0]}" + (f" + {len(names) - 1} more" if len(names) > 1 else "")
        self.write(names, partial(self._write, names), label)

    def _write(self, names: list[str]) -> None:
        """Engine op: the replies become the parameters (after this step's readers of them finished)."""
        with torch.no_grad():
            if self.server_optimizer is not None:
                for name in names:
                    self.params[name].copy_(self._received[name])
            else:
                self.apply(names, self._averaged(names))

    def _averaged(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The received sums of ``names`` divided by the workers: the gradients the optimizer applies."""
        sums = [self._received[name] for name in names]
        return dict(zip(names, torch._foreach_div(sums, self.num_workers)))  # one op, not one per gradient

    def after_backward(self, result: StepResult) -> None:
        """After a step: baseline pushes everything, then pulls everything (on the collective store one
        pushpull: an all-reduce); the others already sent (or held)."""
        if self.mode == "baseline":
            self._exchange(self._names, [result.grads[n] for n in self._names], pushpull=False)
            return
        held, self._held = dict(self._held), []
        if self._bucket:  # the last segments' gradients, short of a full bucket: backward is over, they leave now
            bucket, self._bucket, self._bucket_numel = self._bucket, [], 0
            self._pushpull_together(bucket)
        if self._send_timing == "serial":
            names = [n for n in self._names if n in held]  # forward order: by priority, on one call's FIFO
            self._exchange(names, [held[n] for n in names], pushpull=True)
            return
        self._pushpull_together(list(held.items()))  # all queued, then by priority

    def _exchange(self, names: list[str], grads: list[torch.Tensor], pushpull: bool) -> None:
        """Send ``grads`` in one call and wait (driving: this thread receives the replies) until the
        parameters hold the result: the synchronous step (``baseline``, and p3's ``serial`` timing)."""
        if not names:
            return
        if self._writes_pushed:  # a reply applied through the engine may not be written yet (after a timing switch)
            self.wait_for_writes()
        params, on_servers = self.params, self.server_optimizer is not None
        targets = [params[n].data if on_servers else self._received[n] for n in names]
        outgoing = [self._outgoing(grad) for grad in grads]
        start = trace.now_us()
        pushpull = pushpull or self.store.kind in SERVERLESS_KINDS  # an all-reduce is a pushpull: sums land in targets
        if pushpull:
            handle = self.store.pushpull(names, outgoing, out=targets)
        else:
            self.store.push(names, outgoing)
            handle = self.store.pull(names, targets)
        handle.wait()
        if trace.enabled():
            trace.record(f"{'pushpull' if pushpull else 'push, pull'} all", start, trace.now_us(), category="comm")
        if not on_servers:
            self.apply(names, self._averaged(names))

    def flush(self) -> None:
        """Apply every outstanding reply and wait until the parameters are written (before eval/save)."""
        self._apply(list(self._pending))
        self.wait_for_writes()

    def close(self) -> None:
        self.flush()
        self.store.close()


def _first_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Where two workers' groupings (``_agree_on_sends``: settings, then "sends") first differ, in words."""
    for name in mine:
        if name != "sends" and mine[name] != theirs[name]:
            return f"{name}: {mine[name]} against {theirs[name]}"
    for index, (a, b) in enumerate(zip(mine["sends"], theirs["sends"])):
        if a != b:
            return f"send {index}: {a} against {b}"
    return f"{len(mine['sends'])} sends against {len(theirs['sends'])}"
