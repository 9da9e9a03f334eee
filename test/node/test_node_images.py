"""Camera observations the node must refuse, through real rclpy/DDS on the tiny (text-only) model: on
~/observation and as a ~/generate goal, each answered with INVALID_ARGUMENT and its reason (an event, the error
chunk, the goal's result), the live state and the capsules unchanged."""
import itertools

import pytest
from conftest import wait_for
from image_helpers import BAD_IMAGES, MAX_RAW_BYTES, camera_msg, rgb_pixels
from sensor_msgs.msg import Image as ImageMsg

from flashrt_ros.action import Generate
from flashrt_ros.msg import ErrorCode, Observation, StateEvent, TokenChunk
from flashrt_ros.ros_convert import time_to_ns
from flashrt_ros.session import ObservationInput

NODE_PARAMS = {"image.max_raw_bytes": MAX_RAW_BYTES, "image.max_observation_pixels": 50}
STAMPS = itertools.count(1000)


def on_engine(node, fn):
    return node.worker.submit(fn).result(20.0)


def engine_state(node):
    return on_engine(node, lambda s: (s.engine.live_checksum(), s.engine.position,
                                      [(c.id, c.checksum) for c in s.engine.capsules()]))


@pytest.fixture(scope="module")
def topics(node_and_client):
    node, client = node_and_client
    events, tokens = client.subscribe(StateEvent, "events"), client.subscribe(TokenChunk, "tokens")
    publisher = client.publisher(Observation, "observation")
    wait_for(lambda: publisher.get_subscription_count() > 0
             and node.count_subscribers(f"{node.get_fully_qualified_name()}/events") > 0, what="connections")
    on_engine(node, lambda s: s.observe(ObservationInput(text="a table with a cup")))
    on_engine(node, lambda s: s.snapshot(capsule_id="seen"))
    return publisher, events, tokens


def publish(publisher, images, max_new_tokens=3, text="what is there?"):
    msg = Observation(text=text, max_new_tokens=max_new_tokens, images=images)
    msg.header.stamp.nanosec = stamp = next(STAMPS)
    publisher.publish(msg)
    return stamp


def event_of(events, stamp):
    return wait_for(lambda: next((e for e in events if time_to_ns(e.observation.header.stamp) == stamp), None),
                    20.0, f"the event of observation {stamp}")


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_an_unreadable_image_on_the_topic_is_refused_with_its_reason(node_and_client, topics, case):
    node, _ = node_and_client
    publisher, events, tokens = topics
    before = engine_state(node)
    image, reason = BAD_IMAGES[case]
    stamp = publish(publisher, [camera_msg(rgb_pixels(2, 2)), image])
    event = event_of(events, stamp)
    assert (event.op, event.success, event.error_code) == ("observation_refused", False, ErrorCode.INVALID_ARGUMENT)
    assert reason.replace("images[0]", "images[1]") in event.message
    assert event.observation.text == "what is there?" and list(event.observation.images) == []
    chunk = wait_for(lambda: next((c for c in tokens if time_to_ns(c.observation_stamp) == stamp), None), 20.0,
                     "the error chunk")
    assert (chunk.final, chunk.finish_reason, list(chunk.token_ids), chunk.request_id) == (
        True, "error", [], event.request_id)
    assert engine_state(node) == before


def test_images_over_the_observation_pixel_budget_are_refused(node_and_client, topics):
    node, _ = node_and_client
    publisher, events, _ = topics
    before = engine_state(node)
    view = ImageMsg(height=5, width=6, encoding="mono8", step=6, data=bytes(30))
    event = event_of(events, publish(publisher, [view, view], max_new_tokens=0))
    assert (event.op, event.error_code) == ("observation_refused", ErrorCode.INVALID_ARGUMENT)
    assert "take 60 pixels once resized (6x5, 6x5), over image.max_observation_pixels=50" in event.message
    assert engine_state(node) == before


def test_a_goal_with_an_unreadable_image_is_aborted_with_its_reason(node_and_client, topics):
    node, client = node_and_client
    _, events, _ = topics
    before = engine_state(node)
    image, reason = BAD_IMAGES["unsupported encoding"]
    goal = Generate.Goal(observation=Observation(text="describe", max_new_tokens=4, images=[image]))
    goal.observation.header.stamp.nanosec = stamp = next(STAMPS)
    handle = client.send_goal(client.action_client(Generate, "generate"), goal, [])
    response = client.result(handle)
    result = response.result
    assert (result.success, result.error_code, result.finish_reason) == (False, ErrorCode.INVALID_ARGUMENT, "error")
    assert reason in result.message and response.status == 6  # GoalStatus.STATUS_ABORTED
    assert event_of(events, stamp).op == "observation_refused"
    assert engine_state(node) == before


def test_a_readable_image_on_a_model_without_a_vision_tower_is_refused(node_and_client, topics):
    """Needs the engine side of #32 (V2): the engine refuses images it has no tower for, before anything moves."""
    node, _ = node_and_client
    publisher, events, _ = topics
    before = engine_state(node)
    event = event_of(events, publish(publisher, [camera_msg(rgb_pixels(4, 4))], max_new_tokens=0))
    assert (event.op, event.success, event.error_code) == ("observe", False, ErrorCode.INVALID_ARGUMENT)
    assert engine_state(node) == before
