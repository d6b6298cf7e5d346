"""RpcChannel with payload borrowed from the caller (the inline store sends a C-contiguous array's rows
without a copy): once ``pipeline`` returns or raises, ZeroMQ holds none of it, so the caller may reuse
its buffer at once without the new bytes reaching the server under the old request's keys."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from kvdepot.errors import KVDepotTimeout
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.rpc.channel import RpcChannel

MiB = 1 << 20


class SlowServer:
    """A ROUTER that takes one message into its queue and reads nothing more until told: a server that
    hangs (SIGSTOPped, swapping) with the client's messages still on their way."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 64 << 10)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(url)

    def drain(self, seconds: float) -> list[bytes]:
        """Every payload frame that arrives within ``seconds`` (nothing is answered)."""
        got, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                got += frames[3:]
        return got

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def url(tmp_path) -> str:
    return f"ipc://{tmp_path}/rpc.sock"


def test_after_a_timeout_the_caller_memory_is_no_longer_sent(url):
    server = SlowServer(url)
    channel = RpcChannel(url).open()
    try:
        kv = np.zeros((6, MiB), np.uint8)
        requests = [(m.StoreInlineRequest(context_id=1, keys=[bytes(32)], rows_per_frame=1, first=0, count=1), [memoryview(row)]) for row in kv]
        t0 = time.monotonic()
        with pytest.raises(KVDepotTimeout):
            channel.pipeline(requests, timeout_s=0.5, borrowed=True)
        assert time.monotonic() - t0 < 10
        kv[:] = 0xFF  # the caller reuses its buffer at once, as it may
        arrived = server.drain(2.0)
        assert all(not np.frombuffer(f, np.uint8).any() for f in arrived), "bytes written after the call ended reached the server"
        assert len(arrived) < len(requests)  # what was still queued went with the dropped connection
        # The channel works on, over a new connection.
        replier = threading.Thread(target=_answer_one_ping, args=(server,), daemon=True)
        replier.start()
        assert channel.ping(timeout_s=5)
        replier.join(5)
    finally:
        channel.close()
        server.close()


def _answer_one_ping(server: SlowServer) -> None:
    while True:
        frames = server.sock.recv_multipart()
        header = codec.decode_request_header(frames[1])
        if header.type == m.RequestType.PING:
            server.sock.send_multipart([frames[0], *codec.encode_reply(header.request_id, m.PingReply())])
            return
