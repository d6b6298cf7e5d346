"""The CurveZMQ key files (``kvdepot.rpc.security``): what ``kvdepot keygen`` writes, and a clear
ValueError for every key file that cannot be used (the server turns it into a ConfigError naming its
flag, the connectors into one naming their key)."""

from __future__ import annotations

import pytest
import zmq

from kvdepot.rpc.security import CurveClientKeys, CurveServerKeys, load_key_pair, load_public_key, write_key_files


@pytest.fixture
def keys(tmp_path):
    return write_key_files(tmp_path / "keys")


def test_keygen_writes_two_key_pairs_and_admits_its_client(keys):
    server_public, server_secret = load_key_pair(keys["server_secret"])
    assert load_public_key(keys["server_public"]) == server_public and len(server_secret) == 40
    client_public, _ = load_key_pair(keys["client_secret"])
    assert load_public_key(keys["clients"] / "client.key") == client_public != server_public
    for name in ("server_secret", "client_secret"):
        assert keys[name].stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError, match="never overwritten"):
        write_key_files(keys["server_secret"].parent)


def test_unusable_key_files_are_named(keys, tmp_path):
    with pytest.raises(ValueError, match="no such key file"):
        load_public_key(tmp_path / "nope.key")
    with pytest.raises(ValueError, match="holds no secret key"):
        load_key_pair(keys["server_public"])
    junk = tmp_path / "junk.key"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match="not a CurveZMQ certificate"):
        load_public_key(junk)
    empty = tmp_path / "empty-clients"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no client certificate"):
        CurveServerKeys(keys["server_secret"], empty)
    with pytest.raises(ValueError, match="40-character Z85"):
        CurveClientKeys(b"short", b"x" * 40, b"y" * 40)


def test_each_kind_plays_its_own_role_and_hides_its_secret(keys):
    client = CurveClientKeys.from_files(keys["server_public"], keys["client_secret"])
    server = CurveServerKeys(keys["server_secret"], keys["clients"])
    assert client.secret_key.decode() not in repr(client)
    assert server._secret_key.decode() not in repr(server)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        with pytest.raises(TypeError):
            client.apply_server(ctx, sock)
        with pytest.raises(TypeError):
            server.apply_client(sock)
        client.apply_client(sock)  # (ZeroMQ's Curve keys are write-only: the integration tests show they work)
    finally:
        ctx.destroy(linger=0)


def test_a_shared_client_key_file_admits_exactly_that_key(keys, tmp_path):
    other = write_key_files(tmp_path / "other")
    server = CurveServerKeys(keys["server_secret"], keys["clients"] / "client.key")
    assert server.clients_dir is None
    assert server.callback("kvdepot", load_public_key(keys["clients"] / "client.key"))
    assert not server.callback("kvdepot", load_public_key(other["client_public"]))


def test_secret_keys_are_never_readable_by_others_not_even_while_being_written(tmp_path, monkeypatch):
    """zmq.auth writes with a plain open(): under umask 022 each secret file was 0644 until the chmod."""
    import os
    import stat

    import zmq.auth

    seen: list[int] = []
    create = zmq.auth.create_certificates

    def watched(directory, name, metadata=None):
        paths = create(directory, name, metadata)
        seen.append(stat.S_IMODE(os.stat(paths[1]).st_mode))  # the secret file, as it was written
        return paths

    monkeypatch.setattr(zmq.auth, "create_certificates", watched)
    old = os.umask(0o022)
    try:
        keys = write_key_files(tmp_path / "fresh")
    finally:
        os.umask(old)
    assert len(seen) == 2 and all(mode & 0o077 == 0 for mode in seen), [oct(m) for m in seen]
    assert stat.S_IMODE(os.stat(keys["server_public"]).st_mode) == 0o644


def test_a_stranger_retrying_with_an_unadmitted_key_does_not_flood_the_log(tmp_path, caplog):
    """The server's public key (server.key) is public: whoever has it but no admitted client key reaches
    the ZAP check on every attempt, and a ZeroMQ client retries every 0.1 s. The server logs its refused
    handshakes at most once per 10 s per reason; the key check itself logged a warning on every attempt
    (into the log and the recent-events ring, pushing every real warning out)."""
    import logging
    import time

    from kvdepot.bench.serverproc import free_port
    from kvdepot.rpc.server import RpcServer

    keys = write_key_files(tmp_path / "keys")
    stranger = write_key_files(tmp_path / "stranger")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = RpcServer([endpoint], security=CurveServerKeys(keys["server_secret"], keys["clients"]), housekeeping_interval_s=0.05)
    server.start()
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="kvdepot"):
            public, secret = load_key_pair(stranger["client_secret"])
            for _ in range(20):  # twenty attempts, as a retrying client makes them in two seconds
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                CurveClientKeys(load_public_key(keys["server_public"]), public, secret).apply_client(sock)
                sock.connect(endpoint)
                sock.send_multipart([b"", b"x"])
                time.sleep(0.1)
                sock.close(linger=0)
            time.sleep(0.5)
        refused = server.metrics.handshake_failures.labels("auth")._value.get()
        assert refused >= 10, f"only {refused} refusals counted"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) <= 2, f"{len(warnings)} warnings for {refused} refused attempts: {warnings[:3]}"
    finally:
        ctx.destroy(linger=0)
        server.close()
