"""Secrets kept out of what kvdepot prints: tier specs and URLs with their secret values withheld.

Used wherever a configuration value reaches a log line, an error message, ``/status`` or a plugin's
environment (``server.plugins``): an ``--l2`` spec may carry an S3 secret key, a Valkey URL a password,
a peer tier its cluster secret.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

WITHHELD = "<withheld>"
_SECRET_WORDS = ("secret", "password", "token", "access_key", "credential")


def is_secret_key(key: str) -> bool:
    """A setting whose value is a credential, by its name."""
    return any(w in key.lower() for w in _SECRET_WORDS)


def mask_url(value: str) -> str:
    """``redis://user:pw@host`` -> ``redis://user:<withheld>@host``; a secret-looking query parameter
    (``?password=...``, which the Valkey client reads too) is withheld as well."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises on a bad port: then nothing of it is shown)
    except ValueError:
        return WITHHELD
    if "@" in value and "@" not in parts.netloc:
        # a password with a '/', '?' or '#' not percent-encoded: the address ended inside it, and the
        # rest of it (and the host) went into the path, query or fragment; where it ends cannot be told
        return WITHHELD
    if parts.password:
        host = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{parts.username or ''}:{WITHHELD}@{host}")
    if parts.query:
        query = [(k, WITHHELD if v and is_secret_key(k) else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
        parts = parts._replace(query=urlencode(query, safe="<>"))
    return urlunsplit(parts)


def mask_tier_spec(spec: str) -> str:
    """An ``--l2`` spec (``type:key=value,...`` or JSON) with its secret-looking values and URL passwords
    withheld. JSON that does not parse is withheld whole: where its secrets are cannot be told."""

    def mask(key: str, value):
        if isinstance(value, str) and value and is_secret_key(key):
            return WITHHELD
        return mask_url(value) if isinstance(value, str) and ("@" in value or "?" in value) else value

    if spec.lstrip().startswith("{"):
        try:
            fields = json.loads(spec)
        except ValueError:
            return WITHHELD
        return json.dumps({k: mask(k, v) for k, v in fields.items()}) if isinstance(fields, dict) else WITHHELD
    kind, sep, rest = spec.partition(":")
    pairs = []
    for item in rest.split(",") if rest else []:
        key, eq, value = item.partition("=")
        pairs.append(f"{key}{eq}{mask(key.strip(), value)}" if eq else WITHHELD)  # the tail of a value with a comma
    return kind + sep + ",".join(pairs)
