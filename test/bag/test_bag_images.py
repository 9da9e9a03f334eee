"""Images in session bags: an event records each image's digest and (image.record_pixels) its rgb8 pixels; the replay
script gets them back, from the event or, recorded without pixels, from the bag's ~/observation in whatever encoding
the camera sent; a missing image or pixels that do not match their digest stop the replay with a clear reason."""
import dataclasses

import numpy as np
import pytest
from image_helpers import camera_msg, rgb_pixels
from rclpy.serialization import serialize_message

from flashrt_ros.bag.bagfile import TOPICS, BagError, Record
from flashrt_ros.bag.compare import compare_topic
from flashrt_ros.bag.replay import advance, apply, to_message
from flashrt_ros.bag.script import build_script
from flashrt_ros.bag.typestore import typestore
from flashrt_ros.image_convert import digest, to_rgb
from flashrt_ros.msg import Observation
from flashrt_ros.ros_convert import observation_in
from flashrt_ros.discretiser import Discretiser
from flashrt_ros.image_convert import ImageLimits
from flashrt_ros.runtime import Engine, EngineConfig, SamplingParams
from flashrt_ros.session import EventOutput, ObservationInput, Session, TokenOutput

RGB = [rgb_pixels(6, 10, seed=1), rgb_pixels(3, 4, seed=2)]


def recorded_session(pixels: bool, op: str = "observe"):
    """The records of a one-observation session whose observation carried two camera images (bgr8 with padded
    rows, and rgb8), as the node publishes them; and the ~/observation record the camera's message makes."""
    camera = Observation(text="what is this?", max_new_tokens=2,
                         images=[camera_msg(RGB[0], "bgr8", padding=3), camera_msg(RGB[1])])
    ingested = observation_in(camera)
    assert [digest(i.rgb) for i in ingested.images] == [digest(rgb) for rgb in RGB]
    event = EventOutput(1, op, observation=ingested, position_before=0, position_after=30)
    events = [Record("events", 2, to_message(event, pixels=pixels)[1])]
    observation = Record("observation", 1, typestore().deserialize_cdr(serialize_message(camera), TOPICS["observation"]))
    return events, observation


def script_images(records):
    (call,) = build_script(records)
    return [to_rgb(image) for image in call.event.observation.images]


@pytest.mark.parametrize("with_observation_topic", [False, True])
def test_an_event_with_pixels_replays_on_its_own(with_observation_topic):
    events, observation = recorded_session(pixels=True)
    msg = events[0].msg
    assert list(msg.image_digests) == [digest(rgb) for rgb in RGB]
    assert [(i.encoding, i.step, len(i.data)) for i in msg.observation.images] == [("rgb8", 30, 180), ("rgb8", 12, 36)]
    got = script_images(events + ([observation] if with_observation_topic else []))
    assert all(np.array_equal(a, b) for a, b in zip(got, RGB)) and len(got) == 2


def test_an_event_without_pixels_takes_them_from_the_observation_topic():
    events, observation = recorded_session(pixels=False)
    msg = events[0].msg
    assert [(i.height, i.width, i.encoding, len(i.data)) for i in msg.observation.images] == [
        (6, 10, "rgb8", 0), (3, 4, "rgb8", 0)]
    assert list(msg.image_digests) == [digest(rgb) for rgb in RGB]
    got = script_images([observation] + events)
    assert all(np.array_equal(a, b) for a, b in zip(got, RGB)) and len(got) == 2
    assert events[0].msg.observation.images[0].data.size == 0  # the recorded event itself is left as recorded


def test_an_image_missing_from_a_digest_only_bag_stops_the_replay_naming_it():
    events, _ = recorded_session(pixels=False, op="generate")
    with pytest.raises(BagError) as err:
        build_script(events)
    text = str(err.value)
    assert "event seq 1 (generate): images[0] (10x6, sha256 " + digest(RGB[0])[:16] in text
    assert "is not in the bag" in text and "image.record_pixels true" in text


def test_an_observation_topic_image_of_other_pixels_does_not_stand_in():
    events, observation = recorded_session(pixels=False)
    other = observation.msg.images[0]
    other.data = other.data.copy()
    other.data[0] ^= 1
    with pytest.raises(BagError, match=r"images\[0\] .* is not in the bag"):
        build_script([observation] + events)


