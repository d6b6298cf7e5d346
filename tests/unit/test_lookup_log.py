"""The lookup log's file: one JSON line per engine lookup, readable by the server's user alone."""

from __future__ import annotations

import json
import os
import stat

from kvdepot.events import ChunkRequestDone
from kvdepot.observability.lookup_log import LookupLog


def _lookup(salt: str) -> ChunkRequestDone:
    return ChunkRequestDone("lookup", 1.0, 0.002, "m", salt, (b"a" * 32, b"b" * 32), 16, 4096, 1, "ok", "LOOKUP", 0.0, 0)


def test_every_file_of_the_lookup_log_stays_private_across_rotations(tmp_path):
    """It names every tenant's salt. The first file was chmod-ed once; the files a rotation opened came
    with the umask (0644 under the usual 022): anyone on the host read the salts."""
    path = tmp_path / "lookups.jsonl"
    path.write_text("")
    os.chmod(path, 0o644)  # a file left from an earlier run, made with the umask
    old_umask = os.umask(0o022)
    try:
        log = LookupLog(str(path), max_mb=1, backups=2)
        try:
            for i in range(3):
                log.handle([_lookup(f"tenant-{i}")])
                log._handler.doRollover()
            log.handle([_lookup("tenant-last")])
        finally:
            log.close()
    finally:
        os.umask(old_umask)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["lookups.jsonl", "lookups.jsonl.1", "lookups.jsonl.2"]
    for name in files:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    [line] = path.read_text().splitlines()
    assert json.loads(line)["salt"] == "tenant-last"


def test_a_link_planted_at_the_log_path_is_refused_not_followed(tmp_path):
    """The log names every tenant's salt: a link at its path (a shared directory, or put there between
    two rotations) had every lookup appended to its target, and the target's mode set to 0600."""
    import pytest

    victim = tmp_path / "victim.conf"
    victim.write_text("precious\n")
    os.chmod(victim, 0o644)
    link = tmp_path / "lookups.log"
    os.symlink(victim, link)
    with pytest.raises(OSError):
        LookupLog(str(link)).close()
    assert victim.read_text() == "precious\n"
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o644, "the link's target was made 0600"
