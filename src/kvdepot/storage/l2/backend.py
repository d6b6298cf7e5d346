"""``BackendAdapter``: the L2 adapter contract (``contract.py``) kept over five blocking primitives.

A backend implements ``_put``, ``_get_into``, ``_contains``, ``_delete`` and ``_clear`` (and optionally
``_usage``, ``_flush``, ``_close_backend``); this class runs them on a small thread pool, signals each
result through the eventfd, pins looked-up keys against the backend's own eviction, checks every load's
envelope (a corrupt object is deleted, counted and a miss), counts what it did, and guards the backend
with a ``CircuitBreaker``: after a failure, tasks fail fast until a probe gets through. A backend that
can tell (``_probe``) is also asked on its own, at start and then every retry interval in which no task
got an answer from it: a tier whose backend is not there is down at start, one that dies while the
server idles is down within an interval, and one that comes back is up again, with no request to find out.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from kvdepot.breaker import CircuitBreaker
from kvdepot.events import TierCleared, TierRemoved, TierStored, TierTaskDone
from kvdepot.redact import WITHHELD
from kvdepot.storage.l2.contract import L2Usage, LookupHints, TaskId, TaskKind, TaskResult, TierServices
from kvdepot.storage.l2.envelope import CorruptObject, DestinationMismatch, NewerFormat, RejectedObject
from kvdepot.types import ObjectKey, leading_run

log = logging.getLogger(__name__)

USAGE_WAIT_S = 0.5  # the longest usage() waits for a backend's answer
USAGE_FAILURE_LOG_S = 60.0  # a usage query that keeps failing is logged once a minute (/status asks often)


class _PartlyDone(Exception):
    """A task whose backend failed after part of the work was done: ``value`` says which part."""

    def __init__(self, value: Any, cause: Exception) -> None:
        super().__init__(str(cause))
        self.value = value
        self.cause = cause


FLAP_WINDOW_S = 60.0


class _FlapDamper:
    """Whether a tier's "failed" and "recovered" lines are worth saying. A tier whose reads work and
    whose writes fail (a filesystem remounted read-only, a bucket gone, a key rotated to read-only)
    recovers at every probe and fails at the next store: said each time, that was a warning and an
    info line every retry interval for as long as it lasted. The same error within ``FLAP_WINDOW_S``
    of its last warning is said at debug, and counted in the next warning."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._error = ""
        self._at = -math.inf
        self._hushed = 0  # failures of that error not said since

    def down(self, error: str) -> tuple[bool, int]:
        """(say it, how many times it failed so, unsaid, since the last warning)."""
        with self._lock:
            now = self._clock()
            if error == self._error and now - self._at < FLAP_WINDOW_S:
                self._hushed += 1
                return False, 0
            again, self._error, self._at, self._hushed = self._hushed, error, now, 0
            return True, again

    def up(self) -> bool:
        """Say the recovery? Not while its failure was hushed: the pair is one flap."""
        with self._lock:
            return self._hushed == 0

    def still_down(self, error: str) -> tuple[bool, int]:
        """A failure while the tier is down already (a probe that failed): (say it, how many failures
        went unsaid). Said once a window has passed with a failure hushed: one hushed as a flap may have
        been the start of an outage, and the last line said was then "recovered" for as long as it lasted."""
        with self._lock:
            now = self._clock()
            if not self._hushed or now - self._at < FLAP_WINDOW_S:
                return False, 0
            again, self._error, self._at, self._hushed = self._hushed, error, now, 0
            return True, again


