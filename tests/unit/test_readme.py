"""README.md is a newcomer's door: it lists every server option and every tier option, its tables render
(no row cut off by a blank line, no command output posing as a heading), and it points at nothing that
is not in the repository. (Its engine examples are run as printed by tests/e2e/test_readme_examples.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvdepot.cli import build_parser
from kvdepot.storage.l2.registry import adapter_types, describe_options

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n{title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def prose_lines() -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(README.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def test_every_server_option_is_in_the_configuration_table():
    server = build_parser()._subparsers._group_actions[0].choices["server"]
    flags = {s for a in server._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    table = section("## Configuration")
    missing = sorted(f for f in flags if f"`{f}" not in table)
    assert not missing, f"server options README's Configuration table does not list: {missing}"


@pytest.mark.parametrize("kind", sorted(adapter_types()))
def test_every_tier_option_is_in_the_tiers_table(kind):
    [row] = [line for line in section("### L2 tiers").splitlines() if line.startswith(f"| `{kind}` |")]
    missing = [key for key, _, _ in describe_options(kind) if f"`{key}" not in row]
    assert not missing, f"{kind} options README does not list: {missing}"


def test_tables_render():
    lines = prose_lines()
    for i, (n, line) in enumerate(lines):
        if not line.startswith("|"):
            continue
        prev = lines[i - 1][1] if i else ""
        nxt = lines[i + 1][1] if i + 1 < len(lines) else ""
        starts_table = not prev.startswith("|")
        assert not starts_table or re.match(r"\|\s*-{3,}", nxt), f"README line {n}: a table row cut off from its table:\n{line}"


def test_no_command_output_poses_as_a_heading():
    headings = [(n, line) for n, line in prose_lines() if line.startswith("#")]
    assert headings and headings[0][1] == "# kvdepot"
    for n, line in headings:  # a heading is a title: short, no measurements, no clauses
        looks_like_output = ";" in line or re.search(r"\d+(\.\d+)?\s*(s|ms|GiB|MiB|GB)\b", line)
        assert len(line) < 80 and not looks_like_output, f"README line {n} renders as a heading: {line}"


def test_nothing_is_referenced_that_is_not_in_the_repository():
    assert "ARCHITECTURE" not in README and not re.search(r"\bissue \d+", README)
    for target in re.findall(r"\]\(([^)#]+)\)", README):  # relative links
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), f"README links to {target}, which is not in the repository"


@pytest.mark.parametrize(
    "title, settings, loader_keys",
    [
        ("### Use with vLLM", "kvdepot.connectors.vllm.config:ConnectorConfig", ()),
        ("### Use with SGLang", "kvdepot.connectors.sglang.settings:SGLangSettings", ("backend_name", "module_path", "class_name")),
    ],
)
def test_every_connector_key_is_in_its_engines_table(title, settings, loader_keys):
    import importlib

    import msgspec

    module, name = settings.split(":")
    keys = [f.name for f in msgspec.structs.fields(getattr(importlib.import_module(module), name))]
    start = README.index(f"\n{title}\n")
    text = README[start : min(i for i in (README.find("\n## ", start + 1), README.find("\n### ", start + 1), len(README)) if i > 0)]
    rows = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
    missing = [k for k in keys if f"`{k}`" not in (text if k in loader_keys else rows)]
    assert not missing, f"keys README's {title} section does not list: {missing}"


# --- the claims that can be checked against the code mechanically -----------------------------------


def _server_parser():
    return build_parser()._subparsers._group_actions[0].choices["server"]


def _table_rows(text: str) -> list[list[str]]:
    """The cells of each body row of the markdown tables in ``text`` (header and rule left out)."""
    rows, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.match(r"\|\s*-{3,}", line) or (i + 1 < len(lines) and re.match(r"\|\s*-{3,}", lines[i + 1])):
            continue
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def _same_default(shown: str, default) -> bool:
    """Does a README default (``2.0``, ``off``, ``none``, ``sha256``) say what the parser's default is?"""
    shown = shown.strip("`")
    if default in ("", None, False, 0, [], ()):
        return shown in ("off", "none", "0") or (default is None and shown == "host")  # --http-host follows --host
    if isinstance(default, bool):  # a --no-X flag: on unless given
        return shown.startswith("(") or shown in ("on", "pinned")
    if isinstance(default, (int, float)):
        try:
            return float(shown.split()[0]) == float(default)
        except ValueError:
            return False
    return shown == str(default)


