"""A peer node misconfigured on its command line (or in ``PeerStore(...)``, ``--l2 peer:...``): one clear
error naming the setting at start, never a traceback or an error that sends the operator looking for a
process that does not exist."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvdepot.bench.serverproc import free_port
from kvdepot.errors import ConfigError
from kvdepot.peer.config import PeerConfig
from kvdepot.storage.l2.registry import parse_spec


def _peer_cli(*args: str) -> subprocess.CompletedProcess:
    """``kvdepot peer ARGS`` expected to refuse to start: a node still up after 15 s is stopped and fails the test."""
    cmd = [sys.executable, "-m", "kvdepot.cli", "peer", "--join-timeout-s", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"kvdepot peer {' '.join(args)} started: {out[-500:]} {err[-1500:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_a_pool_that_cannot_be_reserved_is_a_message_naming_the_flag():
    """256 TiB is more than any process can map: the mmap's ENOMEM came out as a traceback."""
    r = _peer_cli("--port", "0", "--data-port", "0", "--metrics-port", "0", "--pool-size-mb", str(1 << 28))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert "--pool-size-mb 268435456" in r.stderr, r.stderr


@pytest.mark.parametrize("other", ["--data-port", "--metrics-port"])
def test_two_of_a_nodes_own_ports_on_one_number_are_refused_naming_both(other):
    """The second bind failed with "in use (another process listens there)" (or, for the metrics port, a
    warning and a node without its page), where no other process is."""
    port = free_port()
    ports = {"--data-port": "0", "--metrics-port": "0", other: str(port)}
    r = _peer_cli("--port", str(port), *[x for kv in ports.items() for x in kv])
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"--port and {other} are both port {port}" in r.stderr, r.stderr
    assert "another process" not in r.stderr
    # in code and in an --l2 spec, the keys are named as keys
    with pytest.raises(ConfigError, match="port and data_port are both port 41000"):
        PeerConfig(port=41000, data_port=41000)
    with pytest.raises(ConfigError, match="data_port and metrics_port are both port 41001"):
        parse_spec("peer:port=41000,data_port=41001,metrics_port=41001")
    PeerConfig(port=0, data_port=0, metrics_port=0)  # 0: free ports, never the same one