class BackendAdapter(ABC):
    """Runs the blocking backend primitives on a small thread pool and keeps the contract (``contract.py``)."""

    kind = "abstract"

    def __init__(self, name: str, workers: int = 2, retry_interval_s: float = 2.0, services: TierServices | None = None) -> None:
        self.name = name
        self.services = services or TierServices()
        self._workers = workers
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._done: deque[TaskResult] = deque()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._pool: ThreadPoolExecutor | None = None
        self._closing = False  # close() began: the pool refuses tasks because it is shut down
        self._breaker = CircuitBreaker(retry_interval_s)
        self._retry_interval_s = retry_interval_s
        self._answered_at = -math.inf  # when the backend last answered a task or a probe (monotonic)
        self._down_by_probe = False  # the tier is down because a probe failed (not a task): a probe may bring it back
        self._probe_future: Future | None = None
        self._stop_probing = threading.Event()
        self._prober: threading.Thread | None = None
        self._said = _FlapDamper()  # the down/recovered lines of a tier that flaps with one error
        self._stats = {"stored": 0, "loaded": 0, "corrupt": 0, "failures": 0, "newer_format": 0}
        self._newer_format_said = False
        self._pins: dict[ObjectKey, int] = {}
        self._usage_cache: tuple[int, int, int] = (0, 0, 0)
        # Keys with a store submitted and not finished, and when those of them were last deleted: a write
        # submitted before that delete must not bring back what it removed (``_store_all``), and one
        # submitted after it (the same key stored again) must land. Stamps count submissions of stores,
        # deletes and clears; a delete's or clear's stamp (its cutoff) is taken when it is submitted.
        self._writing: dict[ObjectKey, int] = {}
        self._deleted_at: dict[ObjectKey, int] = {}
        self._stamp = 0
        # Deletes and clears submitted and not finished: cutoff stamp -> their keys (None: a clear). A
        # store submitted after one waits for it before writing (``_await_barriers``), so the delete never
        # removes a write that came after it. Stamps are taken and tasks queued under ``_order``, so the
        # pool (FIFO) starts them in stamp order: the awaited task has started, and the wait cannot deadlock.
        self._barriers: dict[int, frozenset[ObjectKey] | None] = {}
        self._barrier_lifted = threading.Condition(self._lock)
        self._order = threading.Lock()
        self._usage_failure_logged = -1e9
        self._no_thread_logged = -1e9  # when a task that found no worker thread was last logged
        self._usage_future: Future | None = None
        self._announce_lock = threading.Lock()  # TierStored and TierCleared take turns (see _announce_stored)
        self._clear_epoch = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self._breaker!r})"

    # --- the contract --------------------------------------------------------------------------------

    @property
    def eventfd(self) -> int:
        return self._efd

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=f"kvdepot-l2-{self.name}")
        if type(self)._probe is not BackendAdapter._probe:
            self._prober = threading.Thread(target=self._probe_loop, name=f"kvdepot-l2-{self.name}-probe", daemon=True)
            self._prober.start()

    def submit_store(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> TaskId:
        """Store these objects. A delete of one of them, or a clear, that comes after this call and
        before its write ends is not undone by the write: the object does not stay (see ``_store_all``)."""
        items = list(items)
        with self._order:
            with self._lock:
                epoch = self._clear_epoch  # now: a clear submitted from now on voids this write
                self._stamp += 1
                stamp = self._stamp  # a delete submitted from now on voids this write; one submitted before does not
                for key, _ in items:
                    self._writing[key] = self._writing.get(key, 0) + 1

            def store() -> list[bool]:
                try:
                    self._await_barriers([key for key, _ in items], stamp)
                    return self._store_all(items, epoch, stamp)
                finally:
                    self._done_writing(items)

            return self._submit(TaskKind.STORE, store, [False] * len(items), skipped=lambda: self._done_writing(items))

    def submit_lookup_and_lock(self, keys: Sequence[ObjectKey], hints: LookupHints | None = None) -> TaskId:
        keys = list(keys)
        return self._submit(TaskKind.LOOKUP, lambda: self._lookup_and_pin(keys, hints), 0)

    def submit_load(self, keys: Sequence[ObjectKey], dests: Sequence[memoryview]) -> TaskId:
        pairs = list(zip(keys, dests, strict=True))
        return self._submit(TaskKind.LOAD, lambda: self._load_all(pairs), [False] * len(pairs))

    def submit_unlock(self, keys: Sequence[ObjectKey]) -> TaskId:
        keys = list(keys)
        return self._submit(TaskKind.UNLOCK, lambda: self._unpin(keys), None, always=True)

    def submit_clear(self) -> TaskId:
        """Remove every object of this tier (its prefix or directory: never anything else) that a store
        submitted before this call wrote; a store submitted after it lands once the clear has run."""
        with self._order:
            with self._lock:
                cutoff = self._raise_barrier(None)
                self._clear_epoch += 1  # now, not when the clear runs: writes submitted before are void
            return self._submit(TaskKind.CLEAR, self._lifting(cutoff, self._clear_counted), 0, skipped=lambda: self._lift(cutoff))

    def submit_delete(self, keys: Sequence[ObjectKey]) -> TaskId:
        """Remove these objects (an operator's DELETE of a prefix) as stored before this call: a store of
        one of them submitted after it lands, however the two tasks run. A load already reading one either
        got it whole or gets a miss: every backend's delete is atomic against its reads."""
        keys = list(keys)
        with self._order:
            with self._lock:
                cutoff = self._raise_barrier(frozenset(keys))
                # The writes in flight now were submitted before this delete: they must not bring it back.
                self._deleted_at.update((k, cutoff) for k in keys if k in self._writing)
            work = self._lifting(cutoff, lambda: self._delete_present(keys))
            return self._submit(TaskKind.DELETE, work, 0, skipped=lambda: self._lift(cutoff))

    def completed(self) -> list[TaskResult]:
        if self._efd < 0:
            return []  # closed
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._lock:
            out = list(self._done)
            self._done.clear()
        return out

    def usage(self) -> L2Usage:
        """Asks the backend on the adapter's own threads and waits at most ``USAGE_WAIT_S``: a hung
        backend cannot stall whoever asks (``/status``); it then gets the last figures known, and no
        second query is queued behind the stuck one."""
        used, capacity, objects = self._current_usage()
        with self._lock:
            stats = dict(self._stats)
        up, error = self.health()
        return L2Usage(
            self.name,
            self.kind,
            up,
            used,
            capacity,
            objects,
            stats["stored"],
            stats["loaded"],
            stats["corrupt"],
            stats["failures"],
            error,
            self._details(),
            stats["newer_format"],
        )

    def health(self) -> tuple[bool, str]:
        """(up, last error) as the circuit breaker knows them, or why the tier cannot do its job while
        its tasks still succeed (``_degraded``): asks no backend (``/healthcheck``)."""
        up, error = self._breaker.up, self._breaker.last_error
        if up:
            degraded = self._degraded()
            if degraded:
                return False, degraded
        return up, error

    def _current_usage(self) -> tuple[int, int, int]:
        if self._pool is None:
            try:
                return self._usage()
            except Exception:
                return self._usage_cache
        with self._lock:
            fut = self._usage_future
            if fut is None or fut.done():
                try:
                    fut = self._usage_future = self._pool.submit(self._usage)
                except RuntimeError:  # shutting down
                    return self._usage_cache
        try:
            figures = fut.result(timeout=USAGE_WAIT_S)
        except FutureTimeout:
            return self._usage_cache
        except Exception as exc:
            # Not a reason to take the tier down: a backend may refuse only this query (an account
            # without INFO or ListBucket) and serve objects fine; a dead one fails its next task anyway.
            now = time.monotonic()
            if now - self._usage_failure_logged >= USAGE_FAILURE_LOG_S:
                self._usage_failure_logged = now
                log.warning("L2 %s (%s) cannot report its usage (the figures shown are the last known): %s",
                            self.name, self.kind, self._error_text(exc))  # fmt: skip
            return self._usage_cache
        self._usage_cache = figures
        return figures

    def close(self) -> None:
        self._closing = True
        self._stop_probing.set()
        if self._prober is not None:
            self._prober.join()
            self._prober = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._close_backend()
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1

    # --- backend primitives (blocking; any exception counts as a backend failure) --------------------

    @abstractmethod
    def _put(self, key: ObjectKey, payload: memoryview) -> None:
        """Store one object atomically: after a failure or crash, it is absent or whole."""

    @abstractmethod
    def _get_into(self, key: ObjectKey, dest: memoryview) -> bool:
        """Copy the object's payload into ``dest``; False if absent; CorruptObject if bad."""

    @abstractmethod
    def _contains(self, keys: list[ObjectKey]) -> list[bool]:
        """Presence of each key."""

    def _contains_hinted(self, keys: list[ObjectKey], hints: LookupHints | None) -> list[bool]:
        """Presence of each key for a lookup with ``hints`` (a tier that can use them overrides this)."""
        return self._contains(keys)

    @abstractmethod
    def _delete(self, key: ObjectKey) -> None:
        """Remove one object (absent is fine)."""

    @abstractmethod
    def _clear(self) -> int:
        """Remove every object of this tier; returns how many there were (as far as it can tell)."""

    def _usage(self) -> tuple[int, int, int]:
        """(used bytes, capacity bytes or 0, objects); backends override where they can tell."""
        return 0, 0, 0

    def _close_backend(self) -> None:
        pass

    def _degraded(self) -> str:
        """Why the tier cannot do its job although its backend answers ('' when it can): reported as
        down, without failing its tasks (the peer tier cut off from its cluster still serves its own
        pages). Quick, from memory: read on the asking thread."""
        return ""

    def _probe(self) -> None:
        """Raise unless the backend answers, with a request its least-privileged account may make (or
        whose refusal, permission denied, still proves it is there). Backends that can tell override
        this; without it a tier is known down only when a task fails."""

    def _details(self) -> dict[str, Any] | None:
        """Kind-specific state for ``/status`` (quick: read on the asking thread)."""
        return None

    def _flush(self) -> None:
        """End of a store batch, delete or clear, on the worker thread that ran it: make it durable (fs
        syncs the directories its renames and unlinks touched once per task rather than once per object)."""

    def _on_pin_change(self) -> None:
        """Hook for adapters whose eviction must respect pins."""

    # --- the blocking primitives, for an owner that runs its own threads ------------------------------
    # (the peer tier's disk writes through and promotes on its own threads; the task machinery above
    # is for the storage manager)

    def put_now(self, key: ObjectKey, payload: memoryview) -> None:
        self._put(key, payload)
        self._flush()

    def get_now(self, key: ObjectKey, dest: memoryview) -> bool:
        """The object's payload into ``dest``; False when absent; CorruptObject (deleted) when bad."""
        try:
            return self._get_into(key, dest)
        except NewerFormat as exc:
            self._newer_format(key, exc)
            return False
        except CorruptObject:
            self._count("corrupt")
            self._delete(key)
            self._tell_removed((key,), "corrupt")
            raise

    def _newer_format(self, key: ObjectKey, exc: NewerFormat) -> None:
        """A newer kvdepot's object: a miss, left in place; counted, and said once."""
        self._count("newer_format")
        if not self._newer_format_said:
            self._newer_format_said = True
            log.warning("L2 %s: object %s is in a newer kvdepot's format (%s): a miss, left for the servers that read it "
                        "(counted as newer_format; upgrade this server)", self.name, key.hex()[:16], exc)  # fmt: skip

    def _tell_removed(self, keys: Sequence[ObjectKey], because: str) -> None:
        """Objects that left this tier through kvdepot (its own LRU, a corrupt read): KV events, metrics."""
        if keys:
            self.services.sink.publish(TierRemoved(self.name, self.kind, tuple(keys), because))

    def contains_now(self, keys: list[ObjectKey]) -> list[bool]:
        return self._contains(keys)

    def delete_now(self, key: ObjectKey) -> None:
        self._delete(key)
        self._flush()

    def is_pinned(self, key: ObjectKey) -> bool:
        with self._lock:
            return key in self._pins

    # --- machinery -----------------------------------------------------------------------------------

    def _submit(self, kind: TaskKind, work: Callable[[], Any], miss: Any, always: bool = False,
                skipped: Callable[[], None] | None = None) -> TaskId:  # fmt: skip
        """``skipped``: called when ``work`` will never run (the tier is down, or not started)."""
        task_id = next(self._ids)
        if self._pool is None:
            if skipped is not None:
                skipped()
            raise RuntimeError(f"L2 adapter {self.name} is not started")
        if not always and not self._breaker.admit():
            if skipped is not None:
                skipped()
            self._finish(TaskResult(task_id, kind, miss, ok=False, error=f"{self.name} is down: {self._breaker.last_error}"))
            return task_id
        turn = threading.Lock()  # taken once: by the worker that runs the task, or by its withdrawal

        def run() -> None:
            if turn.acquire(blocking=False):
                self._run(task_id, kind, work, miss)

        try:
            self._pool.submit(run)
        except RuntimeError as exc:
            # Shut down meanwhile, or a worker thread that could not start (no memory for its stack, the
            # process's thread limit): the pool queued the task before it tried, and an idle worker would
            # run it later, after its caller was told it failed. It is withdrawn: it fails now, and only now.
            if not turn.acquire(blocking=False):
                return task_id  # a worker took it meanwhile: it runs, and answers
            if skipped is not None:
                skipped()
            if self._closing:
                raise
            now = time.monotonic()
            if now - self._no_thread_logged >= USAGE_FAILURE_LOG_S:  # a host short of memory fails many in a row
                self._no_thread_logged = now
                log.warning("L2 %s (%s): a %s task failed: no worker thread could be started for it (%s)",
                            self.name, self.kind, kind.name.lower(), exc)  # fmt: skip
            self._finish(TaskResult(task_id, kind, miss, ok=False, error=f"no worker thread could be started: {exc}"))
        return task_id

    def _done_writing(self, items: list[tuple[ObjectKey, memoryview]]) -> None:
        with self._lock:
            for key, _ in items:
                left = self._writing.get(key, 0) - 1
                if left > 0:
                    self._writing[key] = left
                else:
                    self._writing.pop(key, None)
                    self._deleted_at.pop(key, None)

    def _raise_barrier(self, keys: frozenset[ObjectKey] | None) -> int:
        """Under ``_lock``: a new stamp, the cutoff of a delete (``keys``) or clear (None) submitted now."""
        self._stamp += 1
        self._barriers[self._stamp] = keys
        return self._stamp

    def _lift(self, cutoff: int) -> None:
        """The delete or clear of ``cutoff`` is over (done, failed or never run): stores behind it go on."""
        with self._barrier_lifted:
            self._barriers.pop(cutoff, None)
            self._barrier_lifted.notify_all()

    def _lifting(self, cutoff: int, work: Callable[[], int]) -> Callable[[], int]:
        def run() -> int:
            try:
                return work()
            finally:
                self._lift(cutoff)

        return run

    def _await_barriers(self, keys: list[ObjectKey], stamp: int) -> None:
        """Wait until no delete (of one of ``keys``) or clear submitted before the store of ``stamp`` is
        still running: it would remove the newer write. It started before this store (see ``_order``)."""
        wanted = frozenset(keys)

        def blocked() -> bool:
            return any(c < stamp and (ks is None or not ks.isdisjoint(wanted)) for c, ks in self._barriers.items())

        with self._barrier_lifted:
            self._barrier_lifted.wait_for(lambda: not blocked())

    def _void(self, key: ObjectKey, epoch: int, stamp: int) -> bool:
        """Was ``key`` deleted, or the tier cleared, since its store was submitted (at ``epoch`` and
        ``stamp``)? A delete before the submission does not count: that store is the key's newer write."""
        with self._lock:
            return self._deleted_at.get(key, 0) > stamp or epoch != self._clear_epoch

    def _run(self, task_id: TaskId, kind: TaskKind, work: Callable[[], Any], miss: Any) -> None:
        started = time.monotonic()
        try:
            value = work()
        except _PartlyDone as part:  # the backend failed midway: report what did get done
            self._timed(kind, started, ok=False)
            self._mark_down(part.cause)
            self._finish(TaskResult(task_id, kind, part.value, ok=False, error=self._error_text(part.cause)))
            return
        except Exception as exc:
            self._timed(kind, started, ok=False)
            self._mark_down(exc)
            self._finish(TaskResult(task_id, kind, miss, ok=False, error=self._error_text(exc)))
            return
        self._timed(kind, started, ok=True)
        if kind is not TaskKind.UNLOCK:  # an unlock never touches the backend: it proves nothing
            self._answered_at = time.monotonic()
            self._mark_up()
        self._finish(TaskResult(task_id, kind, value))

    def _timed(self, kind: TaskKind, started: float, ok: bool) -> None:
        """Each task's time against the backend, for the per-tier latency metrics (an unlock has none)."""
        if kind is not TaskKind.UNLOCK:
            self.services.sink.publish(TierTaskDone(self.name, self.kind, kind.name.lower(), time.monotonic() - started, ok))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def _finish(self, result: TaskResult) -> None:
        with self._lock:
            self._done.append(result)
        try:
            os.eventfd_write(self._efd, 1)
        except OSError:
            pass  # closed during shutdown

    def _withheld(self) -> tuple[str, ...]:
        """Secrets of this tier's configuration that a backend's error may quote (a password written into
        an endpoint URL: botocore names the URL it could not reach). Adapters that have some say so."""
        return ()

    def _error_text(self, exc: BaseException) -> str:
        """``exc`` as the tier reports it (task results, ``last_error`` in /status, the log), its
        configuration's secrets withheld."""
        text = f"{type(exc).__name__}: {exc}"
        for secret in self._withheld():
            if secret:
                text = text.replace(secret, WITHHELD)
        return text

    def _probe_loop(self) -> None:
        """Probe at once (what an operator reads right after start), then every retry interval in which
        no task had an answer (a busy tier is proven by its tasks). While the tier is down the probe is
        the breaker's one call per interval, so the tier comes back with no request to try it; one probe
        at a time, on the pool's threads, so a hung backend holds one worker, as a task would."""
        wait = 0.0
        while not self._stop_probing.wait(wait):
            wait = self._retry_interval_s
            if self._breaker.up and time.monotonic() - self._answered_at < self._retry_interval_s:
                continue
            if not self._breaker.up and not self._down_by_probe:
                continue  # a task failed: a task must succeed to bring it back (see _probe_once)
            fut = self._probe_future
            if (fut is not None and not fut.done()) or not self._breaker.admit():
                continue
            try:
                self._probe_future = self._pool.submit(self._probe_once) if self._pool is not None else None
            except RuntimeError:  # shut down meanwhile, or no worker thread: the next round tries again
                continue

    def _probe_once(self) -> None:
        try:
            self._probe()
        except Exception as exc:
            self._mark_down(exc, counted=False)  # not a failed task: ``failures`` counts those
            self._down_by_probe = True
            return
        self._answered_at = time.monotonic()
        # Only a probe's failure is undone by a probe. A task that failed where the probe answers (a
        # Valkey at maxmemory refusing writes, a cluster of other nodes' keys) stays down until a task
        # succeeds: brought up by the probe, the tier flapped, each time failing the tasks let through.
        if self._breaker.up or self._down_by_probe:
            self._mark_up()

    def _mark_down(self, exc: Exception, counted: bool = True) -> None:
        if counted:
            self._count("failures")
            self._down_by_probe = False
        error = self._error_text(exc)
        if self._breaker.failed(error):
            say, again = self._said.down(error)
            more = f" (it recovered and failed so {again} more times since this was last said)" if again else ""
            log.log(logging.WARNING if say else logging.DEBUG, "L2 %s (%s) failed, serving from L1 only until it recovers: %s%s",
                    self.name, self.kind, error, more)  # fmt: skip
        else:
            say, again = self._said.still_down(error)
            if say:
                log.warning("L2 %s (%s) is still failing, serving from L1 only until it recovers: %s (it recovered and failed "
                            "%d more times since this was last said)", self.name, self.kind, error, again)  # fmt: skip

    def _mark_up(self) -> None:
        if self._breaker.succeeded():
            log.log(logging.INFO if self._said.up() else logging.DEBUG, "L2 %s (%s) recovered", self.name, self.kind)

    @property
    def _healthy(self) -> bool:
        """For the adapters' own status calls: never ask a backend that is down."""
        return self._breaker.up

    def _store_all(self, items: list[tuple[ObjectKey, memoryview]], epoch: int | None = None, stamp: int | None = None) -> list[bool]:
        """Per-key outcome, counted once it is durable. A rejected object fails alone; when the backend
        fails midway, the objects stored before are still reported (and counted) as stored, so the
        tier's count and its store controller's always agree.

        An object whose delete (an operator's DELETE of its prefix) or clear was submitted after its
        store was (``stamp`` and ``epoch``: the counts then) is not written, or, when that came during its write, deleted
        again right after: the delete ran before the write existed and found nothing, and the write
        would otherwise bring the deleted KV back for every later lookup. A store submitted after the
        delete is the key stored again, and lands (after the delete has run): the guard is per write, not per key. When such a
        newer write lands before the voided one deletes itself, the key is a miss until stored again,
        never the deleted bytes."""
        with self._lock:
            epoch = self._clear_epoch if epoch is None else epoch
            stamp = self._stamp if stamp is None else stamp
        out: list[bool] = []
        failure: Exception | None = None
        for key, payload in items:
            if self._void(key, epoch, stamp):
                out.append(False)
                continue
            try:
                self._put(key, payload)
            except RejectedObject as exc:
                log.info("L2 %s refused %s: %s", self.name, key.hex()[:16], self._error_text(exc))
                out.append(False)
                continue
            except Exception as exc:
                failure = exc
                if self._void(key, epoch, stamp):
                    # The write may have landed before the failure (the reply to a commit lost, a PUT whose
                    # answer timed out): a delete or clear since its submission must not be undone by it.
                    try:
                        self._delete(key)
                    except Exception:
                        pass
                break
            if self._void(key, epoch, stamp):
                try:
                    self._delete(key)
                except Exception as exc:
                    failure = exc
                    out.append(False)
                    break
                out.append(False)
                continue
            out.append(True)
        out += [False] * (len(items) - len(out))
        try:
            self._flush()  # before any result is reported: a stored object is durable when acknowledged
        except Exception as exc:
            out = [False] * len(items)  # durable is unknown: report none of them
            failure = failure or exc
        self._count("stored", sum(out))
        self._announce_stored([key for (key, _), ok in zip(items, out) if ok], epoch)
        if failure is not None:
            raise _PartlyDone(out, failure)
        return out

    def _announce_stored(self, keys: list[ObjectKey], epoch: int) -> None:
        """Objects now durable here (flushed): KV events, metrics. Announcements and clears take turns
        (``_announce_lock``), so a store is never announced before a clear that wiped it: a batch that
        began before a clear announces only what is still there. A tier that evicts on its own filters
        under the lock its evictions take (``_still_here``), so a store is never announced after the
        removal of the same object either."""
        if not keys:
            return
        with self._announce_lock, self._eviction_lock():
            keys = self._still_here(keys, recheck=epoch != self._clear_epoch)
            if keys:
                self.services.sink.publish(TierStored(self.name, self.kind, tuple(keys)))

    def _eviction_lock(self) -> AbstractContextManager:
        """The lock a tier that evicts on its own holds while it evicts (and announces the removal)."""
        return nullcontext()

    def _still_here(self, keys: list[ObjectKey], recheck: bool) -> list[ObjectKey]:
        if not recheck:
            return keys
        try:
            return [k for k, here in zip(keys, self._contains(keys)) if here]
        except Exception:
            return []  # unknown: announce nothing (a router then learns of them by a hit it did not expect)

    def _clear_counted(self) -> int:
        # The epoch moved when the clear was submitted: a write from before it that ends meanwhile deletes itself.
        with self._announce_lock:
            n = self._clear()
            self._flush()  # durable before it is reported: a cleared object must not come back
            self.services.sink.publish(TierCleared(self.name, self.kind))
        log.info("L2 %s (%s) cleared: %d objects", self.name, self.kind, n)
        return n

    def _delete_present(self, keys: list[ObjectKey]) -> int:
        # The cutoff was taken at submission (``submit_delete``); later stores of these keys wait for this.
        present = [k for k, there in zip(keys, self._contains(keys)) if there]
        # In turns with announcements (as a clear is): routers are told what went, after any store of it.
        with self._announce_lock:
            gone = []
            try:
                for key in present:
                    self._delete(key)
                    gone.append(key)
                self._flush()  # durable before it is reported: a deleted object must not come back
            finally:
                self._tell_removed(gone, "deleted")  # KV events: an announced block that went must not stay
        return len(present)

    def _lookup_and_pin(self, keys: list[ObjectKey], hints: LookupHints | None = None) -> int:
        # Pin first, then look: an object seen present can no longer be evicted before its load.
        with self._lock:
            for key in keys:
                self._pins[key] = self._pins.get(key, 0) + 1
        try:
            present = self._contains_hinted(keys, hints)
        except BaseException:
            self._unpin(keys)
            raise
        n = leading_run(present)
        self._unpin(keys[n:])
        return n

    def _unpin(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                count = self._pins.get(key, 0) - 1
                if count > 0:
                    self._pins[key] = count
                else:
                    self._pins.pop(key, None)
        self._on_pin_change()

    def _load_all(self, pairs: list[tuple[ObjectKey, memoryview]]) -> list[bool]:
        out = []
        for key, dest in pairs:
            try:
                ok = self._get_into(key, dest)
            except DestinationMismatch as exc:
                log.error("L2 %s: load of %s into a wrong-sized buffer: %s", self.name, key.hex()[:16], exc)
                ok = False
            except NewerFormat as exc:
                self._newer_format(key, exc)
                ok = False
            except CorruptObject as exc:
                self._count("corrupt")
                log.warning("L2 %s: corrupt object %s (%s): deleted, counted as a miss", self.name, key.hex()[:16], exc)
                try:
                    self._delete(key)
                    self._tell_removed((key,), "corrupt")
                except Exception:
                    pass
                ok = False
            if ok:
                self._count("loaded")
            out.append(ok)
        return out
