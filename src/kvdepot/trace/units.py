"""Byte sizes as people write them (``64GiB``, ``512M``, ``1.5T``: binary multiples) and back."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64GiB"`` -> 68719476736. K, M, G, T, P are powers of 1024, with or without ``iB``/``B``."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size like 512MiB, 64GiB or 2T")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{text!r} must be more than 0 bytes")
    return value


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
