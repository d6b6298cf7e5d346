"""Runtime plugins: one child process per ``--plugin MODULE[:ARGS]``, kept running beside the server.

Each plugin runs as ``python -m MODULE ARGS`` (this server's interpreter) in a session of its own, with
the environment ``kvdepot.plugins`` documents: the server's config as JSON, secrets withheld; where to
reach it; its name. Its stdout and stderr go to the server's log, line by line, under its name.

One plugin's life (each state change is checked against this drawing; anything else is a bug)::

    STOPPED --start--> STARTING --spawned--> RUNNING --exited--> BACKOFF --delay over--> STARTING ...
                          |                     |                   |
                          +-- spawn failed -----)------> BACKOFF    |
                          +---------------------+-------------------+--stop--> STOPPING --> STOPPED

A plugin that exits is started again after a delay that doubles from 0.5 s up to 30 s, and falls back
to 0.5 s once a run lasted 60 s: a plugin that crashes at once costs a few starts a minute, not a busy
loop, and one that crashes once a day restarts at once. At shutdown every plugin's process group gets
SIGTERM, then SIGKILL after ``--plugin-grace-s``; that goes for every process of the group, also once the plugin
itself has ended (a worker it started that ignores SIGTERM is killed when the grace period is over). The
processes a crashed run left behind get SIGTERM when it ends and SIGKILL before the next run starts, so
they never pile up. A module that cannot be found at all is a ConfigError at start-up (checked with
``importlib.util.find_spec`` in a child started as the plugin is), never an endless restart loop.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec

from kvdepot.config import ADMIN_TOKEN_ENV, ServerConfig, split_plugin_spec
from kvdepot.errors import ConfigError
from kvdepot.plugins import CONFIG_ENV, HTTP_URL_ENV, NAME_ENV, RPC_URL_ENV, SERVER_PID_ENV, WITHHELD
from kvdepot.redact import mask_tier_spec, mask_url

log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0
HEALTHY_RUN_S = 60.0  # a run this long resets the delay
DELAYS_SHOWN = 8  # the last restart delays /status shows
MAX_LINE = 16 << 10  # a plugin's output line longer than this is logged in pieces

# Secrets the server may have read from its own environment: a plugin inherits the rest of it.
WITHHELD_ENV = (ADMIN_TOKEN_ENV, "KVDEPOT_PEER_SECRET")


class PluginState(str, enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    STOPPING = "stopping"


_S = PluginState
_MOVES: dict[PluginState, frozenset[PluginState]] = {
    _S.STOPPED: frozenset({_S.STARTING}),
    _S.STARTING: frozenset({_S.RUNNING, _S.BACKOFF, _S.STOPPING}),
    _S.RUNNING: frozenset({_S.BACKOFF, _S.STOPPING}),
    _S.BACKOFF: frozenset({_S.STARTING, _S.STOPPING}),
    _S.STOPPING: frozenset({_S.STOPPED}),
}


# --- what a plugin is given ----------------------------------------------------------------------


def public_config(config: ServerConfig) -> ServerConfig:
    """The configuration a plugin may read: the admin token and tier secrets withheld (a token that is
    set reads ``<withheld>``, so "is one set" is still answered)."""
    http = msgspec.structs.replace(config.http, admin_token=WITHHELD if config.http.admin_token else "")
    storage = msgspec.structs.replace(config.storage, l2=tuple(mask_tier_spec(s) for s in config.storage.l2))
    obs = config.observability
    observability = msgspec.structs.replace(obs, otlp_endpoint=mask_url(obs.otlp_endpoint)) if obs.otlp_endpoint else obs
    return msgspec.structs.replace(config, http=http, storage=storage, observability=observability)


def _reachable(host: str) -> str:
    """An address to connect to for a server bound to ``host`` (a wildcard means this machine)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def plugin_environment(config: ServerConfig, name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in WITHHELD_ENV}
    rpc, http = config.rpc, config.http
    env[CONFIG_ENV] = msgspec.json.encode(public_config(config)).decode()
    env[RPC_URL_ENV] = f"tcp://{_reachable(rpc.host)}:{rpc.port}" if rpc.port else f"ipc://{rpc.ipc_path}"
    env[HTTP_URL_ENV] = f"http://{_reachable(http.host)}:{http.port}" if http.port else ""
    env[NAME_ENV] = name
    env[SERVER_PID_ENV] = str(os.getpid())
    env["PYTHONUNBUFFERED"] = "1"  # its prints reach the log as they happen
    return env


