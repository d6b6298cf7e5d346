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
