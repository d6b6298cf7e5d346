"""Edges of the server core: the RPC loop's zero-copy replies and the read locks that keep them valid."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from kvdepot.errors import ErrorCode

from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.messages import RequestType
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.rpc.server import RpcServer


def test_on_sent_waits_for_every_zero_copy_frame_not_only_the_last(tmp_path):
    """An inline retrieve's chunk is cut into frames of whole rows; its last frame can be a few rows
    under ZeroMQ's copy threshold (64 KiB), which pyzmq copies at once and reports sent at once, and
    ``send_multipart`` returns only the last frame's tracker. The read locks were then released while
    the big frames before it still pointed into the arena, unsent: the slot could be evicted and
    rewritten, and the reader got another chunk's bytes. ``on_sent`` must wait for every frame."""
    url = f"ipc://{tmp_path}/rpc.sock"
    released: list[int] = []
    big, small = np.full(4 << 20, 1, np.uint8), np.full(1 << 10, 2, np.uint8)  # a chunk's frames: the tail is small

    def pinning(call: Call) -> Reply:
        return Reply(m.PingReply(), [big, small], on_sent=lambda: released.append(call.request_id))

    server = RpcServer([url], [HandlerSpec(RequestType.PING, pinning, HandlerMode.SYNC)])
    server.start()
    slow = zmq.Context.instance().socket(zmq.DEALER)
    try:
        slow.setsockopt(zmq.LINGER, 0)
        slow.setsockopt(zmq.RCVHWM, 1)  # it stops reading: the replies stay queued in the server
        slow.setsockopt(zmq.RCVBUF, 64 << 10)
        slow.connect(url)
        asked = 20
        for rid in range(1, asked + 1):
            slow.send_multipart(codec.encode_request(rid, m.PingRequest(), 0))
        deadline = time.monotonic() + 10
        while server.metrics.registry.get_sample_value("kvdepot_requests_total", {"type": "PING"}) != asked and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # many tracker passes (every 20 ms) since the last reply was queued
        assert len(released) < asked // 2, f"{len(released)} of {asked} 4 MiB replies said sent to a client that reads nothing"
        slow.setsockopt(zmq.RCVTIMEO, 10_000)
        for _ in range(asked):
            header, _, *payload = slow.recv_multipart()
            assert codec.decode_reply_header(header).status == 0
            assert [len(f) for f in payload] == [big.nbytes, small.nbytes]
        deadline = time.monotonic() + 10
        while len(released) < asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(released) == list(range(1, asked + 1))  # once read, every one lets go
    finally:
        slow.close(linger=0)
        server.close()


class CountingObserver:
    """The loop's RequestObserver, counting what it is told (read after the reply arrived)."""

    def __init__(self) -> None:
        self.started = self.finished = 0

    def request_started(self, client) -> None:
        self.started += 1

    def request_finished(self, client) -> None:
        self.finished += 1


@pytest.mark.parametrize("mode", [HandlerMode.SYNC, HandlerMode.BLOCKING])
def test_a_reply_that_cannot_be_sent_still_ends_its_request(tmp_path, mode):
    """A reply whose send raises (here a payload frame that is no buffer) is answered with an error, and
    the observer hears that the request finished: a client left "in flight" is never idle, so its
    liveness timeout never fires. (A BLOCKING reply that failed got no answer at all.)"""
    url = f"ipc://{tmp_path}/rpc.sock"
    observer = CountingObserver()

    def unsendable(call: Call) -> Reply:
        return Reply(m.PingReply(), [object()])

    server = RpcServer([url], [HandlerSpec(RequestType.PING, unsendable, mode)], observer=observer)
    server.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(url)
        for rid in (1, 2):
            sock.send_multipart(codec.encode_request(rid, m.PingRequest(), 0))
            header = codec.decode_reply_header(sock.recv_multipart()[0])
            assert header.request_id == rid and header.status == ErrorCode.INTERNAL
        deadline = time.monotonic() + 5  # a forwarded reply is counted just after it is sent
        while observer.finished < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (observer.started, observer.finished) == (2, 2)
    finally:
        sock.close(linger=0)
        server.close()
