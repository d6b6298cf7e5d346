"""Finding and configuring L2 adapters.

Adapters live in modules named ``*_adapter.py`` in this package (or are registered through the
``kvdepot.l2_adapters`` entry-point group). Each such module defines ``ADAPTER = AdapterType(...)``
(``contract.py``): a name, a config (a ``ConfigStruct``: unknown keys forbidden, help text per key) and a
factory.

A tier is configured on the command line as ``--l2 'fs:path=/data/kv,size_gb=100'`` (repeatable) or as
JSON: ``--l2 '{"type": "fs", "path": "/data/kv", "size_gb": 100}'``. Values are converted to the
config's field types; unknown keys, missing required keys and bad values are start-up errors.
"""

from __future__ import annotations

import enum
import importlib
import json
import pkgutil
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import msgspec

from kvdepot.config import ConfigStruct
from kvdepot.errors import ConfigError
from kvdepot.redact import mask_tier_spec
from kvdepot.storage.l2.contract import AdapterType, L2Adapter, TierServices

ENTRY_POINT_GROUP = "kvdepot.l2_adapters"


@dataclass(frozen=True)
class TierSpec:
    """One configured tier: which adapter type, its validated config, and the name it shows under."""

    type: str
    name: str
    config: Any


def adapter_types() -> dict[str, AdapterType]:
    found: dict[str, AdapterType] = {}
    package = importlib.import_module(__package__)
    for mod in pkgutil.iter_modules(package.__path__):
        if mod.name.endswith("_adapter"):
            adapter = getattr(importlib.import_module(f"{__package__}.{mod.name}"), "ADAPTER", None)
            if isinstance(adapter, AdapterType):
                found[adapter.name] = adapter
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        adapter = ep.load()
        if isinstance(adapter, AdapterType):
            found.setdefault(adapter.name, adapter)
    return found


def parse_spec(text: str, index: int = 0) -> TierSpec:
    """``type:key=value,...`` or a JSON object with a ``type`` key. Every option's type, range and
    cross-field rule is checked here (the config struct's constraints); a bad one raises ConfigError
    naming the spec, the tier and the key."""
    text = text.strip()
    shown = mask_tier_spec(text)  # what an error may print: a spec carries credentials
    types = adapter_types()
    if text.startswith("{"):
        try:
            raw = json.loads(text, object_pairs_hook=_once_each)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--l2 {shown!r}: invalid JSON ({exc})") from None
        except _GivenTwice as twice:
            raise ConfigError(f"--l2 {shown!r}: {twice.key!r} is given twice") from None
        if not isinstance(raw, dict) or "type" not in raw:
            raise ConfigError(f"--l2 {shown!r}: a JSON tier needs a \"type\"")
        kind = str(raw.pop("type"))
        fields: dict[str, Any] = raw
    else:
        kind, _, rest = text.partition(":")
        fields = {}
        for i, part in enumerate(filter(None, (p.strip() for p in rest.split(","))), 1):
            key, eq, value = part.partition("=")
            if not eq:  # named when it is one of the tier's keys; else it may be the tail of a secret with a comma
                known = part in getattr(types[kind].config, "__struct_fields__", ()) if kind in types else False
                raise ConfigError(f"--l2 {shown!r}: {repr(part) if known else f'item {i}'} is not key=value (a value with a comma goes in a JSON spec)")
            if key.strip() in fields:  # the last one won without a word (size_gb=100,...,size_gb=1)
                raise ConfigError(f"--l2 {shown!r}: {key.strip()!r} is given twice")
            fields[key.strip()] = value.strip()
    if kind not in types:
        raise ConfigError(f"--l2 {shown!r}: unknown tier type {kind!r}; known: {sorted(types)}")
    name = str(fields.pop("name", f"{kind}{index}"))
    try:
        config = msgspec.convert(fields, types[kind].config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--l2 {shown!r} (tier {name}, {kind}): {_name_the_key(str(exc))}") from None
    return TierSpec(kind, name, config)


class _GivenTwice(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (``json`` keeps the last of a key given twice)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _GivenTwice(key)
        out[key] = value
    return out


def _name_the_key(message: str) -> str:
    """msgspec says '... - at `$.size_gb`': put the key first ('size_gb: ...')."""
    head, sep, where = message.rpartition(" - at `$.")
    return f"{where.rstrip('`')}: {head}" if sep else message


def build(spec: TierSpec, services: TierServices | None = None) -> L2Adapter:
    """The adapter for a parsed spec, given the composition root's shared services; a failure here (a
    path that cannot be made, a client library that refuses the options) is a configuration error
    naming the tier."""
    try:
        return adapter_types()[spec.type].factory(spec.name, spec.config, services or TierServices())
    except (OSError, ValueError, TypeError, ImportError) as exc:
        raise ConfigError(f"--l2 tier {spec.name} ({spec.type}): {exc}") from None


def config_defaults(config: type[ConfigStruct]) -> dict[str, Any]:
    """Field -> default (fields without one are required)."""
    return {f.name: f.default for f in msgspec.inspect.type_info(config).fields if f.default is not msgspec.NODEFAULT}


def describe() -> str:
    """Help text listing every adapter type and its options (key=default)."""
    lines = []
    for name, t in sorted(adapter_types().items()):
        defaults = config_defaults(t.config)
        opts = ", ".join(f"{f}={_shown(defaults[f]) if f in defaults else '(required)'}" for f in t.config.__struct_fields__)
        lines.append(f"{name}: {t.help} [{opts}]")
    return "; ".join(lines)


def describe_options(kind: str) -> list[tuple[str, str, str]]:
    """(key, default, help) for every option of one adapter type (for documentation)."""
    t = adapter_types()[kind]
    defaults = config_defaults(t.config)
    out = []
    for f in msgspec.inspect.type_info(t.config).fields:
        meta = f.type if isinstance(f.type, msgspec.inspect.Metadata) else None
        doc = (meta.extra_json_schema or {}).get("description", "") if meta is not None else ""
        out.append((f.name, _shown(defaults[f.name]) if f.name in defaults else "(required)", doc))
    return out


def _shown(value: Any) -> str:
    """A default as a spec writes it: ``true``, ``auto`` (an enum's value; ``str()`` of a ``(str, Enum)``
    member is ``ClusterMode.AUTO``, which ``--help`` showed and no spec accepts)."""
    if isinstance(value, enum.Enum):
        value = value.value
    return str(value).lower() if isinstance(value, bool) else str(value)
