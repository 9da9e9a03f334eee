"""Turn a session bag into the calls that made it: the replay script.

``~/events`` carries one StateEvent per Session operation, numbered by ``seq``, holding the request as it was
made (its fields under the request's own names, see :mod:`flashrt_ros.operations`; the observation itself for
``observe`` and ``generate``), the generation running when it ran (``running_request_id``) and the live
position then (``position_before``). That is a complete, ordered log of what the engine thread did, so the
script is the recorded events in ``seq`` order, minus those another call emits as its own consequence:

* ``preempt`` is emitted inside the ``observe`` / ``generate`` that interrupts a running generation;
* the ``snapshot`` right after a successful ``observe`` / ``generate`` whose observation has a ``snapshot_label``.

A call with ``running_request_id`` R ran at ``position_before`` of request R: replays place it there (offline
by stepping R to that position, live through the node's ``~/hold``). A call with none ran while no generation
ran: replays let the previous one finish first.

Observations the node queued while its engine was busy were ingested together as one prefill, each with its
own 'observe' event whose ``count`` says how many observations after it share that prefill: such a group is
one call (its first event, and the others in ``also``), which the replay ingests as one prefill again.

The calls' events are copies whose observation images hold their pixels (from the bag's ``~/observation`` when the
events recorded digests only); the bag's own records stay as recorded, for the comparison.
"""
from dataclasses import dataclass, replace

from flashrt_ros.bag.bagfile import BagError, Record
from flashrt_ros.bag.images import ImageSource
from flashrt_ros.operations import OPERATIONS

_OBSERVING = {"observe", "generate"}


@dataclass(frozen=True)
class Call:
    event: object                        # the recorded StateEvent of this call
    first_seq: int = 0                   # seq of its first event (a 'preempt' it caused comes before it)
    also: tuple = ()                     # the 'observe' events that shared its prefill, in order

    @property
    def last(self):
        """Its last event (the group's last observation: the one that may generate or take a snapshot)."""
        return self.also[-1] if self.also else self.event

    @property
    def observations(self) -> list:
        """The recorded observations of an 'observe' call, in arrival order."""
        return [e.observation for e in (self.event, *self.also)]

    @property
    def op(self) -> str:
        return self.event.op

    @property
    def operation(self):
        return OPERATIONS[self.op]

    @property
    def running(self) -> int:
        """The request that was generating when the call ran (0 = none)."""
        return int(self.event.running_request_id)

    @property
    def opens_request(self) -> int:
        """The request id the call took (0 = none): a generating observation, even a refused one (its final
        chunk says ``error``), or a successful resume."""
        return 0 if self.op == "cancel" else int(self.last.request_id)


def build_script(records: list[Record]) -> list[Call]:
    """The replayable calls of a recorded session, their observations' images with pixels (see
    :mod:`flashrt_ros.bag.images`); BagError if the bag cannot be replayed."""
    events = sorted((r.msg for r in records if r.topic == "events"), key=lambda e: e.seq)
    _check_complete(events)
    images = ImageSource(records)
    events = [images.fill(event) for event in events]
    script: list[Call] = []
    first = None  # seq of a consequence emitted ahead of the call that caused it
    for event in events:
        previous = script[-1].last if script else None
        if OPERATIONS.get(event.op) is None:
            raise BagError(f"event seq {event.seq} has an unknown op {event.op!r}")
        if OPERATIONS[event.op].kind == "consequence":
            first = first or event.seq
            continue
        if _label_snapshot(previous, event):
            continue
        if _joins(previous, event):
            script[-1] = replace(script[-1], also=(*script[-1].also, event))
            continue
        script.append(Call(event, first or event.seq))
        first = None
    return script


def _joins(previous, event) -> bool:
    """Whether ``event`` shared the prefill of the 'observe' event just before it."""
    return (event.op == "observe" and previous is not None and previous.op == "observe" and previous.count > 0
            and previous.seq == event.seq - 1)


def _label_snapshot(previous, event) -> bool:
    return (event.op == "snapshot" and previous is not None and previous.op in _OBSERVING and previous.success
            and bool(previous.observation.snapshot_label) and previous.seq == event.seq - 1)


def _check_complete(events: list) -> None:
    """Refuse bags that do not hold a whole session from a fresh node."""
    if not events:
        raise BagError("the bag has no ~/events messages: nothing to replay")
    first = events[0]
    if first.seq != 1 or first.position_before != 0:
        raise BagError(f"the recording does not start at a fresh node (first event seq {first.seq}, "
                       f"position {first.position_before}); start the recorder before the node's "
                       "first observation")
    gaps = [(a.seq, b.seq) for a, b in zip(events, events[1:]) if b.seq != a.seq + 1]
    if gaps:
        raise BagError(f"~/events is incomplete: seq jumps from {gaps[0][0]} to {gaps[0][1]}")
