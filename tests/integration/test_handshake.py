"""The compatibility handshake and the silent-miss alarm: "0 hits, no error" becomes an error at
registration where it can be known then, and an alarm (log, metric, /healthcheck) where it cannot."""

from __future__ import annotations

import time

import httpx
import pytest

from kvdepot import ClientOptions, KVClient
from kvdepot.errors import ErrorCode, KVDepotError
from support.servers import LAYOUT, make_kv, make_tokens, wait_until

CHUNK = 16


def test_a_client_whose_keys_need_another_hash_algorithm_is_refused_naming_both(make_server):
    server = make_server("--hash-algorithm", "xxh3_128")
    with pytest.raises(KVDepotError) as refused:
        KVClient(server.ipc_url, "m", LAYOUT, options=ClientOptions(hash_algorithm="sha256", connect_timeout_s=10))
    assert refused.value.code is ErrorCode.INCOMPATIBLE
    assert "sha256" in refused.value.message and "xxh3_128" in refused.value.message and "--hash-algorithm" in refused.value.message
    with KVClient(server.ipc_url, "m", LAYOUT) as fine:  # a client that hashes as the server says is welcome
        assert fine.ping()


def test_two_clients_of_one_model_whose_keys_could_never_match_are_refused_while_both_live(make_server):
    server = make_server()
    with KVClient(server.ipc_url, "m", LAYOUT, options=ClientOptions(hash_scheme="engine-a-v1")):
        with pytest.raises(KVDepotError) as refused:
            KVClient(server.ipc_url, "m", LAYOUT, options=ClientOptions(hash_scheme="engine-b-v2"))
        assert refused.value.code is ErrorCode.INCOMPATIBLE
        assert "hash_scheme: this client engine-b-v2, the live one engine-a-v1" in refused.value.message
        with KVClient(server.ipc_url, "m", LAYOUT, rank=1, world_size=2, options=ClientOptions(hash_scheme="engine-b-v2")):
            pass  # another rank never shares objects anyway: no conflict


def _alarm(server) -> tuple[str, list[str]]:
    metric = [line for line in httpx.get(f"{server.http}/metrics", timeout=10).text.splitlines()
              if line.startswith('kvdepot_silent_miss_alarm{model="quiet-model"}')]  # fmt: skip
    health = httpx.get(f"{server.http}/healthcheck", timeout=10).json()
    return (metric[0].split()[-1] if metric else ""), health.get("reasons", [])


def test_the_silent_miss_alarm_fires_when_a_model_with_stored_objects_never_hits_and_clears_on_a_hit(make_server, seed):
    server = make_server("--silent-miss-window-s", "1")
    stored = make_tokens(2 * CHUNK, seed)
    with KVClient(server.ipc_url, "quiet-model", LAYOUT, options=ClientOptions(chunk_size=CHUNK)) as writer:
        assert writer.store(stored, make_kv(LAYOUT, len(stored), seed)) == 2 * CHUNK
    # A reader whose prompts never match what was stored: every lookup misses, and nothing says why.
    with KVClient(server.ipc_url, "quiet-model", LAYOUT, options=ClientOptions(chunk_size=CHUNK)) as reader:
        assert _alarm(server)[1] == []

        def missing_long_enough():
            assert reader.lookup(make_tokens(2 * CHUNK, seed + 1)) == 0
            value, reasons = _alarm(server)
            return value == "1.0" and any("quiet-model" in r and "silent misses" in r for r in reasons)

        wait_until(missing_long_enough, timeout_s=30, interval_s=0.2, what="the silent-miss alarm")
        assert "silent misses: model 'quiet-model'" in server.log_path.read_text()
        # A hit ends it.
        assert reader.lookup(stored) == 2 * CHUNK
        wait_until(lambda: _alarm(server) == ("0.0", []), timeout_s=30, what="the alarm to clear after a hit")


def test_no_alarm_for_a_model_that_never_stored_anything(make_server, seed):
    server = make_server("--silent-miss-window-s", "0.5")
    with KVClient(server.ipc_url, "cold-model", LAYOUT, options=ClientOptions(chunk_size=CHUNK)) as reader:
        for i in range(15):  # misses over three windows: a cold cache, not a silent one
            assert reader.lookup(make_tokens(2 * CHUNK, seed + i)) == 0
            time.sleep(0.1)
        time.sleep(1.0)
        assert httpx.get(f"{server.http}/healthcheck", timeout=10).json()["status"] == "ok"