def test_every_configuration_default_is_the_servers():
    actions = {s: a for a in _server_parser()._actions for s in a.option_strings}
    wrong, checked = [], 0
    for cells in _table_rows(section("## Configuration")):
        if len(cells) != 3 or not cells[0].startswith("`--"):
            continue
        flags = [re.match(r"`?(--[a-z0-9-]+)", f.strip()).group(1) for f in cells[0].split(" / ")]
        defaults = [d.strip() for d in cells[1].split(" / ")] if len(flags) > 1 else [cells[1]]
        defaults = defaults * len(flags) if len(defaults) == 1 else defaults  # "off" for both
        assert len(defaults) == len(flags), f"README's Configuration row {cells[0]}: {len(flags)} flags, defaults {cells[1]!r}"
        for flag, shown in zip(flags, defaults, strict=True):
            shown = re.sub(r"\s*\(.*\)$", "", shown) if not shown.startswith("(") else shown  # "5 (at least 1)"
            assert flag in actions, f"README's Configuration table names {flag}, which `kvdepot server` does not have"
            checked += 1
            if not _same_default(shown, actions[flag].default):
                wrong.append(f"{flag}: README {shown!r}, the server {actions[flag].default!r}")
    assert checked >= 50 and not wrong, wrong


def test_every_choice_of_a_server_option_is_named_in_its_row():
    table = section("## Configuration")
    for action in _server_parser()._actions:
        if not action.choices:
            continue
        flag = action.option_strings[0]
        [row] = [line for line in table.splitlines() if line.startswith(f"| `{flag}`")]
        missing = [c for c in action.choices if f"`{c}`" not in row]
        assert not missing, f"README's row for {flag} does not name the choices {missing}"


@pytest.mark.parametrize("kind", sorted(adapter_types()))
def test_every_tier_default_is_the_tiers(kind):
    [row] = [line for line in section("### L2 tiers").splitlines() if line.startswith(f"| `{kind}` |")]
    options = row.split("|")[2]
    wrong = []
    for key, default, _ in describe_options(kind):
        shown = re.search(rf"`{key}=([^`]*)`", options)
        if default == "(required)":
            assert f"`{key}` (required)" in options, f"{kind}: README does not say {key} is required"
        elif shown is None:  # a key with no default shown (`endpoint_url`, `secret`): its default is empty
            assert default in ("", "0"), f"{kind}: README shows no default for {key}, whose default is {default!r}"
        elif not _same_default(shown.group(1), _parsed(default)):
            wrong.append(f"{key}: README {shown.group(1)!r}, the tier {default!r}")
    assert not wrong, f"{kind}: {wrong}"


def _parsed(text: str):
    if text in ("true", "false"):
        return text
    try:
        return float(text)
    except ValueError:
        return text


def test_every_tier_default_is_shown_as_a_spec_takes_it():
    """--help lists the tier defaults: each must be a value a spec accepts (`cluster=auto`, not an enum's repr)."""
    from kvdepot.storage.l2.registry import parse_spec

    for kind in adapter_types():
        for key, default, _ in describe_options(kind):
            assert not re.fullmatch(r"[A-Z]\w*\.[A-Z_]+", default), f"{kind}: {key}'s default is shown as {default!r}"
            if default != "(required)":
                parse_spec(f"{kind}:{key}={default}" + (",path=/tmp" if kind == "fs" else ",bucket=b" if kind == "s3" else ""))
    assert dict((k, d) for k, d, _ in describe_options("valkey"))["cluster"] == "auto"


def _exported_metric_names() -> set[str]:
    """Every sample name a server's and a peer node's /metrics can carry."""
    from prometheus_client import CollectorRegistry

    from kvdepot.observability import metrics as mod

    class Zeros:
        handler_errors: dict = {}

        def __getattr__(self, name):
            return 0

    server = mod.Metrics()
    server.subscribe_to(type("Bus", (), {"subscribe": lambda *a: None, "stats": lambda self: Zeros()})())
    server.watch_tenants(dict)
    server.watch_storage(lambda: type("Snapshot", (), {"l1": Zeros(), "store": Zeros(), "prefetch": Zeros(), "tiers": ()})())
    peer = mod.PeerMetrics(dict)
    names: set[str] = set()
    for registry in (server.registry, peer.registry):
        assert isinstance(registry, CollectorRegistry)
        for family in registry.collect():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}.get(family.type, ("",))
            names |= {family.name + s for s in suffixes}
    return names


