"""The engine thread: the only thread that touches the Session (and so the Engine).

Other threads hand it work with :meth:`EngineWorker.submit` and wait on the returned
``concurrent.futures.Future``. The thread loops::

    run every queued command            (at a token boundary: between two Generation.step() calls)
    if a generation is running: step it (one token)
    elif an idle-only command waits: run the oldest one
    else: sleep until something is submitted

So a command (a state operation, an urgent observation, a cancel) waits at most one decode step,
while ``when_idle`` commands (normal-priority observations) run in order once the running generation
has finished and never interleave with it. A future cancelled before its command starts (e.g. a
caller that timed out) is skipped, so a timed-out request never changes state later.

**Holds** (:meth:`hold`, used by live bag replay): a hold ``(request_id, position)`` stops generation
``request_id`` at that stream position until one command has run there, and keeps every command that
arrives earlier waiting for it, so a replayed operation runs at exactly its recorded token boundary.
``passive`` commands (diagnostics) neither wait for nor serve a hold. A hold is dropped once its request
ends or passes the position, or after ``hold_timeout_s`` of wall time at it without a command (logged), however
often the thread wakes meanwhile. Holds on requests that have not started yet expire together once the thread
has had nothing to do (no generation, no command but passive ones) for ``hold_timeout_s`` (a replay that stopped,
or an id that never runs; logged).
At most ``max_holds`` are kept: a :meth:`hold` past that is refused whole (``BUDGET_EXCEEDED``). Per decode step
the thread looks only at the running request's own holds (a dict lookup and the smallest position).
No ROS and no tensor code here.
"""
import logging
import threading
import time
from bisect import insort
from collections import deque
from concurrent.futures import Future
from typing import Callable, TypeVar

from flashrt_ros.runtime import ErrorCode, FlashRTError
from flashrt_ros.session import CANCELED, ERROR, Session

T = TypeVar("T")
_log = logging.getLogger(__name__)
HOLD_TIMEOUT_S = 30.0
MAX_HOLDS = 10_000  # far more than a replay places (one per operation made mid-generation)


