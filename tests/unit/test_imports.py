"""Imports run one way: engine -> client -> wire -> server dispatch -> storage -> tiers.

Every ``import`` in ``src/kvdepot`` is read (module level, inside functions, under TYPE_CHECKING) and
checked against the edges that must never exist. A new forbidden edge fails this test, naming the file,
the line and the rule; the last test proves the checker itself catches one.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# package (or module) -> what it must never import. The layers, bottom up (ARCHITECTURE §7): core (types,
# limits, errors, events, keys, breaker, hashing, layout, config, shm) -> protocol (the wire) -> rpc
# (channel and dispatch, both sides) and gpu (device code, both sides) -> client -> connectors; and
# rpc -> server -> storage (through its manager only) -> tiers. Observability is fed; admin depends on a Protocol the server implements.
ALL = ("kvdepot.",)
ABOVE_CORE = (
    "kvdepot.protocol",
    "kvdepot.rpc",
    "kvdepot.client",
    "kvdepot.connectors",
    "kvdepot.server",
    "kvdepot.storage",
    "kvdepot.admin",
    "kvdepot.observability",
    "kvdepot.bench",
    "kvdepot.cli",
)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # leaves: everyone may use them; they use nothing of kvdepot's (events and keys name types only)
    "kvdepot.types": ALL,
    "kvdepot.limits": ALL,
    "kvdepot.errors": ALL,
    "kvdepot.breaker": ALL,
    "kvdepot.redact": ALL,  # masks secrets in what is printed: the standard library only
    "kvdepot.events": ABOVE_CORE + ("kvdepot.config", "kvdepot.keys", "kvdepot.shm", "kvdepot.hashing"),
    "kvdepot.keys": ABOVE_CORE + ("kvdepot.config", "kvdepot.events", "kvdepot.shm", "kvdepot.hashing"),
    "kvdepot.hashing": ABOVE_CORE + ("kvdepot.config",),
    "kvdepot.layout": ABOVE_CORE + ("kvdepot.config",),
    # configuration is read by everyone and reads only the leaves (storage reads it: never the other way)
    "kvdepot.config": ABOVE_CORE + ("kvdepot.shm",),
    # the shared-memory segment: both sides map it, so it knows neither
    "kvdepot.shm": ABOVE_CORE + ("kvdepot.config",),
    # the wire knows messages, never who sends, serves or stores them
    "kvdepot.protocol": ABOVE_CORE[1:] + ("kvdepot.config",),
    # the RPC layer: both sides use it; it knows neither (nor what a server is configured with)
    "kvdepot.rpc": ("kvdepot.client", "kvdepot.connectors", "kvdepot.server", "kvdepot.storage", "kvdepot.admin", "kvdepot.bench", "kvdepot.config"),
    # device code (paged caches as torch tensors, the mover, CUDA IPC memory): both sides use it, beside rpc
    "kvdepot.gpu": ("kvdepot.client", "kvdepot.connectors", "kvdepot.server", "kvdepot.storage", "kvdepot.admin", "kvdepot.bench", "kvdepot.config",
                    "kvdepot.rpc", "kvdepot.observability", "kvdepot.peer"),
    # a client runs in an engine: nothing of the server's may come along, nor the RPC server side
    "kvdepot.client": (
        "kvdepot.server", "kvdepot.storage", "kvdepot.admin", "kvdepot.connectors", "kvdepot.bench", "kvdepot.config",
        "kvdepot.rpc.server", "kvdepot.rpc.dispatch", "kvdepot.observability",
    ),
    "kvdepot.connectors": ("kvdepot.server", "kvdepot.storage", "kvdepot.admin", "kvdepot.bench", "kvdepot.rpc.server", "kvdepot.rpc.dispatch",
                           "kvdepot.peer.adapter", "kvdepot.peer.node"),
    # storage knows bytes and keys, never the wire, the RPC layer (either side) or who asks
    "kvdepot.storage": (
        "kvdepot.protocol", "kvdepot.rpc", "kvdepot.server", "kvdepot.client", "kvdepot.admin", "kvdepot.connectors", "kvdepot.bench",
        "kvdepot.observability",
    ),
    # the admin API depends on a small Protocol, never on the server it serves
    "kvdepot.admin": ("kvdepot.server", "kvdepot.storage", "kvdepot.client", "kvdepot.connectors", "kvdepot.rpc", "kvdepot.bench"),
    # observability is fed events and snapshots; it reaches into nothing
    "kvdepot.observability": (
        "kvdepot.server", "kvdepot.storage", "kvdepot.client", "kvdepot.admin", "kvdepot.connectors", "kvdepot.rpc", "kvdepot.bench",
        "kvdepot.trace",
    ),
    # trace tools (plan, replay) are a server's clients: they read recordings, never the server's insides
    "kvdepot.trace": ("kvdepot.server", "kvdepot.storage", "kvdepot.admin", "kvdepot.connectors", "kvdepot.peer"),
    # the server serves: it never calls out through the client or the connectors
    "kvdepot.server": ("kvdepot.client", "kvdepot.connectors", "kvdepot.bench", "kvdepot.rpc.channel"),
    # a runtime plugin is a separate process: it reaches the server only through its ports
    "kvdepot.plugins": ("kvdepot.server", "kvdepot.storage", "kvdepot.admin", "kvdepot.rpc.server", "kvdepot.rpc.dispatch", "kvdepot.bench"),
    # the peer tier is a tier and a node: it calls other nodes over the rpc layer, never through the
    # client, and knows no engine, server or admin API (an engine's connector may run a node)
    "kvdepot.peer": ("kvdepot.client", "kvdepot.connectors", "kvdepot.server", "kvdepot.admin", "kvdepot.bench"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in ``source``, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            out.extend((node.lineno, f"{name}.{alias.name}") for alias in node.names)  # `from pkg import mod`
    return out


def violations(module: str, imported: list[tuple[int, str]]) -> list[str]:
    """One message per (import statement, rule) broken."""
    found: dict[tuple[int, str], str] = {}
    for owner, banned in FORBIDDEN.items():
        if module != owner and not module.startswith(owner + "."):
            continue
        for line, name in imported:
            for b in banned:
                prefix = b.rstrip(".")
                if (name == prefix or name.startswith(prefix + ".")) and not name.startswith(owner):
                    found.setdefault((line, prefix), f"{module}:{line} imports {name} ({owner} must not import {prefix})")
    return list(found.values())


def test_no_forbidden_import_edge():
    problems = []
    files = sorted((SRC / "kvdepot").rglob("*.py"))
    assert len(files) > 40
    for path in files:
        module = module_name(path)
        problems += violations(module, imports_of(path.read_text(), module, path.name == "__init__.py"))
    assert not problems, "forbidden imports:\n" + "\n".join(problems)


def test_the_check_catches_a_forbidden_edge():
    planted = "from kvdepot.server.liveness import LivenessTracker\n\ndef f():\n    from ..storage import l1\n"
    found = violations("kvdepot.client.client", imports_of(planted, "kvdepot.client.client", False))
    assert len(found) == 2, found  # the server import, and the lazy relative storage import
    assert any("kvdepot.server.liveness" in f for f in found) and any("kvdepot.storage" in f for f in found)
    assert violations("kvdepot.client.client", imports_of("import numpy\nfrom kvdepot.protocol import codec\n", "kvdepot.client.client", False)) == []
    # the peer tier must reach other nodes through kvdepot.rpc from outside storage, never from inside it
    found = violations("kvdepot.storage.l2.peer_adapter", imports_of("from kvdepot.rpc.channel import RpcChannel\n", "kvdepot.storage.l2.peer_adapter", False))
    assert found and "kvdepot.rpc" in found[0]
    assert violations("kvdepot.storage.manager", imports_of("from kvdepot.client.client import KVClient\n", "kvdepot.storage.manager", False))
    assert violations("kvdepot.server.main", imports_of("from kvdepot.rpc.channel import RpcChannel\n", "kvdepot.server.main", False))


# --- the storage facade -------------------------------------------------------------------------------

# What the server (dispatch, handlers, composition root) and the admin API may import of storage: the
# facade, nothing else. Tables, arenas, controllers and tiers stay behind StorageManager (object identity
# is kvdepot.keys, at the bottom).
STORAGE_FACADE = ("kvdepot.storage.manager",)
FACADE_USERS = ("kvdepot.server", "kvdepot.admin")


def facade_breaches(module: str, source: str, is_package: bool) -> list[str]:
    """Imports of storage internals, and private attributes read off anything named ``storage``."""
    if not any(module == u or module.startswith(u + ".") for u in FACADE_USERS):
        return []
    by_line: dict[int, str] = {}
    for line, name in imports_of(source, module, is_package):
        inside = name.startswith("kvdepot.storage.")
        if inside and not any(name == f or name.startswith(f + ".") for f in STORAGE_FACADE):
            by_line.setdefault(line, f"{module}:{line} imports {name} (only {', '.join(STORAGE_FACADE)})")
    found = list(by_line.values())
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if owner_name in ("storage", "manager"):
                found.append(f"{module}:{node.lineno} reads {owner_name}.{node.attr} (a storage internal)")
    return found


def test_handlers_and_admin_see_storage_only_through_its_facade():
    problems = []
    for path in sorted((SRC / "kvdepot").rglob("*.py")):
        module = module_name(path)
        problems += facade_breaches(module, path.read_text(), path.name == "__init__.py")
    assert not problems, "storage internals used outside storage:\n" + "\n".join(problems)


def test_the_facade_check_catches_a_breach():
    planted = (
        "from kvdepot.storage.l1 import ObjectTable\n"
        "from kvdepot.storage.manager import StorageManager\n"
        "def h(state):\n    return state.storage._table.stats()\n"
    )
    found = facade_breaches("kvdepot.server.modules.lookup", planted, False)
    assert len(found) == 2, found
    assert "kvdepot.storage.l1" in found[0] and "storage._table" in found[1]
    assert facade_breaches("kvdepot.storage.manager", planted, False) == []  # storage itself may