def test_pixels_that_do_not_match_their_digest_stop_the_replay():
    events, _ = recorded_session(pixels=True)
    image = events[0].msg.observation.images[1]
    image.data = image.data.copy()
    image.data[-1] ^= 0x80
    with pytest.raises(BagError) as err:
        build_script(events)
    assert "event seq 1 (observe): images[1] pixels have sha256" in str(err.value)
    assert f"not the recorded {digest(RGB[1])[:16]}" in str(err.value) and "corrupt" in str(err.value)


def test_digests_and_images_of_different_counts_are_a_corrupt_bag():
    events, _ = recorded_session(pixels=True)
    msg = events[0].msg
    truncated = dataclasses.replace(msg, image_digests=msg.image_digests[:1])
    with pytest.raises(BagError, match="2 images but 1 image digests"):
        build_script([Record("events", 2, truncated)])


def test_an_event_without_images_is_left_as_recorded():
    event = to_message(EventOutput(1, "observe", observation=ObservationInput(text="hi"), position_after=2))[1]
    (call,) = build_script([Record("events", 1, event)])
    assert call.event is event and list(event.image_digests) == []


@pytest.mark.parametrize("pixels", [True, False])
def test_a_tiny_vl_session_with_images_replays_exactly(pixels):
    """Needs the runtime side of #32 (the engine's image ingest). Recorded with or without pixels in its events, the
    session replays to the same events, tokens and live bytes."""
    engine = Engine(EngineConfig(model="tiny-vl", max_context=256, image_min_pixels=1024, image_max_pixels=16384))
    limits = ImageLimits()

    def fresh(outputs):
        engine.reset()
        return Session(engine, discretiser=Discretiser(bins=255, token_offset=257),
                       default_sampling=SamplingParams(temperature=1.0), emit=outputs.append, stream_chunk_tokens=4)

    outputs = []
    session = fresh(outputs)
    cameras = [Observation(text="first view", images=[camera_msg(RGB[0], "bgr8", padding=2)]),
               Observation(text="and now?", max_new_tokens=5, images=[camera_msg(RGB[1], "mono8"), camera_msg(RGB[0])])]
    for camera in cameras:
        gen = session.observe(observation_in(camera, limits))
    while gen.step():
        pass
    live = engine.live_checksum(), engine.position
    records = [Record("observation", 0, typestore().deserialize_cdr(serialize_message(c), TOPICS["observation"]))
               for c in cameras]
    records += [Record(*(lambda topic, msg: (topic, 1, msg))(*to_message(o, pixels=pixels))) for o in outputs
                if isinstance(o, (EventOutput, TokenOutput))]
    script = build_script(records)

    replayed = []
    session = fresh(replayed)
    for call in script:
        advance(session, call)
        apply(session, call, limits)
    while session.active is not None:
        session.active.step()
    assert (engine.live_checksum(), engine.position) == live
    first = next(o for o in outputs if isinstance(o, EventOutput))
    assert first.position_after - first.position_before > len(engine.tokenizer.encode("first view")) + 2  # the image's
    messages = lambda outs: [to_message(o, pixels=pixels)[1] for o in outs if isinstance(o, EventOutput)]  # noqa: E731
    assert [len(e.image_digests) for e in messages(outputs)] == [1, 2]
    assert compare_topic("events", messages(outputs), messages(replayed)).identical
    assert [o for o in replayed if isinstance(o, TokenOutput)] == [o for o in outputs if isinstance(o, TokenOutput)]


def test_the_comparison_tells_events_of_other_images_apart():
    def event(rgb, pixels=True):
        observation = observation_in(Observation(text="look", images=[camera_msg(rgb)]))
        return to_message(EventOutput(1, "observe", observation=observation, position_after=9), pixels=pixels)[1]

    other = RGB[0].copy()
    other[0, 0, 0] ^= 1
    assert compare_topic("events", [event(RGB[0])], [event(RGB[0].copy())]).identical
    differs = compare_topic("events", [event(RGB[0])], [event(other)])
    assert differs.first.fields == ["observation", "image_digests"]
    assert compare_topic("events", [event(RGB[0], False)], [event(other, False)]).first.fields == ["image_digests"]
