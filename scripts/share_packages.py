"""Hard-links pinned packages that this environment already has into another venv's site-packages.

Run with the source venv's python, before pip installs into the target:

    .venv/bin/python scripts/share_packages.py TARGET_SITE_PACKAGES REQUIREMENTS_FILE [NAME==VERSION ...]

Every pin (`name==version`) that the running environment has at exactly that version (a local label
such as `+cpu` allowed) is linked file by file from its RECORD, dist-info included, so pip in the
target sees it installed and skips it. torch and triton alone are ~1.8 GB that .venv and .venv-sglang
would otherwise hold twice; a CI machine's disk ran out on exactly that. Links share inodes, never
contents that change: pip replaces files (new inode) rather than writing into them, so an upgrade in
one venv leaves the other's copy whole. Scripts outside site-packages (bin/) are not linked, since
their shebangs name the source venv's python.

Does nothing for a package the target already has, and stops quietly where hard links cannot be made
(another filesystem): pip then installs as usual.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import sys
from pathlib import Path

PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(args: list[str]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for arg in args:
        lines = Path(arg).read_text().splitlines() if os.path.isfile(arg) else [arg]
        for line in lines:
            match = PIN.match(line)
            if match:
                pins[canonical(match.group(1))] = match.group(2)
    return pins


def matches(installed: str, pinned: str) -> bool:
    return installed == pinned or installed.split("+", 1)[0] == pinned


def link_dist(dist: metadata.Distribution, target: Path) -> int:
    """Links one distribution's files under target; returns bytes shared. Raises OSError on failure."""
    shared = 0
    made: list[Path] = []
    try:
        for file in dist.files or ():
            if file.parts and file.parts[0] == "..":
                continue
            source = Path(file.locate())
            if not source.is_file():
                continue
            dest = target / file
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.link(source, dest)
            made.append(dest)
            shared += source.stat().st_size
    except OSError:
        for path in made:
            path.unlink(missing_ok=True)
        raise
    return shared


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    target = Path(argv[0])
    pins = read_pins(argv[1:])
    have = {canonical(d.metadata["Name"] or "") for d in metadata.distributions(path=[str(target)])}
    shared = 0
    linked = 0
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name in have or name not in pins or not matches(dist.version, pins[name]):
            continue
        try:
            shared += link_dist(dist, target)
        except OSError as exc:
            print(f"share_packages: hard links not possible ({exc}); pip installs the rest", file=sys.stderr)
            break
        have.add(name)
        linked += 1
    print(f"share_packages: {linked} packages linked, {shared / 1e9:.2f} GB not copied")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