# Run by check_module in a child started as the plugin will be (``-P``, its environment): the server's own
# sys.path differs (``python -m kvdepot.cli`` puts the working directory first, which ``-P`` leaves out).
_FIND_MODULE = """
import importlib.util, sys
module = sys.argv[1]
try:
    found = importlib.util.find_spec(module)
    main = importlib.util.find_spec(module + ".__main__") if found is not None and found.submodule_search_locations is not None else None
except Exception as exc:  # a parent package missing, or failing to import
    print(f"cannot find module {module}: {exc}")
else:
    if found is None:
        print(f"no module named {module}")
    elif found.submodule_search_locations is not None and main is None:
        print(f"{module} is a package without a __main__ module: nothing to run")
"""


def check_module(spec: str, module: str, env: dict[str, str] | None = None) -> None:
    """ConfigError unless ``python -P -m module``, in the plugin's environment, can find something to run."""
    try:
        r = subprocess.run(
            [sys.executable, "-P", "-c", _FIND_MODULE, module],
            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = f"cannot look up module {module}: {exc}"
    else:
        why = r.stdout.strip() or (f"cannot find module {module}: {(r.stderr.strip().splitlines() or ['?'])[-1]}" if r.returncode else "")
        if not why:
            return
    raise ConfigError(f"--plugin {spec!r}: {why} (looked up by {sys.executable}; is it installed, or on PYTHONPATH?)")


# --- one plugin ----------------------------------------------------------------------------------


class Plugin:
    """One plugin's process, restarted by its own thread until ``stop``."""

    def __init__(self, name: str, module: str, args: tuple[str, ...], env: dict[str, str]) -> None:
        self.name, self.module, self.args = name, module, args
        self._env = env
        self._lock = threading.Lock()
        self._wake = threading.Event()  # set by stop: a backoff wait ends at once
        self._state = PluginState.STOPPED
        self._proc: subprocess.Popen | None = None
        self._pgid = 0  # the process group of the latest run (its leader's pid): it may outlive the leader
        self._starts = 0
        self._last_exit: int | None = None
        self._delays: collections.deque[float] = collections.deque(maxlen=DELAYS_SHOWN)
        self._thread: threading.Thread | None = None

    def _move(self, to: PluginState) -> None:
        """Change state (lock held); a change the drawing does not allow is a bug."""
        if to not in _MOVES[self._state]:
            raise RuntimeError(f"plugin {self.name}: {self._state.value} -> {to.value} is not a state change a plugin makes")
        self._state = to

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"plugin-{self.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = FIRST_DELAY_S
        while True:
            with self._lock:
                # _wake is set by signal() only: told to stop while still STOPPED (before this thread's first
                # round), a plugin must not be started
                if self._state is PluginState.STOPPING or self._wake.is_set():
                    break
                self._move(PluginState.STARTING)
                self._signal_group(signal.SIGKILL)  # what the last run left, after its SIGTERM and the delay
                proc = self._spawn()
                self._move(PluginState.RUNNING if proc is not None else PluginState.BACKOFF)
            started = time.monotonic()
            code = self._wait(proc) if proc is not None else None
            ran = time.monotonic() - started
            with self._lock:
                self._proc = None
                self._last_exit = code
                if self._state is PluginState.STOPPING:
                    break
                if proc is not None:
                    self._move(PluginState.BACKOFF)
                    self._signal_group(signal.SIGTERM)  # the processes it started, if any outlived it
                if ran >= HEALTHY_RUN_S:
                    delay = FIRST_DELAY_S
                self._delays.append(delay)
            log.warning("plugin %s %s after %.1f s; starting it again in %.1f s", self.name, _exit_words(code), ran, delay)
            self._wake.wait(delay)
            delay = min(delay * 2, MAX_DELAY_S)
        with self._lock:
            if self._state is not PluginState.STOPPED:
                self._move(PluginState.STOPPED)

    def _spawn(self) -> subprocess.Popen | None:
        """Start the process (lock held, so ``stop`` never misses it); None if it could not be."""
        try:
            proc = subprocess.Popen(
                # -P: the working directory is not put on sys.path (a json.py there would run as the server)
                [sys.executable, "-P", "-m", self.module, *self.args],
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop reaches what it starts too
            )
        except OSError as exc:
            log.error("plugin %s: cannot start %s: %s", self.name, sys.executable, exc)
            return None
        self._proc = proc
        self._pgid = proc.pid  # start_new_session: the leader's pid names its group
        self._starts += 1
        log.info("plugin %s started (pid %d): python -m %s%s", self.name, proc.pid, self.module, "".join(f" {a}" for a in self.args))
        return proc

    def _wait(self, proc: subprocess.Popen) -> int:
        reader = threading.Thread(target=self._pump, args=(proc,), name=f"plugin-{self.name}-log", daemon=True)
        reader.start()
        code = proc.wait()
        reader.join(1.0)  # a grandchild may hold the pipe open: the log then goes on without us waiting
        return code

    def _pump(self, proc: subprocess.Popen) -> None:
        plog = logging.getLogger("kvdepot.plugin")  # the name is in each line
        assert proc.stdout is not None
        with proc.stdout:
            for raw in iter(lambda: proc.stdout.readline(MAX_LINE), b""):
                line = raw.decode(errors="replace").rstrip()
                if line:
                    plog.info("[%s] %s", self.name, line)

    def signal(self, sig: int) -> None:
        """``sig`` to the process group, if running; the first call also ends the restarting."""
        with self._lock:
            if self._state not in (PluginState.STOPPING, PluginState.STOPPED):
                self._move(PluginState.STOPPING)
            self._wake.set()
            self._signal_group(sig)

    def _signal_group(self, sig: int) -> None:
        """``sig`` to the latest run's process group (lock held) while its leader runs, or while processes
        it started still run after it: the group id is then still theirs (never another's reused pid)."""
        proc = self._proc
        if not self._pgid or ((proc is None or proc.returncode is not None) and not _group_runs(self._pgid)):
            return
        try:
            os.killpg(self._pgid, sig)
        except ProcessLookupError:
            pass

    def kill_now(self) -> None:
        """SIGKILL to the latest run's group, without the lock (from a signal handler on a thread that
        may hold it: the server's forced exit)."""
        self._signal_group(signal.SIGKILL)

    def lingering(self) -> bool:
        """Does a process of the latest run's group still run (the plugin, or one it started)?"""
        with self._lock:
            return bool(self._pgid) and _group_runs(self._pgid)

    def join(self, timeout_s: float) -> bool:
        if self._thread is not None:
            self._thread.join(max(0.0, timeout_s))
            return not self._thread.is_alive()
        return True

    def snapshot(self) -> dict:
        with self._lock:
            proc = self._proc
            return {
                "name": self.name,
                "module": self.module,
                "state": self._state.value,
                "pid": proc.pid if proc is not None and self._state is not PluginState.BACKOFF else 0,
                "restarts": max(0, self._starts - 1),
                "last_exit_code": self._last_exit,
                "restart_delays_s": list(self._delays),
            }


def _group_runs(pgid: int) -> bool:
    """Is a process of group ``pgid`` running (zombies, which run no more, do not count)? Read from /proc."""
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid).encode() and fields[0] != b"Z":
            return True
    return False


