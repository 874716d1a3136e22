"""Handle (a lock released once, instead of an Event) and the slot's received-frame bookkeeping."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tandem.kvstore.base import Handle
from tandem.kvstore.errors import KVStoreError, KVStoreTimeout
from tandem.kvstore.slots import SlotTable
from tandem.optim import SGD


def test_every_waiting_thread_wakes_when_the_last_part_completes() -> None:
    handle = Handle("pull", parts=2)
    woke: list[float] = []
    waiters = [threading.Thread(target=lambda: (handle.wait(5), woke.append(time.monotonic()))) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    handle.part_done()
    time.sleep(0.05)
    assert not woke and not handle.done()
    handle.part_done()
    for waiter in waiters:
        waiter.join(5)
    assert len(woke) == 3 and handle.done() and handle.error is None
    handle.wait(0)  # waiting again on a finished handle returns at once


def test_wait_times_out_naming_the_operation_then_still_completes() -> None:
    handle = Handle("push of key 'w'", parts=1)
    with pytest.raises(KVStoreTimeout, match="push of key 'w' did not finish within 0.0"):
        handle.wait(0.01)
    handle.part_done()
    handle.wait(0)


def test_failure_wakes_waiters_with_the_first_error_only() -> None:
    handle = Handle("pull", parts=3)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            handle.wait(5)
        except KVStoreError as error:
            errors.append(error)

    thread = threading.Thread(target=waiter)
    thread.start()
    handle.fail(KVStoreError("server 0 is gone"))
    handle.fail(KVStoreError("again"))
    handle.part_done()
    thread.join(5)
    assert [str(error) for error in errors] == ["server 0 is gone"]
    with pytest.raises(KVStoreError, match="server 0 is gone"):
        handle.wait(0)


def test_on_complete_error_reaches_the_waiter() -> None:
    def broken() -> None:
        raise RuntimeError("copy failed")

    handle = Handle("pull", parts=1, on_complete=broken)
    handle.part_done()
    with pytest.raises(RuntimeError, match="copy failed"):
        handle.wait(0)


def test_a_slot_forgets_its_received_frame_once_its_value_is_no_longer_that_frame() -> None:
    table = SlotTable()
    table.init(("w", 0, 4), (4,), torch.zeros(4))
    slot = table.slots[("w", 0, 4)]
    frame = object()  # stands for the zmq.Frame the pushed tensor views
    table.apply(slot, torch.ones(4), merged_owned=False, frame=frame)
    assert slot.frame is frame and not slot.owned
    table.apply(slot, torch.full((4,), 2.0), merged_owned=True)  # a merged sum: no frame behind it
    assert slot.frame is None
    table.apply(slot, torch.ones(4), merged_owned=False, frame=frame)
    table.set_optimizer_object(SGD(lr=0.1))  # values are copied: in-place updates must not write frames
    assert slot.frame is None and slot.owned
