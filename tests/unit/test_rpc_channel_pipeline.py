"""RpcChannel.pipeline: the timeout bounds the wait for each reply, not the whole exchange. A large
inline load (gigabytes over a network) that keeps moving used to fail once the client's ``timeout_s``
had passed in all, and a failed load turns every block of it into a recompute."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvdepot.errors import KVDepotTimeout
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.rpc.channel import RpcChannel

TIMEOUT_S = 2.0  # the channel's patience per reply
GAP_S = 0.4  # the server answers each request this long after the last: well inside TIMEOUT_S
REQUESTS = 12  # ... and all of them take GAP_S * REQUESTS, well past TIMEOUT_S


class SteadyServer:
    """A ROUTER that answers PINGs one at a time, GAP_S apart: a transfer that keeps moving."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(url)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, header, _body, *_ = self.sock.recv_multipart()
            time.sleep(GAP_S)
            self.sock.send_multipart([ident, *codec.encode_reply(codec.decode_request_header(header).request_id, m.PingReply())])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def server(tmp_path):
    s = SteadyServer(f"ipc://{tmp_path}/rpc.sock")
    yield s
    s.close()


def test_a_pipeline_that_keeps_moving_is_not_cut_at_one_timeout(server, tmp_path):
    channel = RpcChannel(f"ipc://{tmp_path}/rpc.sock").open()
    try:
        results = channel.pipeline([(m.PingRequest(), [])] * REQUESTS, timeout_s=TIMEOUT_S, window=1)
    finally:
        channel.close()
    assert len(results) == REQUESTS and all(isinstance(r, m.PingReply) for r in results)


def test_a_callers_deadline_still_bounds_the_whole_pipeline(server, tmp_path):
    channel = RpcChannel(f"ipc://{tmp_path}/rpc.sock").open()
    try:
        with pytest.raises(KVDepotTimeout):
            channel.pipeline([(m.PingRequest(), [])] * REQUESTS, timeout_s=TIMEOUT_S, window=1, until=time.monotonic() + 3 * GAP_S)
    finally:
        channel.close()
