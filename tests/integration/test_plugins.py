"""Runtime plugins (``--plugin MODULE[:ARGS]``): real plugin processes beside a real server.

The shipped ``usage_log`` plugin fills its file with what ``/status`` says; probe plugins (small modules
written per test, found through PYTHONPATH) report their environment, crash at once, or ignore SIGTERM
and start a child of their own. Process checks read ``/proc``: a pid that is gone or a zombie is dead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import msgspec
import pytest
from support.servers import CHUNK, LAYOUT, SMALL_L1, Server, make_kv, make_tokens, stop_server, wait_until

from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.config import HttpConfig, ServerConfig, StorageConfig
from kvdepot.plugins import WITHHELD, PluginEnvironment
from kvdepot.redact import mask_tier_spec
from kvdepot.server.plugins import public_config

TOKEN = "tok-3f9a0c1d-never-in-a-plugin"

PROBES = {
    # writes its whole environment and its pid, then runs until SIGTERM or its server is gone
    "kvd_probe_env": """
        import json, os, signal, sys, time
        from kvdepot.plugins import PluginEnvironment
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with open(sys.argv[1] + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "env": dict(os.environ)}, f)
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        print("probe env written", flush=True)
        while PluginEnvironment.from_environ().server_alive():
            time.sleep(0.1)
    """,
    # notes each start, then fails at once
    "kvd_probe_crash": """
        import os, sys
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()}\\n")
        print("probe crash: failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    """,
    # ignores SIGTERM and starts a child of its own: only SIGKILL to its process group ends both
    "kvd_probe_stubborn": """
        import json, os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["sleep", "300"])
        with open(sys.argv[1] + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "child": child.pid}, f)
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        while True:
            time.sleep(0.1)
    """,
    # ends on SIGTERM, but first starts a worker of its own that ignores SIGTERM (as a worker pool, a
    # shell pipeline or a server it launched may): the worker is in the plugin's process group
    "kvd_probe_parent": """
        import json, os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        worker = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "child": worker.pid}) + "\\n")
        if len(sys.argv) > 2:  # crash at once, leaving the worker behind
            sys.exit(4)
        while True:
            time.sleep(0.1)
    """,
}


@pytest.fixture
def plugin_server(tmp_path):
    """``start(*args, env=None)``: a server whose plugins can be the probes; all stopped in teardown."""
    probes = tmp_path / "probes"
    probes.mkdir()
    for name, source in PROBES.items():
        (probes / f"{name}.py").write_text(textwrap.dedent(source))
    started: list[Server] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Server:
        path = os.pathsep.join(p for p in (str(probes), os.environ.get("PYTHONPATH", "")) if p)
        ipc_dir = tempfile.mkdtemp(prefix="kvd-")  # short: ipc paths are limited to ~107 bytes
        proc = ServerProcess(
            args=["--chunk-size", str(CHUNK), "--l1-size-gb", SMALL_L1, *args],
            http_port=free_port(),
            ipc_path=os.path.join(ipc_dir, "s.ipc"),
            env={"PYTHONPATH": path, **(env or {})},
            log_path=str(tmp_path / f"server{len(started)}.log"),
        )
        srv = Server(proc, Path(proc.log_path), ipc_dir)
        started.append(srv)
        proc.start()
        return srv

    yield start
    for s in started:
        stop_server(s)


def plugins_of(srv: Server) -> dict[str, dict]:
    return {p["name"]: p for p in srv.status()["plugins"]}


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (it runs no more either way)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def usage_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]  # every line whole JSON


# --- the shipped plugin and the environment ------------------------------------------------------


