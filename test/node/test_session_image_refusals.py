"""Observations whose images the node cannot read, through the path the node takes (ros_convert, then
Session.refuse_observation) on a real tiny engine: refused with INVALID_ARGUMENT and the reason, one event, the
error chunk of a generating one, nothing else moved (live state, capsules, a running generation), and replayed
from the bag exactly."""
import pytest
from image_helpers import BAD_IMAGES, MAX_RAW_BYTES, camera_msg, rgb_pixels
from sensor_msgs.msg import Image as ImageMsg

from flashrt_ros.bag.bagfile import Record
from flashrt_ros.bag.replay import advance, apply, to_message
from flashrt_ros.bag.script import build_script
from flashrt_ros.discretiser import Discretiser
from flashrt_ros.image_convert import ImageLimits
from flashrt_ros.msg import Observation
from flashrt_ros.ros_convert import RefusedObservation, observation_in
from flashrt_ros.runtime import Engine, EngineConfig, ErrorCode, FlashRTError, SamplingParams
from flashrt_ros.session import PRIORITY_URGENT, EventOutput, ObservationInput, Session, TokenOutput

SAMPLED = SamplingParams(temperature=1.0)  # seeded draws: a disturbed stream would show in the tokens

LIMITS = ImageLimits(max_raw_bytes=MAX_RAW_BYTES, max_observation_pixels=10_000)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", max_context=256, capsule_budget_bytes=512 << 10))


def fresh(engine, outputs):
    engine.reset()
    for info in engine.capsules():
        engine.drop(info.id)
    return Session(engine, discretiser=Discretiser(bins=255, token_offset=257), default_sampling=SAMPLED,
                   emit=outputs.append, stream_chunk_tokens=4)


def state(engine):
    return engine.live_checksum(), engine.position, [(c.id, c.checksum) for c in engine.capsules()]


def offer(session, msg: Observation, limits=LIMITS):
    """What the node does with an ~/observation message."""
    try:
        observation = observation_in(msg, limits)
    except RefusedObservation as refused:
        return session.refuse_observation(refused.observation, refused.message)
    return session.observe(observation)


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
@pytest.mark.parametrize("generating", [False, True])
def test_an_unreadable_image_is_refused_with_its_reason_and_nothing_moves(engine, case, generating):
    outputs = []
    session = fresh(engine, outputs)
    session.observe(ObservationInput(text="the table", stamp_ns=1))
    session.snapshot(capsule_id="kept")
    before, seen = state(engine), len(outputs)
    image, reason = BAD_IMAGES[case]
    msg = Observation(text="what is on it?", token_ids=[3], max_new_tokens=5 if generating else 0, images=[image])
    msg.header.stamp.nanosec = 42
    with pytest.raises(FlashRTError) as err:
        offer(session, msg)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and reason in err.value.message
    assert state(engine) == before
    new = outputs[seen:]
    event = new[0]
    assert isinstance(event, EventOutput) and (event.op, event.success, event.error_code) == (
        "observation_refused", False, ErrorCode.INVALID_ARGUMENT)
    assert reason in event.message and event.position_before == event.position_after == before[1]
    assert (event.observation.text, event.observation.token_ids, event.observation.images) == (
        "what is on it?", [3], [])
    if generating:  # whoever waits on ~/tokens for this stamp is answered
        assert len(new) == 2 and event.request_id == new[1].request_id
        chunk = new[1]
        assert isinstance(chunk, TokenOutput) and (chunk.final, chunk.finish_reason, chunk.token_ids,
                                                   chunk.observation_stamp_ns) == (True, "error", [], 42)
    else:
        assert len(new) == 1 and event.request_id == 0


def test_too_many_pixels_in_one_observation_is_refused_though_each_image_passes(engine):
    outputs = []
    session = fresh(engine, outputs)
    before = state(engine)
    image = ImageMsg(height=5, width=6, encoding="mono8", step=6, data=bytes(30))
    msg = Observation(text="two views", images=[image, image])
    with pytest.raises(FlashRTError) as err:
        offer(session, msg, ImageLimits(max_observation_pixels=59))
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert "take 60 pixels once resized (6x5, 6x5), over image.max_observation_pixels=59" in err.value.message
    assert state(engine) == before and [o.op for o in outputs] == ["observation_refused"]


def test_an_urgent_unreadable_observation_leaves_the_running_generation_untouched(engine):
    """A refused observation is not a valid one: it must not preempt (an urgent valid one would)."""
    prompt = ObservationInput(text="count with me:", max_new_tokens=12)
    session = fresh(engine, [])
    reference = session.observe(prompt)
    while reference.step():
        pass
    expected = reference.outcome.result().token_ids

    outputs = []
    session = fresh(engine, outputs)
    gen = session.observe(prompt)
    for _ in range(4):
        gen.step()
    bad = Observation(text="stop!", priority=PRIORITY_URGENT, max_new_tokens=3,
                      images=[ImageMsg(height=1, width=1, encoding="rgba8", step=4, data=bytes(4))])
    with pytest.raises(FlashRTError):
        offer(session, bad)
    assert session.active is gen
    while gen.step():
        pass
    result = gen.outcome.result()
    assert (result.finish_reason, result.token_ids) == ("length", expected)
    assert not [o for o in outputs if isinstance(o, EventOutput) and o.op == "preempt"]


def test_a_session_with_refused_images_replays_from_its_events_exactly(engine):
    outputs = []
    session = fresh(engine, outputs)
    session.observe(ObservationInput(text="start", stamp_ns=1))
    for case in sorted(BAD_IMAGES)[:3]:
        with pytest.raises(FlashRTError):
            offer(session, Observation(text=case, max_new_tokens=2, images=[BAD_IMAGES[case][0]]))
    gen = session.observe(ObservationInput(text="go on", max_new_tokens=6))
    while gen.step():
        pass
    live = state(engine)
    records = [Record(*(lambda topic, msg: (topic, 0, msg))(*to_message(o))) for o in outputs
               if isinstance(o, (EventOutput, TokenOutput))]
    script = build_script(records)
    assert [call.op for call in script] == ["observe"] + ["observation_refused"] * 3 + ["observe"]

    replayed = []
    session = fresh(engine, replayed)
    for call in script:
        advance(session, call)
        apply(session, call, LIMITS)
    while session.active is not None:
        session.active.step()
    assert state(engine) == live
    strip = lambda outs: [{**vars(o), "latency_ms": 0} for o in outs if isinstance(o, EventOutput)]  # noqa: E731
    assert strip(replayed) == strip(outputs)
    assert [o for o in replayed if isinstance(o, TokenOutput)] == [o for o in outputs if isinstance(o, TokenOutput)]


def test_images_on_an_engine_without_its_tower_loaded_are_refused_and_nothing_moves():
    """``vision_tower`` false builds no tower: a readable image is refused by the engine, before anything changes."""
    engine = Engine(EngineConfig(model="tiny-vl", max_context=256, vision_tower=False))
    outputs = []
    session = fresh(engine, outputs)
    session.observe(ObservationInput(text="a table", stamp_ns=1))
    before = state(engine)
    camera = Observation(text="and this?", max_new_tokens=3, images=[camera_msg(rgb_pixels(32, 32))])
    with pytest.raises(FlashRTError) as err:
        offer(session, camera, limits=ImageLimits())      # readable: the engine refuses it, not the node
    assert "vision_tower off" in err.value.message
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and state(engine) == before
    assert [(o.op, o.error_code) for o in outputs if isinstance(o, EventOutput)][-1] == (
        "observe", ErrorCode.INVALID_ARGUMENT)
