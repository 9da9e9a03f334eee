"""Messages <-> Session dataclasses: field copying, and times saturated to what a Time message can carry."""
import dataclasses
import math

from builtin_interfaces.msg import Time
from sensor_msgs.msg import Image as ImageMsg

from flashrt_ros import image_convert
from flashrt_ros.msg import ActionChunk, CapsuleInfo, Observation, StateEvent, TokenChunk
from flashrt_ros.operations import Operation
from flashrt_ros.runtime.errors import FlashRTError
from flashrt_ros.runtime.vision.image import Image
from flashrt_ros.session import ActionOutput, EventOutput, ObservationInput, TokenOutput


_NS_PER_S = 1_000_000_000
# builtin_interfaces/Time holds ``int32 sec`` and ``uint32 nanosec``: 1901-12-13T20:45:52Z to 2038-01-19T03:14:07.999999999Z.
TIME_MIN_NS = -(2**31) * _NS_PER_S
TIME_MAX_NS = (2**31 - 1) * _NS_PER_S + _NS_PER_S - 1


def time_to_ns(stamp: Time) -> int:
    return stamp.sec * _NS_PER_S + stamp.nanosec


def ns_to_time(ns: int) -> Time:
    """Nanoseconds since the epoch as a Time message, saturated at the range the message can carry: an
    instant after 2038-01-19 reads as :data:`TIME_MAX_NS` (before 1901, :data:`TIME_MIN_NS`), never as a
    ``sec`` that wraps to a negative number on the wire."""
    ns = min(max(int(ns), TIME_MIN_NS), TIME_MAX_NS)
    return Time(sec=ns // _NS_PER_S, nanosec=ns % _NS_PER_S)


def seconds_to_time(seconds: float) -> Time:
    """A unix time in float seconds (e.g. a capsule's ``created``, which a file may set to anything) as a Time
    message: saturated as :func:`ns_to_time` does (so +-inf and 1e308 give the bounds); NaN, no time at all, is 0."""
    if math.isnan(seconds):
        return Time()
    bounded = min(max(float(seconds), TIME_MIN_NS / _NS_PER_S), TIME_MAX_NS / _NS_PER_S)
    return ns_to_time(int(bounded * _NS_PER_S))


class RefusedObservation(FlashRTError):
    """An observation whose images the node cannot convert: ``observation`` holds the rest of it (no images), for
    :meth:`flashrt_ros.session.Session.refuse_observation`."""

    def __init__(self, observation: ObservationInput, error: FlashRTError):
        super().__init__(error.code, error.message)
        self.observation = observation


def observation_in(msg: Observation, limits: image_convert.ImageLimits = image_convert.ImageLimits()
                   ) -> ObservationInput:
    """The observation of a message (an rclpy one, or a rosbags one from a bag); its images converted under
    ``limits``, else :class:`RefusedObservation`."""
    obs = ObservationInput(text=msg.text, token_ids=[int(t) for t in msg.token_ids],
                           values=[float(v) for v in msg.values], max_new_tokens=msg.max_new_tokens,
                           priority=msg.priority, snapshot_label=msg.snapshot_label,
                           stamp_ns=time_to_ns(msg.header.stamp), json_schema=msg.json_schema, grammar=msg.grammar,
                           output_type=msg.output_type)
    try:
        obs.images = [Image(rgb=rgb) for rgb in limits.convert(msg.images)]
    except FlashRTError as error:
        raise RefusedObservation(obs, error) from None
    return obs


def session_kwargs(op: Operation, request, limits: image_convert.ImageLimits = image_convert.ImageLimits()) -> dict:
    """The Session method's keyword arguments for ``op`` from a request, goal or recorded StateEvent (the
    same field names in all three; the observation becomes an ObservationInput, its images read under ``limits``)."""
    return {name: observation_in(getattr(request, name), limits) if name == "observation"
            else plain(getattr(request, name)) for name in op.fields}


def plain(value):
    """Python scalars from ROS or rosbags fields (numpy scalars from a bag, float32 from a message)."""
    return value.item() if hasattr(value, "item") else value


def capsule_msg(info) -> CapsuleInfo:
    return CapsuleInfo(id=info.id, parent=info.parent, label=info.label, position=info.position,
                       bytes=info.nbytes, tier=info.tier, checksum=info.checksum, created=seconds_to_time(info.created),
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


def observation_msg(obs: ObservationInput, pixels: bool = True) -> Observation:
    """The message of an observation; its images as rgb8 (``data`` left empty unless ``pixels``)."""
    msg = Observation(text=obs.text, token_ids=list(obs.token_ids), values=list(obs.values),
                      max_new_tokens=obs.max_new_tokens, priority=obs.priority, snapshot_label=obs.snapshot_label,
                      images=[ImageMsg(**image_convert.rgb8_fields(image.rgb, pixels)) for image in obs.images],
                      json_schema=obs.json_schema, grammar=obs.grammar, output_type=obs.output_type)
    msg.header.stamp = ns_to_time(obs.stamp_ns)
    return msg


def state_event(out: EventOutput, stamp: Time, pixels: bool = True) -> StateEvent:
    """The event's message; an observation's images with their digests, and their pixels only if ``pixels``
    (the node parameter ``image.record_pixels``)."""
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    obs = fields.pop("observation")
    msg = StateEvent(**fields, observation=observation_msg(obs, pixels) if obs is not None else Observation(),
                     image_digests=[image_convert.digest(image.rgb) for image in obs.images] if obs else [])
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
    ``publication_sequence_number`` (rclpy MessageInfo). Messages must be seen in the order they were taken
    (one callback at a time). What a publisher sent before its first message that arrived is not counted:
    it cannot be told apart from what it sent before the subscription was connected."""

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
