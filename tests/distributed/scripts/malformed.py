"""Garbage, unsigned and wrongly signed frames at every server; then normal pushes and pulls still work.

Runs with TANDEM_PS_SECRET set, so a well-formed but unsigned request must be dropped too.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import zmq

import tandem.kvstore as kvstore
from tandem.kvstore.ps.auth import attempt_key
from tandem.kvstore.ps.curve import password_of, present_password
from tandem.kvstore.ps.protocol import Command, Header, Role, encode_header, seal
from tandem.kvstore.ps.topology import restart_count

if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve("dist_sync"))
kv = kvstore.create("dist_sync")
kv.init("w", torch.zeros(10))
secret = attempt_key(os.environ["TANDEM_PS_SECRET"].encode(), restart_count())  # the job's key for this start
pull = Header(Command.PULL, 7, Role.WORKER, 0, key="w", dtype=torch.float32, shape=(10,), slice_stop=10)
hello = Header(Command.HELLO, 8, Role.WORKER, 0, payload_count=1, payload_nbytes=2)
hostile = [
    [b""],
    [b"hello"],
    [os.urandom(300)],
    [b"TDKV" + os.urandom(80)],
    [b"\x00" * 5000, b"x", b"y"],
    [encode_header(pull)],  # well-formed but unsigned
    [seal(encode_header(pull), [], secret=b"wrong secret")],
    [
        seal(encode_header(Header(Command.PUSH, 9, Role.WORKER, 0, key="w", dtype=torch.float32, shape=(10,),
                                  slice_stop=10, payload_count=1, payload_nbytes=40)), [b"short"], secret=secret),
        b"short",
    ],  # fmt: skip
]
context = zmq.Context()
for address in kv.addresses:
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    present_password(raw, password_of(secret))  # the job's login (its messages still need the session keys)
    raw.connect(address.endpoint)
    # and a signed request from a peer that never said hello: the server knows its peers apart
    for frames in hostile + [[seal(encode_header(pull), [], secret=secret)]]:
        raw.send_multipart(frames)
    assert not raw.poll(500), "a server answered a rejected message"
    raw.send_multipart([seal(encode_header(hello), [b"{}"], secret=secret), json.dumps({}).encode()])  # wrong job
    assert raw.poll(5000), "a server did not answer a signed hello"
    answer = raw.recv_multipart()
    assert b"runs" in answer[-1], answer
    raw.close()
context.term()
kv.push("w", torch.arange(10.0)).wait()
out = torch.empty(10)
kv.pull("w", out).wait()
assert torch.equal(out, torch.arange(10.0)), out
print(f"malformed OK rank {kv.rank}: {len(hostile) + 1} hostile messages per server rejected, still serving")
kv.close()