def test_every_metric_the_readme_names_is_exported():
    exported = _exported_metric_names()
    assert "kvdepot_request_seconds_count" in exported and "kvdepot_peer_members" in exported  # the checker sees both registries
    named = set(re.findall(r"\bkvdepot_[a-z0-9_]*[a-z0-9]", README)) - {"kvdepot_agent_session"}  # that one is a request key
    missing = sorted(n for n in named if n not in exported and not any(n + s in exported for s in ("_count", "_total")))
    assert not missing, f"README names metrics kvdepot does not export: {missing}"


def test_the_http_api_table_is_exactly_the_apps_routes():
    from fastapi.routing import APIRoute

    from kvdepot.admin.guard import AdminGuard
    from kvdepot.admin.http import build_app

    app = build_app(object(), AdminGuard("127.0.0.1", 8080))
    served = {(m, re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", r.path)) for r in app.router.routes if isinstance(r, APIRoute) for m in r.methods}
    named: set[tuple[str, str]] = set()
    for cells in _table_rows(section("## HTTP API")):
        for methods, path, alias in re.findall(r"`([A-Z\\|]+) (/[^`]*)`(?: \(or `(/[^`]*)`\))?", cells[0]):
            for m in methods.split("\\|"):
                named |= {(m, path), *([(m, alias)] if alias else [])}
    pins = {("DELETE", "/cache/pins/{pin_id}"), ("POST", "/cache/pins/{pin_id}/extend")}
    named = {(m, p.replace("{id}", "{pin_id}")) for m, p in named}
    assert pins <= named and named == served, (f"README's HTTP API table names routes the app lacks: {sorted(named - served)}; "
                                               f"the app serves routes the table does not name: {sorted(served - named)}")  # fmt: skip


def _all_flags() -> set[str]:
    import argparse

    out: set[str] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for a in p._actions:
            out.update(s for s in a.option_strings if s.startswith("--"))
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    walk(sub)

    walk(build_parser())
    return out


FOREIGN_FLAGS = {"--hicache-storage-backend", "--timeout", "--every-s"}  # SGLang's, pytest's, the usage_log plugin's


@pytest.mark.parametrize("title", ["## Running a cluster", "## Operating kvdepot", "## Safety", "## Configuration", "## HTTP API"])
def test_every_flag_an_operators_section_names_exists(title):
    flags = _all_flags()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", section(title)))
    unknown = sorted(named - flags - FOREIGN_FLAGS)
    assert not unknown, f"README's {title} names flags no kvdepot command has: {unknown}"


@pytest.mark.parametrize("title", ["## Running a cluster", "## Operating kvdepot", "## Safety"])
def test_every_default_the_prose_states_is_the_codes(title):
    """"`member_ttl_s` (5 s)", "`--event-queue-size`, 65536": a default stated in passing is the code's."""
    server = {s: a.default for a in _server_parser()._actions for s in a.option_strings}
    peer = {key: _parsed(default) for key, default, _ in describe_options("peer")}
    stated = re.findall(r"`(--[a-z0-9-]+|[a-z_]+)`\)?(?:, | \()(\d[\d,.]*?)(?:\s*(?:s|ms|MiB|GiB))?[),;: ]", section(title))
    checked, wrong = 0, []
    for name, value in stated:
        default = server.get(name) if name.startswith("--") else peer.get(name)
        if default is None:
            continue
        checked += 1
        if float(value.replace(",", "")) != float(default):
            wrong.append(f"{name}: README {value}, the code {default}")
    assert not wrong, wrong
    assert checked or title == "## Safety"


def test_the_lifecycle_section_says_a_prefix_needs_a_registered_engine():
    """A newcomer's first `POST /cache/pin` with no engine connected is a 409: README says so, and the
    code does refuse it that way (the objects' keys need a registered context's model, rank and layout)."""
    from kvdepot.admin.routes.lifecycle import _STATUS
    from kvdepot.errors import ErrorCode, KVDepotError
    from kvdepot.server.lifecycle import Lifecycle
    from kvdepot.server.state import ContextRegistry

    text = " ".join(section("### Lifecycle: pins, agent sessions, warm-up, delete").split())
    assert "need an engine of that model connected now: with none, they are refused with 409" in text
    with pytest.raises(KVDepotError) as refused:
        Lifecycle(storage=None, contexts=ContextRegistry()).targets(None, "", None, [1, 2, 3])  # type: ignore[arg-type]
    assert refused.value.code is ErrorCode.UNKNOWN_CONTEXT and _STATUS[ErrorCode.UNKNOWN_CONTEXT] == 409
