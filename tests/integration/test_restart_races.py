"""A request that read the registration (and passed ContextLink.request's path check) before another
thread registered again after a server restart went out under the old context id, which the restarted
server had given this client again (it numbered contexts from 1). Its reply held the NEW arena's
offsets, but the request's ShmPath read or wrote them in the OLD arena:

- retrieve: bytes of the old server's arena come back as this key's KV, silently;
- store: the caller's KV goes to the old arena, the new server commits whatever its slots held;
- once the old path is closed: a ValueError, and the new server's lease is never given back.

Now a server numbers contexts from a random start (an old id is UNKNOWN_CONTEXT), and a request that
a registration overtook gives its lease back and is redone on the new path. The interleaving is forced
with two hooks (one thread stalled just before its send, the other just after its REGISTER_CONTEXT
reply, before choose_path): the window they widen is real, only narrow.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support.servers import CHUNK, LAYOUT, make_kv, make_tokens

import kvdepot.client.context as ctxmod


def _setup(make_server, seed):
    srv = make_server()
    o1 = srv.client(transport="inline")
    c = srv.client(transport="shm")
    t_old = make_tokens(CHUNK, seed)
    kv_old = make_kv(LAYOUT, CHUNK, seed)
    assert c.store(t_old, kv_old) == CHUNK  # the first slot of the first server's arena
    o1.close()
    srv.restart()
    o2 = srv.client(transport="inline")
    return srv, c, o2, t_old, kv_old


def _force_interleaving(monkeypatch, c, a_name="A"):
    a_stalled, b_registered, a_done = threading.Event(), threading.Event(), threading.Event()
    real_give_back = c.link._give_back_late
    real_choose = ctxmod.choose_path

    def give_back(body):  # evaluated in request() after the path check, just before channel.call
        if threading.current_thread().name == a_name and not a_stalled.is_set():
            a_stalled.set()
            b_registered.wait(10)
        return real_give_back(body)

    def choose(*args, **kwargs):  # B: its REGISTER_CONTEXT reply is in, the path not yet replaced
        b_registered.set()
        a_done.wait(3)
        return real_choose(*args, **kwargs)

    monkeypatch.setattr(c.link, "_give_back_late", give_back)
    monkeypatch.setattr(ctxmod, "choose_path", choose)
    return a_stalled, a_done


def _run(c, a_stalled, a_done, work):
    result: dict = {}

    def a():
        try:
            result["value"] = work()
        except BaseException as exc:  # noqa: BLE001
            result["error"] = exc
        finally:
            a_done.set()

    ta = threading.Thread(target=a, name="A")
    ta.start()
    assert a_stalled.wait(10)
    tb = threading.Thread(target=lambda: c.lookup(make_tokens(CHUNK, 999)), name="B")
    tb.start()
    ta.join(30)
    tb.join(30)
    return result


def test_a_retrieve_overtaken_by_a_registration_after_a_restart_reads_what_the_server_holds(make_server, seed, monkeypatch):
    srv, c, o2, t_old, kv_old = _setup(make_server, seed)
    t_x = make_tokens(CHUNK, seed + 1)
    kv_x = make_kv(LAYOUT, CHUNK, seed + 1)
    assert o2.store(t_x, kv_x) == CHUNK  # the first slot of the restarted server's arena
    a_stalled, a_done = _force_interleaving(monkeypatch, c)
    result = _run(c, a_stalled, a_done, lambda: c.retrieve(t_x))
    assert "error" not in result, repr(result.get("error"))
    got = result["value"]
    assert got.shape[2] == CHUNK
    assert np.array_equal(got.view(np.uint8), np.asarray(kv_x).view(np.uint8)), (
        "retrieve returned other bytes than the server holds for the key"
        + (" (the OLD arena's chunk)" if np.array_equal(got.view(np.uint8), np.asarray(kv_old).view(np.uint8)) else "")
    )
    srv.wait_status(lambda st: st["leases"] == 0, timeout_s=5)
    assert srv.leases() == 0
    c.close()
    o2.close()


def test_a_store_overtaken_by_a_registration_after_a_restart_stores_what_the_client_wrote(make_server, seed, monkeypatch):
    srv, c, o2, _t_old, _kv_old = _setup(make_server, seed)
    t_y = make_tokens(CHUNK, seed + 2)
    kv_y = make_kv(LAYOUT, CHUNK, seed + 2)
    a_stalled, a_done = _force_interleaving(monkeypatch, c)
    result = _run(c, a_stalled, a_done, lambda: c.store(t_y, kv_y))
    assert "error" not in result, repr(result.get("error"))
    assert result["value"] == CHUNK
    got = o2.retrieve(t_y)
    assert got.shape[2] == CHUNK
    assert np.array_equal(got.view(np.uint8), np.asarray(kv_y).view(np.uint8)), "the server stored other bytes than the client wrote"
    c.close()
    o2.close()


def test_a_request_sent_after_the_old_path_closed_is_redone_and_leaks_no_lease(make_server, seed, monkeypatch):
    """B's registration runs to its end while A is stalled before its send: A's PREPARE went under the
    old id (the new context's too), and its reply was read with the closed path: a ValueError, and the
    new server's lease held by nobody."""
    srv, c, o2, _t_old, _kv_old = _setup(make_server, seed)
    t_x = make_tokens(CHUNK, seed + 1)
    kv_x = make_kv(LAYOUT, CHUNK, seed + 1)
    assert o2.store(t_x, kv_x) == CHUNK
    a_stalled, b_done = threading.Event(), threading.Event()
    real_give_back = c.link._give_back_late

    def give_back(body):
        if threading.current_thread().name == "A" and not a_stalled.is_set():
            a_stalled.set()
            b_done.wait(10)
        return real_give_back(body)

    monkeypatch.setattr(c.link, "_give_back_late", give_back)
    result: dict = {}

    def a():
        try:
            result["value"] = c.retrieve(t_x)
        except BaseException as exc:  # noqa: BLE001
            result["error"] = exc

    ta = threading.Thread(target=a, name="A")
    ta.start()
    assert a_stalled.wait(10)
    c.lookup(make_tokens(CHUNK, 999))  # re-registers (main thread)
    b_done.set()
    ta.join(30)
    assert "error" not in result, repr(result.get("error"))
    assert np.array_equal(result["value"].view(np.uint8), np.asarray(kv_x).view(np.uint8))
    srv.wait_status(lambda st: st["leases"] == 0, timeout_s=5)
    assert srv.leases() == 0, "a lease of the new server is held by nobody"
    c.close()
    o2.close()
