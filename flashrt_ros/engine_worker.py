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
No ROS and no tensor code here.
"""
import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable, TypeVar

from flashrt_ros.runtime import ErrorCode, FlashRTError
from flashrt_ros.session import CANCELED, ERROR, Session

T = TypeVar("T")
_log = logging.getLogger(__name__)


class EngineWorker:
    def __init__(self, session: Session, name: str = "flashrt-engine"):
        self._session = session
        self._cv = threading.Condition()
        self._commands: deque = deque()
        self._idle_commands: deque = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[Session], T], when_idle: bool = False) -> "Future[T]":
        """Run ``fn(session)`` on the engine thread; ``when_idle`` waits for no running generation."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                future.set_exception(FlashRTError(ErrorCode.NOT_ACTIVE, "engine worker is shut down"))
                return future
            (self._idle_commands if when_idle else self._commands).append((fn, future))
            self._cv.notify()
        return future

    def cancel(self, request_id: int) -> "Future[bool]":
        """Stop generation ``request_id`` at the next boundary (finish reason ``canceled``)."""
        def stop(session: Session) -> bool:
            if session.active is None or session.active.request_id != request_id:
                return False
            session.active.stop(CANCELED)
            return True
        return self.submit(stop)

    def halt(self, code: ErrorCode, message: str) -> "Future[None]":
        """Cancel the running generation and refuse every idle command still waiting (with ``code``)."""
        with self._cv:
            waiting, self._idle_commands = list(self._idle_commands), deque()
        for _, future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(FlashRTError(code, message))
        return self.submit(lambda s: s.active.stop(CANCELED, message) if s.active is not None else None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Halt, run what is already queued, and join the thread."""
        if self._stopping:
            return
        self.halt(ErrorCode.NOT_ACTIVE, "engine worker shut down")
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _next(self):
        with self._cv:
            while True:
                if self._commands:
                    return self._commands.popleft()
                if self._stopping:
                    return None
                if self._session.active is not None:
                    return ()
                if self._idle_commands:
                    return self._idle_commands.popleft()
                self._cv.wait()

    def _run(self) -> None:
        while (job := self._next()) is not None:
            if job:
                fn, future = job
                if not future.set_running_or_notify_cancel():
                    continue
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
