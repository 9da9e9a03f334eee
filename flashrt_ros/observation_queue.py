"""Observations at sensor rate: the node's bounded queue between ``~/observation`` and the engine thread.

An observation that arrives while the engine is busy (a prefill, a decode step, a state operation) waits
here, and everything that waited is appended together as one prefill at the next step boundary
(:meth:`flashrt_ros.session.Session.observe_group`), in arrival order, each still recorded as its own
'observe' event. One prefill of many short observations costs little more than one of them, so the
engine keeps up with a sensor publishing faster than a single observation's prefill takes.

Two lanes: **urgent** observations never wait behind normal ones. An urgent group runs at the next
token boundary (it preempts a running generation); so an urgent observation waits at most one step:
one decode step, or the one group prefill already running (at most ``max_group_bytes`` of queued
observations, at least one observation). Normal groups run when no generation is running.

A group ends at an observation that generates (``max_new_tokens > 0``) or takes a capsule
(``snapshot_label``): what comes after it waits for the next group, so the generation starts from, and
the capsule holds, exactly what arrived before.

The queue is bounded in bytes (:func:`observation_bytes`), not by the DDS history depth. When an
observation would take the queue past ``max_bytes`` the **overload policy** decides:

* ``drop_oldest``: the oldest queued observations of the same lane (then of the other) are dropped
  until it fits; each drop is an ``observation_dropped`` event carrying the dropped observation (its
  stamp) and counted in ``/diagnostics``.
* ``refuse_new``: the new observation is refused (an ``observation_dropped`` event, counted).
* ``block``: nothing is dropped: the subscription callback waits until the engine has taken enough.
  While it waits the node takes no further observation from DDS, so they wait in the subscription's
  DDS history (``qos.observation.depth``): with KEEP_LAST history and a publisher that keeps
  publishing, DDS overwrites the oldest there once the depth is full (counted as lost by the
  sequence-gap check, not by this queue); only a RELIABLE + KEEP_ALL pair on both sides makes the
  publisher itself wait (its ``publish()`` blocks, within the DDS ``max_blocking_time``).

Until ``max_bytes`` is reached nothing is dropped, whichever the policy. An observation larger than
``max_bytes`` alone is refused under every policy. No ROS and no tensor code here.
"""
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

from flashrt_ros.session import PRIORITY_URGENT, ObservationInput

DROP_OLDEST, REFUSE_NEW, BLOCK = "drop_oldest", "refuse_new", "block"
OVERLOAD_POLICIES = (DROP_OLDEST, REFUSE_NEW, BLOCK)
_VALUE_BYTES = 4  # int32 token ids and float32 values, as in the message


def observation_bytes(obs: ObservationInput) -> int:
    """What an observation holds in the queue: its text, ids, values, images' RGB pixels, label and constraint (at
    least 1)."""
    return max(1, len(obs.text.encode()) + _VALUE_BYTES * (len(obs.token_ids) + len(obs.values))
               + sum(image.rgb.nbytes for image in obs.images)
               + sum(len(s.encode()) for s in (obs.snapshot_label, *obs.constraint_fields().values())))


def _ends_group(obs: ObservationInput) -> bool:
    return obs.max_new_tokens > 0 or bool(obs.snapshot_label)


@dataclass(frozen=True)
class Dropped:
    """An observation the queue did not keep, and why (the 'observation_dropped' event's message)."""
    observation: ObservationInput
    reason: str


