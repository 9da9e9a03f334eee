"""A camera observation end to end on the CPU (the tiny-vl preset: tiny plus a two-block vision tower), through real
rclpy/DDS: an Observation carrying a padded bgr8 Image produces tokens, its event records the image's digest (pixels
left out: image.record_pixels false), and the bag of that session replays offline token for token, taking the
pixels from the bag's ~/observation; without that topic the replay refuses, naming the missing image.

Needs the runtime side of issue #32 (the vision preprocessing and the engine's image ingest)."""
import time

from conftest import wait_for
from image_helpers import camera_msg, rgb_pixels

from flashrt_ros.action import Generate
from flashrt_ros.bag import cli
from flashrt_ros.bag.bagfile import BagWriter, read_bag
from flashrt_ros.bag.record import Recorder, fetch_header
from flashrt_ros.image_convert import digest
from flashrt_ros.msg import Observation, StateEvent, TokenChunk

NODE_PARAMS = {"model": "tiny-vl", "image.min_pixels": 1024, "image.max_pixels": 16384, "image.record_pixels": False}
TEXT = "What is on the table?"


def test_an_image_observation_generates_and_its_bag_replays_identically(node_and_client, tmp_path, capsys):
    node, client = node_and_client
    target = node.get_fully_qualified_name()
    bag = tmp_path / "vision"
    recorder = Recorder(client.node, bag, fetch_header(client.node, target, 30.0))
    tokens, events = client.subscribe(TokenChunk, "tokens"), client.subscribe(StateEvent, "events")
    publisher = client.publisher(Observation, "observation")
    wait_for(lambda: recorder.connected() and publisher.get_subscription_count() >= 2, 20.0, "node and recorder")
    rgb = rgb_pixels(48, 80, seed=3)
    publisher.publish(Observation(text=TEXT, max_new_tokens=6, images=[camera_msg(rgb, "bgr8", padding=5)]))
    final = wait_for(lambda: next((c for c in tokens if c.final), None), 120.0, "the final chunk")
    assert final.finish_reason == "length" and sum(len(c.token_ids) for c in tokens) == 6
    event = wait_for(lambda: next((e for e in events if e.op == "observe"), None), 20.0, "the observe event")
    assert event.success and list(event.image_digests) == [digest(rgb)]
    image = event.observation.images[0]
    assert (image.height, image.width, image.encoding, len(image.data)) == (48, 80, "rgb8", 0)
    text_tokens = len(node.worker.submit(lambda s: s.engine.tokenizer.encode(TEXT)).result(10))
    assert event.position_after - event.position_before > text_tokens + 2  # the image took its tokens
    time.sleep(1.0)  # let DDS deliver the last messages to the recorder
    recorder.close()

    assert cli.main(["replay", str(bag), "--offline"]) == cli.IDENTICAL
    assert "RESULT: identical" in capsys.readouterr().out

    header, records = read_bag(bag)
    without = tmp_path / "without_observations"
    with BagWriter(without, header) as writer:
        for record in records:
            if record.topic != "observation":
                writer.write(record.topic, record.stamp, record.msg)
    assert cli.main(["replay", str(without), "--offline"]) == cli.BAD_INPUT
    err = capsys.readouterr().err
    assert "event seq 1 (observe): images[0] (80x48" in err and "is not in the bag" in err


def test_a_goal_with_an_image_generates(node_and_client):
    _, client = node_and_client
    goal = Generate.Goal(observation=Observation(text=TEXT, max_new_tokens=4,
                                                 images=[camera_msg(rgb_pixels(32, 32, seed=4), "mono8")]))
    response = client.result(client.send_goal(client.action_client(Generate, "generate"), goal, []), 120.0)
    result = response.result
    assert (result.success, result.finish_reason, len(result.token_ids)) == (True, "length", 4), result.message
