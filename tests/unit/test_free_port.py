"""``free_port`` never hands the same port out twice in a row: callers take several before they bind any."""

from __future__ import annotations

from kvdepot.bench import serverproc


class _OfferedPorts:
    """A stand-in for ``socket.socket`` whose bind(0) offers the ports of a script, in order."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def __call__(self, *args, **kwargs):
        port = self.ports.pop(0)

        class _Socket:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def bind(self, addr):
                pass

            def getsockname(self):
                return ("127.0.0.1", port)

        return _Socket()


def test_a_port_the_kernel_offers_again_is_not_handed_out_twice(monkeypatch):
    monkeypatch.setattr(serverproc, "_RECENT_PORTS", type(serverproc._RECENT_PORTS)(maxlen=8))
    monkeypatch.setattr(serverproc.socket, "socket", _OfferedPorts([41000, 41000, 41001]))
    assert serverproc.free_port() == 41000
    assert serverproc.free_port() == 41001


def test_real_ports_come_out_distinct():
    ports = [serverproc.free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