def test_usage_log_writes_what_status_says_and_plugins_get_the_config_without_secrets(plugin_server, tmp_path, seed):
    usage, envfile = tmp_path / "usage.jsonl", tmp_path / "env.json"
    srv = plugin_server(
        "--plugin", f"kvdepot.plugins.usage_log:{usage} --every-s 0.2",
        "--plugin", f"kvd_probe_env:{envfile}",
        env={"KVDEPOT_ADMIN_TOKEN": TOKEN},  # the server reads its token from here; a plugin must not
    )
    with srv.client() as c:
        tokens = make_tokens(6 * CHUNK, seed)
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == 6 * CHUNK
        assert c.lookup_chunks(c.hashes(tokens)) == 6
        st = srv.status()
        assert st["l1"]["objects"] == 6 and st["lookups"]["hit_tokens"] == 6 * CHUNK

        def line_matching():
            return [r for r in usage_lines(usage) if r["l1_objects"] == 6 and r["hit_tokens"] == st["lookups"]["hit_tokens"]]

        [row, *_] = wait_until(line_matching, what="a usage line with the stored objects and hit tokens")
        assert row["l1_used_bytes"] == st["l1"]["used_bytes"] == 6 * LAYOUT.chunk_bytes(CHUNK)
        assert row["l1_capacity_bytes"] == st["l1"]["capacity_bytes"]
        assert row["requested_tokens"] == st["lookups"]["requested_tokens"] and row["clients"] == st["clients"] and row["contexts"] == st["contexts"] == 1
        assert all(set(r) == set(row) for r in usage_lines(usage))

    probe = wait_until(lambda: read_json(envfile), what="the env probe's report")
    env = probe["env"]
    plugin_env = PluginEnvironment.from_environ(env)
    assert plugin_env.name == "kvd_probe_env"
    assert plugin_env.http_url == srv.http and plugin_env.rpc_url == srv.url
    assert plugin_env.server_pid == srv.proc.proc.pid
    config = plugin_env.config()  # the server's resolved config, as a ServerConfig
    assert isinstance(config, ServerConfig)
    assert config.storage.chunk_size == CHUNK and config.storage.l1_size_gb == float(SMALL_L1) and config.http.port == srv.http_port
    assert config.plugins.specs == (f"kvdepot.plugins.usage_log:{usage} --every-s 0.2", f"kvd_probe_env:{envfile}")
    assert config.http.admin_token == WITHHELD  # "a token is set", not the token
    assert "KVDEPOT_ADMIN_TOKEN" not in env
    assert not [k for k, v in env.items() if TOKEN in v], "the admin token reached a plugin in clear"

    shown = plugins_of(srv)
    assert set(shown) == {"kvdepot.plugins.usage_log", "kvd_probe_env"}
    assert shown["kvd_probe_env"]["pid"] == probe["pid"]
    assert all(p["state"] == "running" and p["restarts"] == 0 for p in shown.values()), shown
    assert "[kvd_probe_env] probe env written" in srv.log_text()  # its output is in the server's log, under its name


def test_usage_log_makes_the_directory_of_its_file(plugin_server, tmp_path):
    """README's own example logs to /var/log/kvdepot/usage.jsonl, a directory no fresh machine has: the
    plugin makes it, rather than exit 2 at every start and back off for ever with the file never written."""
    usage = tmp_path / "var-log" / "kvdepot" / "usage.jsonl"
    srv = plugin_server("--plugin", f"kvdepot.plugins.usage_log:{usage} --every-s 0.2")
    wait_until(lambda: usage_lines(usage), what="a usage line in a directory that did not exist")
    [shown] = plugins_of(srv).values()
    assert shown["state"] == "running" and shown["restarts"] == 0, shown


# --- restarts ------------------------------------------------------------------------------------


