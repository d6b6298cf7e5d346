"""The physical limit under the inline path: raw ZeroMQ bulk throughput between two processes.

A sink/source process (this module run as a script) receives or sends the same bytes in the same
frame sizes as a kvdepot inline transfer, with the same heap settings, and does nothing else.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from kvdepot.malloc import keep_large_buffers_in_heap


def _serve(endpoint: str) -> None:
    keep_large_buffers_in_heap()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    cache: dict[tuple[int, int], list[np.ndarray]] = {}
    while True:
        frames = sock.recv_multipart(copy=False)
        ident, cmd = frames[0], frames[1].bytes
        if cmd == b"quit":
            sock.send_multipart([ident, b"bye"])
            return
        if cmd == b"ping":
            sock.send_multipart([ident, b"pong"])
            continue
        if cmd == b"put":  # store direction: take the bytes, ack
            sock.send_multipart([ident, b"ok"])
        else:  # get direction: b"get <frame_bytes> <count>"
            _, fb, n = cmd.split()
            key = (int(fb), int(n))
            if key not in cache:
                cache[key] = [np.ones(key[0], np.uint8) for _ in range(key[1])]
            sock.send_multipart([ident, b"data", *cache[key]], copy=False)


def bulk_gbps(endpoint: str, total_bytes: int, frame_bytes: int, message_bytes: int, reps: int, window: int = 4) -> tuple[list[float], list[float]]:
    """(put GB/s per rep, get GB/s per rep) moving ``total_bytes`` in pipelined messages of
    ``message_bytes`` split in ``frame_bytes`` frames — what the inline transport does."""
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.rawzmq", endpoint])
    keep_large_buffers_in_heap()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    frames_per_msg = max(1, message_bytes // frame_bytes)
    n_msgs = max(1, total_bytes // (frames_per_msg * frame_bytes))
    payload = [np.ones(frame_bytes, np.uint8) for _ in range(frames_per_msg)]
    get_cmd = f"get {frame_bytes} {frames_per_msg}".encode()

    def run(cmd: bytes, data: list) -> float:
        t0 = time.perf_counter()
        sent = done = 0
        while done < n_msgs:
            while sent < n_msgs and sent - done < window:
                sock.send_multipart([cmd, *data], copy=False)
                sent += 1
            sock.recv_multipart(copy=False)
            done += 1
        return n_msgs * frames_per_msg * frame_bytes / (time.perf_counter() - t0) / 1e9

    try:
        sock.send_multipart([b"put"])
        if not sock.poll(10000):
            raise RuntimeError("raw ZeroMQ sink did not start")
        sock.recv_multipart()
        puts, gets = [], []
        for i in range(reps + 1):
            p, g = run(b"put", payload), run(get_cmd, [])
            if i:
                puts.append(p)
                gets.append(g)
        sock.send_multipart([b"quit"])
        sock.poll(2000)
        return puts, gets
    finally:
        sock.close(0)
        proc.kill()
        proc.wait()


def round_trips(endpoint: str, n: int) -> list[float]:
    """Seconds per request/reply of a tiny message to a bare ROUTER echo in another process: the
    floor under any PING."""
    with RawEcho(endpoint) as echo:
        return echo.round_trips(n, warmup=200)


def round_trips_like(url: str, n: int) -> list[float]:
    """``round_trips`` over the same kind of endpoint as ``url`` (ipc or tcp): the limit under its PINGs."""
    from kvdepot.bench.serverproc import free_port

    if url.startswith("ipc://"):
        return round_trips(f"ipc://{tempfile.mkdtemp(prefix='kvdepot-echo-')}/echo.sock", n)
    return round_trips(f"tcp://127.0.0.1:{free_port()}", n)


class RawEcho:
    """The bare ROUTER echo, kept running, so a benchmark can take round trips in rounds interleaved
    with the figure they bound (drift on a shared host then moves both alike)."""

    def __init__(self, endpoint: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.rawzmq", endpoint])
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send_multipart([b"ping"])
        if not self.sock.poll(10000):
            self.close()
            raise RuntimeError("raw ZeroMQ echo did not start")
        self.sock.recv_multipart()

    def __enter__(self) -> RawEcho:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def round_trips(self, n: int, warmup: int = 0) -> list[float]:
        out = []
        for i in range(n + warmup):
            t0 = time.perf_counter()
            self.sock.send_multipart([b"ping"])
            self.sock.recv_multipart()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    _serve(sys.argv[1])
