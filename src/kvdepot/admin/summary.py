"""What ``kvdepot status`` prints: a short summary of a server's ``/status`` document, for people.

``kvdepot status --json`` prints the document itself. ``probe`` tells, within its timeout, whether an
address speaks HTTP at all, and recognises kvdepot's own ZeroMQ port (which answers a connection with
ZeroMQ's greeting and then waits: without the probe, an HTTP client would wait for its timeout).
"""

from __future__ import annotations

import socket

_ZMTP_SIGNATURE_LEN = 10  # 0xFF, 8 bytes, 0x7F: how a ZeroMQ peer opens every connection


def probe(host: str, port: int, timeout_s: float) -> str:
    """Why ``host:port`` is not an HTTP server ('' when it is one)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(f"GET /healthcheck HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            first = s.recv(16)
    except TimeoutError:
        return f"nothing answered on {host}:{port} within {timeout_s:g} s"
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc.strerror or exc}"
    if first.startswith(b"HTTP/"):
        return ""
    if len(first) >= _ZMTP_SIGNATURE_LEN and first[0] == 0xFF and first[_ZMTP_SIGNATURE_LEN - 1] == 0x7F:
        return f"{host}:{port} is a ZeroMQ endpoint (kvdepot's --port), not its HTTP API (--http-port, 8080 by default)"
    return f"{host}:{port} does not speak HTTP"


def summary(doc: dict, url: str) -> str:
    """A few lines a person reads at a glance: where it serves, the hit rate, L1, tiers, clients."""
    lines = [f"kvdepot {_safe(doc.get('version', '?'))} serving {_safe(', '.join(doc.get('endpoints', []))) or '?'} (HTTP {_safe(url)})"]
    lk = doc.get("lookups", {})
    asked, hit, missed = lk.get("requested_tokens", 0), lk.get("hit_tokens", 0), lk.get("missed_tokens", 0)
    if lk.get("requests"):
        where = ", ".join(f"{_safe(t)} {_n(v)}" for t, v in sorted(lk.get("hit_tokens_by_tier", {}).items()))
        lines.append(
            f"  lookups    {_n(lk['requests'])} asking for {_n(asked)} tokens: hit rate {lk.get('hit_rate', 0.0):.1%} "
            f"({_n(hit)} found{': ' + where if where else ''}; {_n(missed)} missed)"
        )
        for model, m in sorted(lk.get("by_model", {}).items()):
            answered = m["hit_tokens"] + m["missed_tokens"]
            rate = m["hit_tokens"] / answered if answered else 0.0
            lines.append(f"    {_safe(model)}: {_n(m['requests'])} lookups, hit rate {rate:.1%}")
    else:
        lines.append("  lookups    none yet")
    st, rt = doc.get("stores", {}), doc.get("retrieves", {})
    lines.append(
        f"  transfers  stored {_n(st.get('chunks', 0))} chunks ({_bytes(st.get('bytes', 0))}), "
        f"read back {_n(rt.get('chunks', 0))} ({_bytes(rt.get('bytes', 0))})"
    )
    l1 = doc.get("l1", {})
    cap, used = l1.get("capacity_bytes", 0), l1.get("used_bytes", 0)
    quarantine = doc.get("quarantine", {}).get("bytes", 0)
    lines.append(
        f"  L1         {_bytes(used)} of {_bytes(cap)} used ({used / cap if cap else 0:.1%}), {_n(l1.get('objects', 0))} objects, "
        f"{_n(doc.get('leases', 0))} leases" + (f", {_bytes(quarantine)} quarantined" if quarantine else "")
    )
    tiers = doc.get("tiers", [])
    if not tiers:
        lines.append("  tiers      none (L1 only)")
    for t in tiers:
        state = "up" if t.get("healthy") else f"DOWN ({_safe(t.get('last_error') or 'unknown error')})"
        lines.append(f"  tier       {_safe(t['name'])} ({_safe(t['kind'])}): {state}, {_bytes(t.get('used_bytes', 0))}, {_n(t.get('objects', 0))} objects")
    lines.extend(_tenants(doc.get("tenants", [])))
    lines.extend(_quarantine(doc.get("quarantine", {})))
    lines.append(f"  clients    {_n(doc.get('clients', 0))} clients, {_n(doc.get('contexts', 0))} contexts, {_n(doc.get('sessions', 0))} sessions")
    return "\n".join(lines)


def _tenants(tenants: list[dict]) -> list[str]:
    """One line per cache_salt: what it holds in L1, against its quota when it has one."""
    if not tenants:
        return ["  tenants    none in L1"]
    lines = []
    for t in tenants:
        quota = t.get("quota_bytes")
        limit = f" of {_bytes(quota)} quota ({t['used_bytes'] / quota:.0%})" if quota else (" (quota 0: refused)" if quota == 0 else ", no quota")
        lines.append(f"  tenant     {_safe(t['cache_salt'])}: {_bytes(t['used_bytes'])}{limit}, {_n(t['objects'])} objects")
    return lines


def _quarantine(q: dict) -> list[str]:
    """Arena space held back from reuse, and which clients hold it."""
    if not q.get("leases"):
        return ["  quarantine none"]
    lines = [f"  quarantine {_n(q['leases'])} leases, {_bytes(q.get('bytes', 0))} held back from reuse"]
    for c in q.get("clients", []):
        who = f"pid {c['pid']}" + (f" on {_safe(c['hostname'])}" if c.get("hostname") else "") if c.get("pid") else "no pid"
        lines.append(f"    client {_safe(c['client'])} ({who}, {_safe(c['state'])}): {_n(c['leases'])} leases, {_bytes(c['bytes'])}: {_safe(c['why'])}")
    return lines


def _safe(text: object) -> str:
    """``text`` as a terminal may show it: model names, ``cache_salt`` values and client host names are
    whatever a client chose, and an escape sequence, carriage return or bidi override among them would
    otherwise act on the operator's terminal (clear it, retitle it, rewrite the lines above). Those
    characters are written as Python escapes (``\\x1b``, ``\\r``, ``\\u202e``)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _n(v: int) -> str:
    return f"{v:,}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
