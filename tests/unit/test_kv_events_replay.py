"""The KV-event replay socket on its own: a subscriber gets every kept batch and the end marker."""

from __future__ import annotations

import time

import zmq

from kvdepot.observability.kv_events import END_OF_REPLAY, AllBlocksCleared, KVEventsPublisher


def test_a_replay_to_a_subscriber_busy_when_it_starts_is_whole_and_ends_with_its_marker(tmp_path):
    """A ROUTER drops what a peer's queue cannot take (1000 messages by default): a subscriber that did
    not read at once got a quarter of 10,000 kept batches and never saw the end marker."""
    kept = 3000
    pub = KVEventsPublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", buffer=kept)
    pub.bind()
    pub.start()  # the start-up batch (AllBlocksCleared on the empty topic) is not kept: m's batches are replayed
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        for _ in range(kept):
            pub._send(b"m", [AllBlocksCleared()])
        sock.connect(f"ipc://{tmp_path}/replay")
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.5)  # busy elsewhere while the replay is sent
        got, ended = 0, False
        while sock.poll(2000):
            frames = sock.recv_multipart()
            if frames[2] == END_OF_REPLAY:
                ended = True
                break
            got += 1
        assert got == kept and ended, f"{got} of {kept} batches, end marker: {ended}"
    finally:
        sock.close(linger=0)
        ctx.term()
        pub.close()
