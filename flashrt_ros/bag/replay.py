"""Offline replay: rebuild the recorded node's Session in-process and re-run the recorded calls.

The engine, discretiser and sampling come from the bag header's parameters, read by the node's own
:func:`flashrt_ros.params.read_settings`, so the replay builds exactly what the node built. Calls run
in the recorded order, each at the recorded token boundary (see :mod:`flashrt_ros.bag.script`), and
every Session output is turned into the message the node would publish, for comparison.
"""
from rclpy.parameter import Parameter
from rclpy.serialization import serialize_message

from flashrt_ros import image_convert, ros_convert as conv
from flashrt_ros.bag.bagfile import TOPICS, BagError, BagHeader
from flashrt_ros.bag.script import Call
from flashrt_ros.bag.typestore import typestore
from flashrt_ros.params import PARAMETERS, NodeSettings, read_settings
from flashrt_ros.runtime import Engine, FlashRTError
from flashrt_ros.session import ActionOutput, EventOutput, Session, TokenOutput

_CONVERSIONS = {TokenOutput: ("tokens", conv.token_chunk), ActionOutput: ("action", conv.action_chunk),
                EventOutput: ("events", conv.state_event)}


class _RecordedParameters:
    """Lets the node's ``read_settings`` read the bag's parameters (defaults for names it lacks)."""

    def __init__(self, values: dict):
        self._values = {name: values.get(name, default) for name, default, *_ in PARAMETERS}

    def get_parameter(self, name: str) -> Parameter:
        return Parameter(name, value=self._values[name])


def settings_from(parameters: dict) -> NodeSettings:
    """What a node with these parameters runs (its Engine config, discretiser, sampling, ...)."""
    try:
        return read_settings(_RecordedParameters(parameters))
    except (ValueError, TypeError) as exc:
        raise BagError(f"the node parameters are not usable: {exc}") from None


def _engine(settings: NodeSettings) -> Engine:
    try:
        return Engine(settings.engine)
    except FlashRTError as exc:
        raise BagError(f"cannot build the engine of the recorded parameters here: {exc}") from None


def check_fingerprint(recorded: str, replayed: str, allow_model_change: bool) -> list[str]:
    """Refuse (BagError) a different model unless allowed; returns the report notes."""
    if recorded == replayed:
        return []
    text = f"model fingerprint differs: recorded {recorded[:16]}, replay {replayed[:16]}"
    if not allow_model_change:
        raise BagError(text + "; pass --allow-model-change to replay anyway")
    return [text + " (--allow-model-change)"]


def to_message(output, stamp_ns: int = 0, pixels: bool = True) -> tuple[str, object]:
    """(short topic, rosbags message) of what the node publishes for a Session output: built by the
    node's own conversion and serialised by rclpy, so it is the node's message byte for byte (an event's images
    with their pixels only if ``pixels``, the node's ``image.record_pixels``)."""
    topic, convert = _CONVERSIONS[type(output)]
    stamp = conv.ns_to_time(stamp_ns)
    cdr = serialize_message(convert(output, stamp, pixels) if topic == "events" else convert(output, stamp))
    return topic, typestore().deserialize_cdr(cdr, TOPICS[topic])


def apply(session: Session, call: Call, limits: image_convert.ImageLimits = image_convert.ImageLimits()) -> None:
    """Issue one recorded call, with the recorded request (its images read under the node's ``limits``); a refusal
    is part of the recording (its event says so). Observations that shared one prefill are ingested as one
    prefill again."""
    try:
        if call.also:
            session.observe_group([conv.observation_in(o, limits) for o in call.observations])
        else:
            getattr(session, call.operation.method)(**conv.session_kwargs(call.operation, call.event, limits))
    except FlashRTError:
        pass


def advance(session: Session, call: Call) -> None:
    """Step the running generation to where ``call`` ran: ``position_before`` of the request it names, or
    (none named) until no generation runs."""
    while session.active is not None and (call.running == 0 or (
            session.active.request_id == call.running and session.position < call.event.position_before)):
        session.active.step()


def replay_offline(header: BagHeader, script: list[Call], *, allow_model_change: bool = False
                   ) -> tuple[dict[str, list], list[str]]:
    """Run ``script`` on a fresh Session built from the bag's parameters; returns the outputs per
    short topic and the report notes."""
    settings = settings_from(header.parameters)
    engine = _engine(settings)
    notes = check_fingerprint(header.fingerprint, engine.fingerprint, allow_model_change)
    limits = image_convert.limits_for(engine, **settings.image_limits)
    outputs = {topic: [] for topic, _ in _CONVERSIONS.values()}

    def emit(output):
        if type(output) not in _CONVERSIONS:      # a TypedOutput: its text is on ~/tokens, which the bag holds
            return
        topic, msg = to_message(output, pixels=settings.record_pixels)
        outputs[topic].append(msg)

    session = Session(engine, discretiser=settings.discretiser, default_sampling=settings.sampling,
                      emit=emit, stream_chunk_tokens=settings.stream_chunk_tokens)
    for call in script:
        advance(session, call)
        apply(session, call, limits)
    while session.active is not None:
        session.active.step()
    return outputs, notes