def test_a_killed_plugin_is_restarted_and_a_crashing_one_backs_off(plugin_server, tmp_path):
    usage, starts = tmp_path / "usage.jsonl", tmp_path / "starts.txt"
    srv = plugin_server("--plugin", f"kvdepot.plugins.usage_log:{usage} --every-s 0.2", "--plugin", f"kvd_probe_crash:{starts}")
    name = "kvdepot.plugins.usage_log"
    first = wait_until(lambda: (p := plugins_of(srv)[name])["state"] == "running" and p["pid"] and p, what="usage_log running")
    wait_until(lambda: usage_lines(usage), what="a first usage line")
    os.kill(first["pid"], signal.SIGKILL)
    again = wait_until(lambda: (p := plugins_of(srv)[name])["restarts"] == 1 and p["state"] == "running" and p, what="usage_log restarted")
    assert again["pid"] not in (0, first["pid"]) and dead(first["pid"])
    assert again["last_exit_code"] == -signal.SIGKILL
    assert again["restart_delays_s"] == [0.5]  # it had run less than a minute: the first delay
    n = len(usage_lines(usage))
    wait_until(lambda: len(usage_lines(usage)) > n + 1, what="the restarted plugin writing on")

    crash = wait_until(lambda: (p := plugins_of(srv)["kvd_probe_crash"])["restarts"] >= 3 and p, timeout_s=40, what="3 restarts")
    delays = crash["restart_delays_s"]
    assert len(delays) >= 3 and all(b >= a for a, b in zip(delays, delays[1:])) and delays[-1] > delays[0], delays
    assert delays[:3] == [0.5, 1.0, 2.0]
    assert crash["last_exit_code"] == 3
    # Each counted start was a real process: every one writes a line (the one just spawned may not have yet).
    wait_until(lambda: len(starts.read_text().split()) >= crash["restarts"] + (crash["state"] == "running"), what="a line from each start")
    assert srv.alive()
    assert "[kvd_probe_crash] probe crash: failing on purpose" in srv.log_text()


# --- shutdown ------------------------------------------------------------------------------------


def test_shutdown_leaves_no_plugin_process(plugin_server, tmp_path):
    usage, stubborn, envfile = tmp_path / "usage.jsonl", tmp_path / "stubborn.json", tmp_path / "env.json"
    srv = plugin_server(
        "--plugin-grace-s", "1",
        "--plugin", f"kvdepot.plugins.usage_log:{usage} --every-s 0.2",
        "--plugin", f"kvd_probe_stubborn:{stubborn}",
        "--plugin", f"kvd_probe_env:{envfile}",
    )
    st = wait_until(lambda: (st := srv.status()) and all(p["state"] == "running" and p["pid"] for p in st["plugins"]) and st, what="all running")
    pids = [p["pid"] for p in st["plugins"]]
    stub = wait_until(lambda: read_json(stubborn), what="the stubborn probe's report")
    assert stub["pid"] in pids and not dead(stub["child"])
    assert not any(dead(pid) for pid in pids)
    assert srv.stop() == 0, "the server must exit cleanly on SIGTERM"
    wait_until(lambda: all(dead(pid) for pid in [*pids, stub["child"]]), timeout_s=10, what="every plugin process (and the one a plugin started) gone")
    log = srv.log_text()
    assert "plugin kvd_probe_stubborn did not stop within 1.0 s of SIGTERM: killing it" in log
    assert "did not stop" not in log.replace("plugin kvd_probe_stubborn did not stop", "")  # the others stopped on SIGTERM


def test_a_second_signal_while_closing_exits_at_once_and_kills_the_plugins(plugin_server, tmp_path):
    """A close that hangs (here a plugin that ignores SIGTERM, with a minute's grace) gave the operator's
    second Ctrl-C nothing: only SIGKILL ended the server, and the plugin ran on. The second signal exits
    at once (130: SIGINT's) and takes the plugin's processes with it."""
    stubborn = tmp_path / "stubborn.json"
    shm = tempfile.mkdtemp(prefix="kvd-forced-", dir="/dev/shm")  # the arena a forced exit leaves behind lands here
    try:
        _second_signal(plugin_server("--shm-dir", shm, "--plugin-grace-s", "60", "--plugin", f"kvd_probe_stubborn:{stubborn}"), stubborn)
        assert os.listdir(shm), "the forced exit closed the arena after all"  # (what the README says stays behind)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _second_signal(srv: Server, stubborn: Path) -> None:
    stub = wait_until(lambda: read_json(stubborn), what="the stubborn probe's report")
    srv.proc.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "shutting down" in srv.log_text(), what="the server closing")
    assert srv.proc.proc.poll() is None, "the close did not wait for the plugin"  # (the grace is a minute)
    srv.proc.proc.send_signal(signal.SIGINT)
    assert srv.proc.proc.wait(10) == 130
    wait_until(lambda: dead(stub["pid"]) and dead(stub["child"]), timeout_s=10, what="the plugin and its child killed")
    assert "SIGINT again while closing: exiting now" in srv.log_text()