class EngineWorker:
    def __init__(self, session: Session, name: str = "flashrt-engine", hold_timeout_s: float = HOLD_TIMEOUT_S,
                 max_holds: int = MAX_HOLDS):
        self._session = session
        self._cv = threading.Condition()
        self._commands: deque = deque()
        self._idle_commands: deque = deque()
        self._holds: dict[int, list[int]] = {}  # request_id -> sorted positions, one entry per command to run there
        self._hold_count = 0
        self._max_holds = max_holds
        self._hold_timeout_s = hold_timeout_s
        self._held: tuple | None = None  # (request_id, position) the thread waits at, and since when (monotonic)
        self._held_since = 0.0
        self._idle_since: float | None = None  # since when the thread has had nothing but passive commands
        self._holds_checked_at = 0  # Session.last_request_id when finished requests' holds were last dropped
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Session], T], when_idle: bool = False, passive: bool = False) -> "Future[T]":
        """Run ``fn(session)`` on the engine thread; ``when_idle`` waits for no running generation;
        ``passive`` (reads only) neither waits for nor serves a hold."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                future.set_exception(FlashRTError(ErrorCode.NOT_ACTIVE, "engine worker is shut down"))
                return future
            (self._idle_commands if when_idle else self._commands).append((fn, future, passive))
            self._cv.notify()
        return future

    def hold(self, points) -> None:
        """Register holds: ``points`` is an iterable of ``(request_id, position)`` (see the module docstring).
        Raises FlashRTError(BUDGET_EXCEEDED), registering none, if they would exceed ``max_holds``."""
        points = [(int(r), int(p)) for r, p in points]
        with self._cv:
            if self._hold_count + len(points) > self._max_holds:
                raise FlashRTError(ErrorCode.BUDGET_EXCEEDED,
                                   f"{len(points)} more hold(s) would exceed the limit of {self._max_holds} "
                                   f"({self._hold_count} held)")
            for request_id, position in points:
                insort(self._holds.setdefault(request_id, []), position)
            self._hold_count += len(points)
            self._idle_since = None
            self._holds_checked_at = -1  # a hold on a request that has already ended is dropped at once
            self._cv.notify()

    @property
    def hold_count(self) -> int:
        """Holds registered and not yet served, passed or expired."""
        with self._cv:
            return self._hold_count

    def cancel(self, request_id: int) -> "Future":
        """Stop generation ``request_id`` at the next boundary (finish reason ``canceled``; a 'cancel' event)."""
        return self.submit(lambda s: s.cancel(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse what still waits, stop a running generation, join the thread, then close the engine (its pending
        spill files completed, dropped capsules' files gone), which no other thread touches once this one ended."""
        with self._cv:
            if self._stopping:
                return
            self._stopping = True
            waiting = list(self._commands) + list(self._idle_commands)
            self._commands.clear()
            self._idle_commands.clear()
            self._commands.append((_stop_generation, Future(), True))
            self._cv.notify()
        for _, future, _ in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(FlashRTError(ErrorCode.NOT_ACTIVE, "engine worker shut down"))
        self._thread.join(timeout)
        if self._thread.is_alive():
            _log.error("the engine thread did not stop within %.0f s; the engine's capsule tiers were not closed "
                       "(a pending spill file may be incomplete)", timeout)
        else:
            self._session.engine.close()

    # ---- the thread ------------------------------------------------------------------------------
    def _unhold(self, request_id: int, count: int = 1) -> None:
        """Drop the ``count`` smallest holds of ``request_id`` (with the lock)."""
        positions = self._holds[request_id]
        del positions[:count]
        self._hold_count -= count
        if not positions:
            del self._holds[request_id]

    def _drop_holds(self, request_ids, why: str) -> None:
        request_ids = list(request_ids)
        if request_ids:
            _log.warning("holds on request(s) %s dropped: %s", ", ".join(map(str, request_ids[:10])) +
                         (f" and {len(request_ids) - 10} more" if len(request_ids) > 10 else ""), why)
        for request_id in request_ids:
            self._unhold(request_id, len(self._holds[request_id]))

    def _hold_point(self):
        """``(request_id, position, at_it)`` of the running generation's next hold, or None (with the lock).

        Also drops holds that can never be served: those of requests that have ended (looked for once per new
        request id) and those the stream has passed (e.g. by a longer ingest)."""
        session, active = self._session, self._session.active
        if session.last_request_id != self._holds_checked_at:
            self._holds_checked_at = session.last_request_id
            running = active.request_id if active is not None else None
            self._drop_holds([r for r in self._holds if r <= session.last_request_id and r != running],
                             "the request has ended")
        positions = self._holds.get(active.request_id) if active is not None else None
        if not positions:
            return None
        position = active.position
        passed = next((i for i, p in enumerate(positions) if p >= position), len(positions))
        if passed:
            self._unhold(active.request_id, passed)
            if active.request_id not in self._holds:
                return None
        return active.request_id, positions[0], positions[0] == position

    def _wait_at_hold(self, key) -> None:
        """Wait at hold ``key`` for a command; drop the hold once it has waited ``hold_timeout_s`` in all."""
        now = time.monotonic()
        if self._held != key:  # passive commands served between two waits do not restart the clock
            self._held, self._held_since = key, now
        if now - self._held_since <= self._hold_timeout_s:
            self._cv.wait(0.05)
            return
        _log.warning("hold %s dropped: no operation arrived within %.0f s", key, self._hold_timeout_s)
        self._serve(key)

    def _wait_idle(self) -> None:
        """Sleep until something is submitted; drop every hold once idle for ``hold_timeout_s`` in all."""
        if not self._holds:
            self._cv.wait()
            return
        now = time.monotonic()
        self._idle_since = self._idle_since or now
        if now - self._idle_since <= self._hold_timeout_s:
            self._cv.wait(self._hold_timeout_s)
            return
        self._drop_holds(self._holds, f"nothing ran for {self._hold_timeout_s:.0f} s (a request that never starts?)")

    def _serve(self, key) -> None:
        """One command ran at hold ``key`` (or it expired): remove one hold there (with the lock)."""
        request_id, position = key
        positions = self._holds[request_id]
        positions.remove(position)
        self._hold_count -= 1
        if not positions:
            del self._holds[request_id]
        self._held = None

    def _next(self):
        """The next job: ``(fn, future, passive, hold_key)``, ``()`` to step the generation, None to stop."""
        with self._cv:
            while True:
                point = self._hold_point() if self._holds else None
                if point is None:
                    if self._commands:
                        return self._busy(self._commands.popleft(), None)
                else:
                    passive = next((c for c in self._commands if c[2]), None)
                    if passive is not None:
                        self._commands.remove(passive)
                        return (*passive, None)
                    if point[2]:  # at the boundary: the next command runs here; stepping waits for it
                        if self._commands:
                            return self._busy(self._commands.popleft(), point[:2])
                        self._wait_at_hold(point[:2])
                        continue
                if self._stopping:
                    return None
                if self._session.active is not None:
                    self._idle_since = None
                    return ()
                if self._idle_commands:
                    return self._busy(self._idle_commands.popleft(), None)
                self._wait_idle()

    def _busy(self, command, hold_key):
        if not command[2]:
            self._idle_since = None
        return (*command, hold_key)

    def _run(self) -> None:
        while (job := self._next()) is not None:
            if job:
                fn, future, _, hold_key = job
                if not future.set_running_or_notify_cancel():
                    continue
                if hold_key is not None:
                    with self._cv:
                        self._serve(hold_key)
                try:
                    future.set_result(fn(self._session))
                except BaseException as e:  # noqa: BLE001 - the caller gets it through the future
                    future.set_exception(e)
                continue
            try:
                self._session.active.step()
            except Exception:  # noqa: BLE001 - e.g. an emit callback failing must not kill the thread
                _log.exception("generation step failed")
                if self._session.active is not None:
                    self._session.active.stop(ERROR, "internal error while streaming")


def _stop_generation(session: Session) -> None:
    if session.active is not None:
        session.active.stop(CANCELED, "engine worker shut down")