class ObservationQueue:
    """Two FIFO lanes under one byte budget; thread-safe (``put`` from ROS callbacks, ``take`` from the
    engine thread)."""

    def __init__(self, max_bytes: int, overload: str = DROP_OLDEST, max_group_bytes: Optional[int] = None):
        if overload not in OVERLOAD_POLICIES:
            raise ValueError(f"overload must be one of {', '.join(OVERLOAD_POLICIES)}, got {overload!r}")
        if max_bytes < 1 or (max_group_bytes is not None and max_group_bytes < 1):
            raise ValueError("max_bytes and max_group_bytes must be >= 1")
        self.max_bytes = max_bytes
        self.max_group_bytes = max_group_bytes or max_bytes
        self.overload = overload
        self._lanes = {True: deque(), False: deque()}  # urgent? -> (observation, bytes), oldest first
        self._bytes = 0
        self._cv = threading.Condition()
        self._closed = False
        self.dropped = 0   # observations dropped or refused by the overload policy (or closing)
        self.taken = 0     # observations handed to the engine
        self.peak_bytes = 0

    def __len__(self) -> int:
        with self._cv:
            return len(self._lanes[True]) + len(self._lanes[False])

    def stats(self) -> dict:
        """Figures for ``/diagnostics``."""
        with self._cv:
            return {"observations_queued": len(self._lanes[True]) + len(self._lanes[False]),
                    "observation_queue_bytes": self._bytes, "observation_queue_peak_bytes": self.peak_bytes,
                    "observations_dropped": self.dropped}

    def put(self, obs: ObservationInput) -> list[Dropped]:
        """Queue ``obs``; returns what the overload policy dropped (possibly ``obs`` itself). ``block``
        waits here for room (or until :meth:`close`)."""
        size = observation_bytes(obs)
        urgent = obs.priority == PRIORITY_URGENT
        with self._cv:
            if self._closed:
                return self._drop([Dropped(obs, "the node stopped taking observations")])
            if size > self.max_bytes:
                return self._drop([Dropped(obs, f"observation of {size} bytes exceeds the whole queue budget "
                                                f"observation_queue.max_bytes={self.max_bytes}")])
            dropped = []
            while self._bytes + size > self.max_bytes:
                if self.overload == REFUSE_NEW:
                    return self._drop([Dropped(obs, f"queue full ({self._bytes} of {self.max_bytes} bytes): "
                                                    "refused (observation_queue.overload=refuse_new)")])
                if self.overload == BLOCK:
                    self._cv.wait()
                    if self._closed:
                        return self._drop([Dropped(obs, "the node stopped taking observations")])
                    continue
                lane = self._lanes[urgent] or self._lanes[not urgent]
                old, old_size = lane.popleft()
                self._bytes -= old_size
                dropped.append(Dropped(old, f"queue full ({self.max_bytes} bytes): oldest dropped for a newer "
                                            "one (observation_queue.overload=drop_oldest)"))
            self._lanes[urgent].append((obs, size))
            self._bytes += size
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            return self._drop(dropped)

    def take(self, urgent: bool) -> list[ObservationInput]:
        """The next group of one lane, oldest first: up to ``max_group_bytes`` (at least one observation),
        ending early after one that generates or takes a snapshot. Empty if the lane is."""
        group, size = [], 0
        with self._cv:
            lane = self._lanes[urgent]
            while lane and (not group or size + lane[0][1] <= self.max_group_bytes):
                obs, n = lane.popleft()
                group.append(obs)
                size += n
                if _ends_group(obs):
                    break
            self._bytes -= size
            self.taken += len(group)
            if group:
                self._cv.notify_all()
        return group

    def close(self) -> list[Dropped]:
        """Stop: wake blocked producers and return every queued observation as dropped."""
        with self._cv:
            self._closed = True
            left = [Dropped(obs, "the node stopped taking observations") for lane in self._lanes.values()
                    for obs, _ in lane]
            for lane in self._lanes.values():
                lane.clear()
            self._bytes = 0
            self._cv.notify_all()
            return self._drop(left)

    def _drop(self, dropped: list[Dropped]) -> list[Dropped]:
        self.dropped += len(dropped)
        return dropped


class ObservationIngest:
    """Feeds an :class:`ObservationQueue` to the engine thread (an :class:`flashrt_ros.engine_worker.EngineWorker`).

    Every offered observation submits one drain job: urgent ones as commands (next token boundary),
    normal ones ``when_idle``. A drain job ingests whatever group its lane holds then, so jobs never
    outnumber what they serve and a job that finds its lane empty does nothing. Drops become
    'observation_dropped' events at the next boundary; ``warn`` logs every drop and refusal.
    """

    def __init__(self, worker, queue: ObservationQueue, warn: Callable[[str], None]):
        self._worker = worker
        self.queue = queue
        self._warn = warn
        self._urgent_wait_ms = 0.0  # the longest an urgent group waited for the engine since the last stats()

    def stats(self) -> dict:
        """The queue's figures and ``urgent_wait_ms_max``: the longest an urgent observation waited from its
        arrival to the start of its prefill, since the previous call (one step at most, plus the engine
        thread's own scheduling)."""
        wait, self._urgent_wait_ms = self._urgent_wait_ms, 0.0
        return {**self.queue.stats(), "urgent_wait_ms_max": round(wait, 3)}

    def offer(self, obs: ObservationInput) -> Optional[Future]:
        """Queue ``obs`` and submit its drain job; returns the job's future (it fails with the refusal of a
        lone observation), or None if ``obs`` itself was dropped."""
        dropped = self.queue.put(obs)
        self._record(dropped)
        if any(d.observation is obs for d in dropped):
            return None
        urgent, arrived = obs.priority == PRIORITY_URGENT, time.perf_counter()
        return self._worker.submit(lambda s: self._drain(s, urgent, arrived), when_idle=not urgent)

    def close(self) -> None:
        """Refuse what still waits (each an event, if the engine thread still runs)."""
        self._record(self.queue.close())

    def _drain(self, session, urgent: bool, arrived: float) -> None:
        """Ingest the lane's next group. Drain jobs run in submission order, so the first one to find the group
        is that of its oldest observation: ``arrived`` is when the group's first observation arrived."""
        group = self.queue.take(urgent)
        if group:
            if urgent:
                self._urgent_wait_ms = max(self._urgent_wait_ms, (time.perf_counter() - arrived) * 1e3)
            session.observe_group(group)

    def _record(self, dropped: list[Dropped]) -> None:
        for d in dropped:
            self._warn(f"observation (stamp {d.observation.stamp_ns} ns) dropped: {d.reason}")
            self._worker.submit(lambda s, d=d: s.observation_dropped(d.observation, d.reason))
