"""Messages <-> Session dataclasses. Pure field copying; no behaviour lives here."""
import dataclasses

from builtin_interfaces.msg import Time

from flashrt_ros.msg import ActionChunk, CapsuleInfo, Observation, StateEvent, TokenChunk
from flashrt_ros.operations import Operation
from flashrt_ros.session import ActionOutput, EventOutput, ObservationInput, TokenOutput


def time_to_ns(stamp: Time) -> int:
    return stamp.sec * 1_000_000_000 + stamp.nanosec


def ns_to_time(ns: int) -> Time:
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def observation_in(msg: Observation) -> ObservationInput:
    return ObservationInput(text=msg.text, token_ids=[int(t) for t in msg.token_ids],
                            values=[float(v) for v in msg.values], max_new_tokens=msg.max_new_tokens,
                            priority=msg.priority, snapshot_label=msg.snapshot_label,
                            stamp_ns=time_to_ns(msg.header.stamp))


def session_kwargs(op: Operation, request) -> dict:
    """The Session method's keyword arguments for ``op`` from a request, goal or recorded StateEvent (the
    same field names in all three; the observation becomes an ObservationInput)."""
    return {name: observation_in(getattr(request, name)) if name == "observation" else plain(getattr(request, name))
            for name in op.fields}


def plain(value):
    """Python scalars from ROS or rosbags fields (numpy scalars from a bag, float32 from a message)."""
    return value.item() if hasattr(value, "item") else value


def capsule_msg(info) -> CapsuleInfo:
    created_ns = int(info.created * 1e9)
    return CapsuleInfo(id=info.id, parent=info.parent, label=info.label, position=info.position,
                       bytes=info.nbytes, tier=info.tier, checksum=info.checksum, created=ns_to_time(created_ns),
                       own_bytes=info.own_bytes, shared_bytes=info.shared_bytes, pinned=info.pinned)


def token_chunk(out: TokenOutput, stamp: Time) -> TokenChunk:
    msg = TokenChunk(request_id=out.request_id, token_ids=out.token_ids, text=out.text, position=out.position,
                     final=out.final, finish_reason=out.finish_reason,
                     observation_stamp=ns_to_time(out.observation_stamp_ns))
    msg.header.stamp = stamp
    return msg


def action_chunk(out: ActionOutput, stamp: Time) -> ActionChunk:
    msg = ActionChunk(request_id=out.request_id, horizon=out.horizon, dims=out.dims, values=out.values,
                      token_ids=out.token_ids, observation_stamp=ns_to_time(out.observation_stamp_ns))
    msg.header.stamp = stamp
    return msg


def observation_msg(obs: ObservationInput) -> Observation:
    msg = Observation(text=obs.text, token_ids=list(obs.token_ids), values=list(obs.values),
                      max_new_tokens=obs.max_new_tokens, priority=obs.priority, snapshot_label=obs.snapshot_label)
    msg.header.stamp = ns_to_time(obs.stamp_ns)
    return msg


def state_event(out: EventOutput, stamp: Time) -> StateEvent:
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    obs = fields.pop("observation")
    msg = StateEvent(**fields, observation=observation_msg(obs) if obs is not None else Observation())
    msg.error_code = int(out.error_code)
    msg.header.stamp = stamp
    return msg


def refusal(response, error):
    """Fill a response (or action result) with a refusal; a ``position`` field gets the live position the
    refusal left unchanged."""
    response.success, response.message = False, error.message
    if hasattr(response, "error_code"):
        response.error_code = int(error.code)
    else:  # std_srvs/Trigger (reset): the code goes into the message
        response.message = f"{error.code.name}: {error.message}"
    if hasattr(response, "position") and getattr(error, "position", None) is not None:
        response.position = error.position
    return response


def response(resp, result, latency_ms: float):
    """Fill a service response from an operation's typed result (same field names; see operations.py).

    ``std_srvs/Trigger`` (reset) has only success and message."""
    resp.success = True
    if hasattr(resp, "error_code"):
        resp.error_code = 0
    for f in dataclasses.fields(result):
        value = getattr(result, f.name)
        if f.name == "capsules":
            value = [capsule_msg(c) for c in value]
        elif f.name == "capsule":
            value = capsule_msg(value)
        setattr(resp, f.name, value)
    if hasattr(resp, "latency_ms"):
        resp.latency_ms = latency_ms
    return resp


class SequenceGaps:
    """Counts messages lost between publisher and subscription, from the gaps in each publisher's
    ``publication_sequence_number`` (rclpy MessageInfo)."""

    def __init__(self):
        self._last: dict = {}

    def seen(self, info) -> int:
        """Register a received message; returns how many of its publisher's messages were skipped before it."""
        if not info:
            return 0
        number = info.get("publication_sequence_number", 0)
        if not number:  # the middleware does not number publications
            return 0
        gid = bytes((info.get("publisher_gid") or {}).get("data", b""))
        last = self._last.get(gid)
        self._last[gid] = max(number, last or 0)
        return max(0, number - last - 1) if last is not None else 0
