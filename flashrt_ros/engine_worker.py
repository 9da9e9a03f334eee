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
ends or passes the position, or after ``hold_timeout_s`` at it without a command (logged).
No ROS and no tensor code here.
"""
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from typing import Callable, TypeVar

from flashrt_ros.runtime import ErrorCode, FlashRTError
from flashrt_ros.session import CANCELED, ERROR, Session

T = TypeVar("T")
_log = logging.getLogger(__name__)
HOLD_TIMEOUT_S = 30.0


class EngineWorker:
    def __init__(self, session: Session, name: str = "flashrt-engine", hold_timeout_s: float = HOLD_TIMEOUT_S):
        self._session = session
        self._cv = threading.Condition()
        self._commands: deque = deque()
        self._idle_commands: deque = deque()
        self._holds: Counter = Counter()   # (request_id, position) -> commands still to run there
        self._hold_timeout_s = hold_timeout_s
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
        """Register holds: ``points`` is an iterable of ``(request_id, position)`` (see the module docstring)."""
        with self._cv:
            self._holds.update((int(r), int(p)) for r, p in points)
            self._cv.notify()

    def cancel(self, request_id: int) -> "Future":
        """Stop generation ``request_id`` at the next boundary (finish reason ``canceled``; a 'cancel' event)."""
        return self.submit(lambda s: s.cancel(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse what still waits, stop a running generation, and join the thread."""
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

    # ---- the thread ------------------------------------------------------------------------------
    def _hold_point(self):
        """``(position, held)`` of the running generation's next hold, or None (called with the lock)."""
        active = self._session.active
        mine = sorted(p for (r, p), n in self._holds.items() if n > 0 and active is not None and r == active.request_id)
        stale = [k for k in self._holds if k[0] <= self._session.last_request_id
                 and (active is None or k[0] != active.request_id)]
        for key in stale:
            del self._holds[key]
        if not mine:
            return None
        position = active.position
        for p in mine:
            if p < position:
                del self._holds[(active.request_id, p)]  # passed (e.g. a longer ingest): nothing to hold there
        ahead = [p for p in mine if p >= position]
        return (ahead[0], ahead[0] == position) if ahead else None

    def _next(self):
        """The next job: ``(fn, future, passive, hold_key)``, ``()`` to step the generation, None to stop."""
        with self._cv:
            held_since = None
            while True:
                point = self._hold_point() if self._holds else None
                if point is None:
                    held_since = None
                    if self._commands:
                        return (*self._commands.popleft(), None)
                else:
                    key = (self._session.active.request_id, point[0])
                    passive = next((c for c in self._commands if c[2]), None)
                    if passive is not None:
                        self._commands.remove(passive)
                        return (*passive, None)
                    if point[1]:  # at the boundary: the next command runs here; stepping waits for it
                        if self._commands:
                            return (*self._commands.popleft(), key)
                        held_since = held_since or time.monotonic()
                        if time.monotonic() - held_since > self._hold_timeout_s:
                            _log.warning("hold %s dropped: no operation arrived within %.0f s", key,
                                         self._hold_timeout_s)
                            del self._holds[key]
                            continue
                        self._cv.wait(0.05)
                        continue
                if self._stopping:
                    return None
                if self._session.active is not None:
                    return ()
                if self._idle_commands:
                    return (*self._idle_commands.popleft(), None)
                self._cv.wait()

    def _run(self) -> None:
        while (job := self._next()) is not None:
            if job:
                fn, future, _, hold_key = job
                if not future.set_running_or_notify_cancel():
                    continue
                if hold_key is not None:
                    with self._cv:
                        self._holds[hold_key] -= 1
                        if self._holds[hold_key] <= 0:
                            del self._holds[hold_key]
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
