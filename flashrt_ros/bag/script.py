"""Turn a session bag into the calls that made it: the replay script.

``~/events`` carries one StateEvent per Session operation, numbered by ``seq``, with the live position
before it. That is a complete, ordered log of what the engine thread did, so the script is the
recorded events in ``seq`` order, minus those another call emits as its own consequence:

* ``preempt`` is emitted inside the ``observe`` that interrupts a running generation;
* the ``snapshot`` right after a successful ``observe`` whose observation has a ``snapshot_label``.

Each ``observe`` event takes the next recorded ``~/observation`` message: the node processes them in
arrival order, except that normal observations wait while a generation runs, so an ``observe`` that
happened mid-generation took the first waiting *urgent* one. ``position_before`` says where a call ran: the replay steps a running generation
until the live position reaches it, which places operations at the same token boundary, including
those that ran mid-generation. :attr:`Call.tokens_into_request` says whether the call ran
mid-generation (and how deep), which a live replay needs to time it.
"""
from dataclasses import dataclass

from flashrt_ros.bag.bagfile import BagError, Record
from flashrt_ros.session import PRIORITY_URGENT

_REPLACING = {"restore", "rollback", "reset", "resume"}  # + fork with switch_to; they end a generation
_STOPPED = {"preempted", "canceled"}  # finish reasons of a generation that something else ended


@dataclass(frozen=True)
class Call:
    event: object                        # the recorded StateEvent of this call
    observation: object = None           # observe: the recorded Observation it ingested
    tokens_into_request: int | None = None  # None: no generation was running when it ran

    @property
    def op(self) -> str:
        return self.event.op

    @property
    def opens_request(self) -> bool:
        """Whether the call took the next request id (and so ends with a final ~/tokens chunk): a
        generating observation, even a refused one (its final chunk says ``error``), or a resume."""
        if self.op == "observe":
            return self.observation.max_new_tokens > 0
        return self.op == "resume" and self.event.success

    @property
    def starts_generation(self) -> bool:
        return self.opens_request and self.event.success

    @property
    def replaces_state(self) -> bool:
        return self.event.success and (self.op in _REPLACING or (self.op == "fork" and self.event.switch_to))


@dataclass
class _Request:
    start: int         # position when it started
    end: int           # position of its final chunk
    stopped: bool      # ended by another call (preempted / canceled) rather than by itself


def build_script(records: list[Record]) -> list[Call]:
    """The replayable calls of a recorded session; BagError if the bag cannot be replayed."""
    events = sorted((r.msg for r in records if r.topic == "events"), key=lambda e: e.seq)
    observations = [r.msg for r in records if r.topic == "observation"]
    _check_complete(events, observations)
    finals = {r.msg.request_id: r.msg for r in records if r.topic == "tokens" and r.msg.final}
    pending = list(observations)
    script: list[Call] = []
    active: _Request | None = None
    requests = 0
    for event in events:
        previous = script[-1] if script else None
        if event.op == "preempt" or (event.op == "snapshot" and previous is not None
                                     and previous.op == "observe" and previous.event.success
                                     and previous.observation.snapshot_label
                                     and previous.event.seq == event.seq - 1):
            continue
        here = event.position_before
        if active is not None and not active.stopped and here >= active.end:
            active = None  # it had finished on its own before this call
        call = Call(event, _take(pending, mid_generation=active is not None) if event.op == "observe" else None,
                    None if active is None else here - active.start)
        script.append(call)
        if call.replaces_state or (call.op == "observe" and event.success):
            active = None
        requests += call.opens_request
        if call.starts_generation:
            final = finals.get(requests)
            active = _Request(event.position_after, final.position if final else event.position_after,
                              final is not None and final.finish_reason in _STOPPED)
    return script


def _take(pending: list, mid_generation: bool):
    """The observation an ``observe`` event ingested (see the module docstring)."""
    urgent = (i for i, o in enumerate(pending) if o.priority == PRIORITY_URGENT)
    return pending.pop(next(urgent, 0) if mid_generation else 0)


def _check_complete(events: list, observations: list) -> None:
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
    observes = sum(e.op == "observe" for e in events)
    if observes != len(observations):
        raise BagError(f"{observes} observe events but {len(observations)} ~/observation messages: the "
                       "node also took goals of its ~/generate action (not replayable), or observations "
                       "were lost")
