"""FlashRTClient against a real flashrt node (tiny model) in a subprocess, over loopback DDS."""
import json
import time
from pathlib import Path

import pytest
import torch
from rclpy.node import Node
from sensor_msgs.msg import Image

from flashrt_ros.client import ClientError, FlashRTClient
from flashrt_ros.demo import local_node
from flashrt_ros.msg import ErrorCode, Observation

MAX_CONTEXT = 256


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """``(client, process)`` of a node started in a subprocess."""
    log = tmp_path_factory.mktemp("client") / "node.log"
    with local_node(log, model="tiny", max_context=MAX_CONTEXT, autostart=True, stream_chunk_tokens=2) as running:
        yield running


@pytest.fixture(scope="module")
def client(node):
    return node[0]


@pytest.fixture
def fresh(client):
    """Start every test from an empty context with no capsules."""
    assert client.reset().success
    for capsule in client.list().capsules:
        assert client.drop(capsule.id).success
    return client


def test_service_helpers_return_the_node_responses(fresh):
    fresh.observe("The robot sees a cup.", 4)
    snap = fresh.snapshot("seen cup", capsule_id="cup")
    assert snap.success and snap.capsule.id == "cup" and snap.capsule.label == "seen cup"
    listing = fresh.list()
    assert [c.id for c in listing.capsules] == ["cup"]
    assert listing.live_position == snap.capsule.position

    refused = fresh.snapshot(capsule_id="no/slashes")  # a refusal is a response, not an exception
    assert not refused.success and refused.error_code == ErrorCode.INVALID_CAPSULE_ID
    assert not fresh.restore("missing").success

    fork = fresh.fork("cup", capsule_id="cup2")
    assert fork.success and fork.capsule.parent == "cup"
    assert fork.capsule.shared_bytes == fork.capsule.bytes > 0     # a fork shares every block of its source
    assert fresh.drop("cup2").freed_bytes == 0                      # ... so dropping it frees nothing
    assert [c.id for c in fresh.list().capsules] == ["cup"]


def test_observe_collects_the_stream_until_its_final_chunk(fresh):
    stream = fresh.observe("Hello robot.", 7)
    assert stream.final and stream.finish_reason in ("length", "stop")
    assert 0 < len(stream.token_ids) <= 7
    assert len(stream.token_ids) == 7 or stream.finish_reason == "stop"
    # chunks of 2 tokens were joined in order: the position is where the last one ended
    assert stream.position == fresh.list().live_position
    assert stream.text


def test_generate_action_matches_the_topic_stream_from_the_same_capsule(fresh):
    fresh.observe("The drawer is open.", 2)
    base = fresh.snapshot("base").capsule
    streamed = fresh.observe(" Next", 6)
    assert fresh.restore(base.id).success
    result = fresh.generate(" Next", 6)
    assert result.success and result.error_code == ErrorCode.OK
    assert list(result.token_ids) == streamed.token_ids
    assert result.position == streamed.position


def test_generate_reports_refusals_with_an_error_code(fresh):
    result = fresh.generate("word " * (2 * MAX_CONTEXT), 4)
    assert not result.success and result.error_code == ErrorCode.CONTEXT_OVERFLOW
    assert fresh.list().live_position == 0


def test_a_refused_observation_ends_its_stream_at_once_with_an_error(fresh):
    fresh.observe("The robot sees a cup.", 2)
    position = fresh.list().live_position
    start = time.monotonic()
    refused = fresh.observe("word " * (2 * MAX_CONTEXT), 4, timeout=20.0)  # does not fit the context
    assert time.monotonic() - start < 10.0  # answered, not timed out
    assert refused.final and refused.finish_reason == "error" and refused.token_ids == []
    assert refused.position == position == fresh.list().live_position  # nothing was ingested
    assert fresh.observe(" Next", 2).request_id == refused.request_id + 1


def test_node_subprocesses_compute_on_one_thread(node):
    """conftest sets OMP_NUM_THREADS=1 for the test process and the node processes it starts."""
    environ = Path(f"/proc/{node[1].pid}/environ")
    if not environ.exists():
        pytest.skip("needs Linux /proc to read the node's environment")
    variables = dict(v.split("=", 1) for v in environ.read_bytes().decode().split("\0") if "=" in v)
    assert variables.get("OMP_NUM_THREADS") == "1"
    assert torch.get_num_threads() == 1


def test_observe_takes_a_constraint_and_images(fresh):
    """The observation's constraint and images travel with it: a JSON-schema answer parses as what the schema
    says; an image sent to tiny (no vision tower) is refused, its stream one empty final error chunk."""
    answer = fresh.observe("A number: ", 12, json_schema='{"type": "integer"}')
    assert answer.finish_reason in ("stop", "length") and isinstance(json.loads(answer.text), int), answer
    frame = Image(height=2, width=2, encoding="rgb8", step=6, data=bytes(12))
    refused = fresh.observe("look", 4, images=[frame])
    assert refused.finish_reason == "error" and refused.token_ids == []


def test_resumed_stream_is_found_by_its_request_id(fresh):
    fresh.observe("Count the cups.", 1)
    base = fresh.snapshot("base").capsule
    prompt, whole = _eos_free(fresh, base, 40)
    assert fresh.restore(base.id).success

    stamp = fresh.publish(fresh.observation(prompt, max_new_tokens=40))
    assert len(fresh.wait_tokens(stamp_ns=stamp, min_tokens=2).token_ids) >= 2
    urgent = fresh.observe("Stop!", 2, priority=Observation.PRIORITY_URGENT)
    interrupted = fresh.wait_tokens(stamp_ns=stamp)
    assert interrupted.finish_reason == "preempted"
    assert urgent.request_id != interrupted.request_id

    resume = fresh.resume()
    assert resume.success and resume.remaining_tokens == 40 - len(interrupted.token_ids)
    resumed = fresh.wait_tokens(request_id=resume.request_id)
    assert interrupted.token_ids + resumed.token_ids == whole.token_ids


def _eos_free(client, base, n):
    """A prompt whose greedy continuation from ``base`` runs ``n`` tokens without an end-of-sequence
    token (the tiny model's random weights emit one now and then), and that continuation."""
    for prompt in (" One, two,", " Then", " Next:", " And"):
        assert client.restore(base.id).success
        whole = client.observe(prompt, n)
        if whole.finish_reason == "length":
            return prompt, whole
    pytest.fail("every prompt hit end-of-sequence")


def test_absent_node_raises_client_error(client):
    other = FlashRTClient(Node("flashrt_absent_probe", context=client.node.context), ns="/nobody", timeout=0.5)
    try:
        with pytest.raises(ClientError, match="not available"):
            other.snapshot()
        with pytest.raises(ClientError, match="final chunk"):
            other.wait_tokens(request_id=1, timeout=0.2)
    finally:
        other.close()
        other.node.destroy_node()