def _exit_words(code: int | None) -> str:
    if code is None:
        return "could not be started"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"was killed by signal {-code}"
    return f"exited with code {code}"


# --- all of them ---------------------------------------------------------------------------------


class PluginSupervisor:
    """The plugins of one server. Built with the server (a missing module fails then, before any port
    or memory is taken); ``start`` once the server serves; ``stop`` first when it closes."""

    def __init__(self, config: ServerConfig) -> None:
        self._grace_s = config.plugins.grace_s
        self.plugins: list[Plugin] = []
        counts: collections.Counter[str] = collections.Counter()
        for spec in config.plugins.specs:
            module, args = split_plugin_spec(spec)  # PluginConfig checked the syntax
            counts[module] += 1
            name = module if counts[module] == 1 else f"{module}#{counts[module]}"  # the same module twice
            env = plugin_environment(config, name)
            check_module(spec, module, env)
            self.plugins.append(Plugin(name, module, args, env))

    def start(self) -> None:
        for p in self.plugins:
            p.start()

    def stop(self) -> None:
        """SIGTERM to every plugin, SIGKILL to those still running after the grace period; returns
        once every process has been reaped."""
        if not self.plugins:
            return
        for p in self.plugins:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        for p in self.plugins:
            if not p.join(deadline - time.monotonic()):
                log.warning("plugin %s did not stop within %.1f s of SIGTERM: killing it", p.name, self._grace_s)
                p.signal(signal.SIGKILL)
                p.join(5.0)
            # The plugin ended; processes it started, in its group, may not have (they ignore SIGTERM).
            while p.lingering() and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.lingering():
                log.warning("plugin %s: processes it started still ran %.1f s after SIGTERM: killing them", p.name, self._grace_s)
                p.signal(signal.SIGKILL)

    def kill_now(self) -> None:
        """Every plugin's processes killed at once (the server exits without closing)."""
        for p in self.plugins:
            p.kill_now()

    def snapshot(self) -> list[dict]:
        return [p.snapshot() for p in self.plugins]