def test_shutdown_ends_what_a_plugin_started_even_when_the_plugin_itself_stops_on_sigterm(plugin_server, tmp_path):
    """The plugin ends on SIGTERM at once; the worker it started ignores SIGTERM. The supervisor saw its
    plugin's process end within the grace period and never sent the group SIGKILL: the worker ran on
    after the server had exited, for ever."""
    report = tmp_path / "parent.jsonl"
    srv = plugin_server("--plugin-grace-s", "1", "--plugin", f"kvd_probe_parent:{report}")
    [probe] = wait_until(lambda: [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else None, what="the probe's report")
    wait_until(lambda: plugins_of(srv)["kvd_probe_parent"]["state"] == "running", what="the plugin running")
    try:
        assert srv.stop() == 0, "the server must exit cleanly on SIGTERM"
        wait_until(lambda: dead(probe["pid"]), timeout_s=10, what="the plugin gone")
        wait_until(lambda: dead(probe["child"]), timeout_s=10, what="the worker the plugin started gone after the server's shutdown")
    finally:
        for pid in (probe["pid"], probe["child"]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_crashed_plugins_leftover_processes_do_not_pile_up(plugin_server, tmp_path):
    """A plugin that crashes leaving a worker behind: each restart left one more worker running (in the
    old process group, which nothing signalled again), and the shutdown ended none of them."""
    report = tmp_path / "parent.jsonl"
    srv = plugin_server("--plugin-grace-s", "1", "--plugin", f"kvd_probe_parent:{report} crash")

    def reports():
        return [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []

    try:
        wait_until(lambda: len(reports()) >= 3, timeout_s=30, what="3 starts of the crashing plugin")
        older = reports()[:-1]
        wait_until(lambda: all(dead(r["child"]) for r in older), timeout_s=10, what="the workers of earlier runs ended before or at the restart")
        assert srv.stop() == 0
        wait_until(lambda: all(dead(r["child"]) for r in reports()), timeout_s=10, what="every worker gone after the server's shutdown")
    finally:
        for r in reports():
            try:
                os.kill(r["child"], signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- refused at start-up -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, says",
    [
        ("kvd_no_such_plugin_module", "no module named kvd_no_such_plugin_module"),
        ("kvd_no_such_package.sub:--x 1", "cannot find module kvd_no_such_package.sub"),
        ("kvdepot.plugins", "kvdepot.plugins is a package without a __main__ module"),
        ("not-a-module:x", "is not a Python module name"),
        ("kvdepot.plugins.usage_log:'/tmp/x", "do not parse"),
    ],
)
def test_a_plugin_that_cannot_run_refuses_start_up(spec, says, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "server", "--port", "0", "--ipc-path", str(tmp_path / "s.ipc"), "--http-port", "0", "--plugin", spec],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert f"--plugin {spec!r}" in r.stderr and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_module_only_the_servers_working_directory_holds_refuses_start_up(tmp_path):
    """A server started as ``python -m kvdepot.cli`` (as ServerProcess starts it) has its working
    directory on sys.path; its plugins run with ``-P`` and do not. The start-up check looked the module
    up in the server's sys.path, passed, and the plugin then failed with "No module named" for ever,
    restarted again and again, instead of the server refusing to start as documented."""
    (tmp_path / "kvd_cwd_only_plugin.py").write_text("print('ran')\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdepot.cli", "server", "--port", "0", "--ipc-path", str(tmp_path / "s.ipc"), "--http-port", "0",
         "--l1-size-gb", "0.0625", "--plugin", "kvd_cwd_only_plugin"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the server started with a plugin it cannot run: {err[-2000:]}")
    assert proc.returncode == 2, err
    assert "--plugin 'kvd_cwd_only_plugin': no module named kvd_cwd_only_plugin" in err, err


# --- what a plugin may read ----------------------------------------------------------------------


def test_secrets_are_withheld_from_the_plugin_config():
    config = ServerConfig(
        http=HttpConfig(admin_token=TOKEN),
        storage=StorageConfig(
            l2=(
                "s3:bucket=kv,access_key_id=AK,secret_access_key=SK123,endpoint_url=http://minio:9000",
                '{"type": "peer", "secret": "PS456", "port": 31995}',
                "valkey:url=redis://user:VPW789@cache:6379/0,prefix=kv:",
            )
        ),
    )
    public = msgspec.json.encode(public_config(config)).decode()
    for secret in (TOKEN, "SK123", "PS456", "VPW789"):
        assert secret not in public, secret
    assert public_config(config).storage.l2[0] == f"s3:bucket=kv,access_key_id={WITHHELD},secret_access_key={WITHHELD},endpoint_url=http://minio:9000"
    assert json.loads(public_config(config).storage.l2[1]) == {"type": "peer", "secret": WITHHELD, "port": 31995}
    assert mask_tier_spec("valkey:url=redis://user:VPW789@cache:6379/0,prefix=kv:") == f"valkey:url=redis://user:{WITHHELD}@cache:6379/0,prefix=kv:"
    assert public_config(ServerConfig()).http.admin_token == ""  # no token: nothing to withhold
    assert mask_tier_spec("fs:path=/var/cache/kv,size_gb=10") == "fs:path=/var/cache/kv,size_gb=10"
    # A password in the URL's query (the Valkey client reads it there too), and an OTLP URL's userinfo.
    masked = mask_tier_spec("valkey:url=redis://cache:6379/0?password=QPW321&db=2,prefix=kv:")
    assert "QPW321" not in masked and "db=2" in masked and masked.startswith("valkey:url=redis://cache:6379/0?password=")
    from kvdepot.config import ObservabilityConfig

    otlp = ServerConfig(observability=ObservabilityConfig(otlp_endpoint="https://u:OTLP987@collector:4318/v1/traces"))
    assert "OTLP987" not in msgspec.json.encode(public_config(otlp)).decode()


def test_the_state_drawing_is_enforced():
    from kvdepot.server.plugins import Plugin, PluginState

    p = Plugin("probe", "probe", (), {})
    with pytest.raises(RuntimeError, match="stopped -> running is not a state change"):
        p._move(PluginState.RUNNING)  # never started: it cannot be running
    p._move(PluginState.STARTING)
    p._move(PluginState.RUNNING)
    with pytest.raises(RuntimeError, match="running -> starting"):
        p._move(PluginState.STARTING)  # a running plugin is not started twice
    p.signal(signal.SIGTERM)  # no process: only the state moves
    assert p.snapshot()["state"] == "stopping" and p.join(0.1)


def test_a_plugin_never_imports_from_the_servers_working_directory(tmp_path, monkeypatch):
    """``python -m`` put the working directory first on sys.path: a json.py there (another user's, in
    /tmp) ran inside every plugin as the server's user."""
    import os

    from kvdepot.server.plugins import Plugin

    marker = tmp_path / "shadow-ran"
    (tmp_path / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)
    p = Plugin("shadowed", "json.tool", (), dict(os.environ))
    proc = p._spawn()
    assert proc is not None
    assert proc.wait(60) != 7  # the real json.tool ran (it refuses an empty stdin), not the shadow
    assert not marker.exists()


def test_a_plugin_told_to_stop_before_its_thread_ran_is_never_started(monkeypatch):
    """A server closed right after it started (SIGTERM during start-up): the stop came while the
    plugin's thread had not yet run, found the plugin STOPPED and left it so, and the thread then
    started the process, which got no SIGTERM: the shutdown waited out the grace period to kill it."""
    import threading

    from kvdepot.server.plugins import Plugin, PluginState

    gate = threading.Event()
    real_run = Plugin._run

    def late_run(self):  # the thread runs a moment after start(): the stop gets in first
        gate.wait(5)
        real_run(self)

    monkeypatch.setattr(Plugin, "_run", late_run)
    plugin = Plugin("late", "http.server", ("0", "--bind", "127.0.0.1"), dict(os.environ))
    plugin.start()
    plugin.signal(signal.SIGTERM)  # what PluginSupervisor.stop() does first
    gate.set()
    stopped = plugin.join(1.0)
    snap = plugin.snapshot()
    if not stopped:  # end the process the stop missed
        plugin.signal(signal.SIGKILL)
        plugin.join(5.0)
    assert stopped, f"the plugin was started after it was told to stop: {snap}"
    assert snap["state"] == PluginState.STOPPED.value and snap["restarts"] == 0
