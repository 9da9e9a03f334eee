"""Session bags without an engine or a ROS graph: storage, header, embedded definitions, comparison
rules and the checks that refuse a bag that cannot be replayed."""
import json
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from rosbags.highlevel import AnyReader
from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime
from rosbags.rosbag2 import Writer

from flashrt_ros.bag.bagfile import TOPICS, BagError, BagHeader, BagWriter, Record, adopt_bag, read_bag
from flashrt_ros.bag.compare import compare, compare_topic
from flashrt_ros.bag.replay import to_message
from flashrt_ros.bag.script import build_script
from flashrt_ros.bag.storage import ros_distro
from flashrt_ros.bag.typestore import typestore
from flashrt_ros.session import ActionOutput, EventOutput, ObservationInput, TokenOutput

HEADER = BagHeader(node="/robot/flashrt", fingerprint="ab" * 32,
                   parameters={"model": "tiny", "max_context": 512, "sampling.top_p": 1.0},
                   package_version="1.2.3")


def observation(text="hi", max_new_tokens=2, stamp_ns=5, priority=0):
    types = typestore().types
    stamp = types["builtin_interfaces/msg/Time"](sec=0, nanosec=stamp_ns)
    return types[TOPICS["observation"]](
        header=types["std_msgs/msg/Header"](stamp=stamp, frame_id=""), text=text,
        token_ids=np.array([1, 2], np.int32), values=np.array([0.5], np.float32),
        max_new_tokens=max_new_tokens, priority=priority, snapshot_label="", images=[], json_schema="", grammar="",
        output_type="")


def event(seq, op="observe", before=0, after=3, **fields):
    return to_message(EventOutput(seq, op, position_before=before, position_after=after, **fields))[1]


def tokens(request_id, ids, position, final=False, reason=""):
    return to_message(TokenOutput(request_id, ids, "x", position, final, reason, 5))[1]


def action(values, ids=(300,)):
    return to_message(ActionOutput(1, 1, len(values), list(values), list(ids), 5))[1]


def session_messages():
    return [("observation", 10, observation()), ("events", 20, event(1)),
            ("tokens", 30, tokens(1, [7, 8], 5, True, "length")), ("action", 40, action([0.25]))]


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_a_bag_reads_back_with_its_header_and_messages(tmp_path, storage):
    with BagWriter(tmp_path / "bag", HEADER, storage) as bag:
        for topic, stamp, msg in reversed(session_messages()):
            bag.write(topic, stamp, msg)
    header, records = read_bag(tmp_path / "bag")
    assert header == HEADER
    assert [(r.topic, r.stamp) for r in records] == [(t, s) for t, s, _ in session_messages()]
    assert records[2].msg.token_ids.tolist() == [7, 8] and records[2].msg.finish_reason == "length"
    assert records[0].msg.text == "hi" and records[3].msg.values.tolist() == [0.25]


def test_other_tools_decode_the_bag_from_its_embedded_definitions(tmp_path):
    """rosbags' AnyReader (as Foxglove and `ros2 bag play`) learns the flashrt types from the bag."""
    with BagWriter(tmp_path / "bag", HEADER) as bag:
        for topic, stamp, msg in session_messages():
            bag.write(topic, stamp, msg)
    with AnyReader([tmp_path / "bag"]) as reader:
        assert {c.topic for c in reader.connections} == {f"/robot/flashrt/{t}" for t in TOPICS}
        assert all("MSG: std_msgs/Header" in c.msgdef.data for c in reader.connections)
        decoded = {c.topic: reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages()}
    assert decoded["/robot/flashrt/tokens"].token_ids.tolist() == [7, 8]
    assert decoded["/robot/flashrt/events"].op == "observe"


def test_a_bag_without_a_flashrt_header_is_refused(tmp_path):
    with Writer(tmp_path / "plain", version=9) as writer:
        writer.add_connection("/flashrt/events", TOPICS["events"], typestore=typestore())
    with pytest.raises(BagError, match="no flashrt_ros header"):
        read_bag(tmp_path / "plain")


@pytest.mark.parametrize("recorded,why", [("1", "lack the request fields"), ("2", "`tier` and `wait`"),
                                          ("3", "`images` and `image_digests`"), ("99", "the only one")])
def test_a_bag_of_another_format_is_refused_with_the_reason(recorded, why):
    data = HEADER.to_custom_data()
    assert BagHeader.from_custom_data(data) == HEADER
    data["flashrt_ros.format"] = recorded
    with pytest.raises(BagError) as err:
        BagHeader.from_custom_data(data)
    assert f"bag format {recorded}" in str(err.value) and why in str(err.value)


def test_adopting_a_bag_without_the_node_topics_is_refused(tmp_path):
    with BagWriter(tmp_path / "other_node", BagHeader(node="/elsewhere/flashrt", fingerprint="x")) as bag:
        bag.write("events", 1, event(1))
    with pytest.raises(BagError, match="no flashrt_ros topics of /robot/flashrt"):
        adopt_bag(tmp_path / "other_node", tmp_path / "adopted", HEADER)
    assert not (tmp_path / "adopted").exists()


def test_an_existing_bag_is_never_overwritten(tmp_path):
    (tmp_path / "bag").mkdir()
    with pytest.raises(BagError, match="exists"):
        with BagWriter(tmp_path / "bag", HEADER):
            pass


def test_action_values_may_differ_by_the_tolerance_and_token_ids_never():
    recorded = {"action": [action([0.25, -0.5])]}
    close = {"action": [action([0.2501, -0.5001])]}
    assert not compare_topic("action", recorded["action"], close["action"]).identical
    assert compare_topic("action", recorded["action"], close["action"], tolerance=1e-3).identical
    other_ids = [action([0.25, -0.5], ids=(301,))]
    result = compare_topic("action", recorded["action"], other_ids, tolerance=1.0)
    assert result.mismatched == 1 and result.first.fields == ["token_ids"]
    assert compare_topic("tokens", [tokens(1, [7], 3)], [tokens(1, [7], 3)], tolerance=1.0).identical


def test_timing_fields_are_ignored_and_missing_or_extra_messages_counted():
    slow = to_message(EventOutput(1, "observe", position_after=3, latency_ms=99.0), stamp_ns=123)[1]
    results = {r.topic: r for r in compare(
        {"events": [event(1), event(2)], "tokens": [tokens(1, [7], 3)]},
        {"events": [slow], "tokens": [tokens(1, [7], 3), tokens(2, [9], 4)]})}
    assert (results["events"].matched, results["events"].missing) == (1, 1)
    assert results["events"].first.index == 1 and results["events"].first.replayed is None
    assert (results["tokens"].matched, results["tokens"].extra) == (1, 1)
    assert results["action"].identical


@pytest.mark.parametrize("events,observations,reason", [
    ([], 1, "no ~/events"),
    ([event(2, before=0)], 1, "does not start at a fresh node"),
    ([event(1, before=4)], 1, "does not start at a fresh node"),
    ([event(1), event(3, "snapshot", 3, 3)], 1, "seq jumps from 1 to 3"),
    ([event(1), event(2, "teleport", 3, 3)], 1, "unknown op 'teleport'"),
])
def test_bags_that_cannot_be_replayed_are_refused(events, observations, reason):
    records = [Record("events", i, e) for i, e in enumerate(events)]
    records += [Record("observation", 100 + i, observation()) for i in range(observations)]
    with pytest.raises(BagError, match=reason):
        build_script(records)


def test_each_call_is_its_event_and_a_preempt_belongs_to_the_call_after_it():
    """Events carry what they ingested, so the script needs no ~/observation messages (a lost one cannot shift
    the others); the 'preempt' an urgent observe emits first is part of that observe (live pacing waits for the
    events before it, not for its own preempt)."""
    go, stop = ObservationInput(text="go", max_new_tokens=4), ObservationInput(text="STOP", priority=1)
    records = [Record("events", 2, event(1, observation=go, request_id=1)),
               Record("events", 5, event(2, "preempt", 3, 3, running_request_id=1, result_id="interrupted-1")),
               Record("events", 7, event(3, before=3, after=5, observation=stop, running_request_id=1))]
    script = build_script(records)
    assert [(c.op, c.event.observation.text, c.running, c.first_seq) for c in script] == [
        ("observe", "go", 0, 1), ("observe", "STOP", 1, 2)]


EVENTS_QOS = Qos(QosHistory.KEEP_LAST, 100, QosReliability.RELIABLE, QosDurability.TRANSIENT_LOCAL,
                 QosTime(0, 0), QosTime(0, 0), QosLiveliness.AUTOMATIC, QosTime(0, 0), False)


def ros_type_hash(msgtype: str) -> str:
    """The RIHS01 hash that rosidl generated for ``msgtype`` (share/<pkg>/msg/<Name>.json), computed by ROS
    itself and not by rosbags."""
    package, _, name = msgtype.split("/")
    found = sorted(Path(sys.prefix, "share", package, "msg").glob(f"{name}.json"))
    if not found:
        pytest.skip(f"no rosidl type description for {msgtype} installed")
    description = json.loads(found[0].read_text())
    return next(h["hash_string"] for h in description["type_hashes"] if h["type_name"] == msgtype)


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_bags_carry_qos_type_hash_and_distro_as_rosbag2_writes_them(tmp_path, storage):
    qos = {"events": [EVENTS_QOS]}
    with BagWriter(tmp_path / "bag", HEADER, storage, lambda topic: qos.get(topic, [])) as bag:
        for topic, stamp, msg in session_messages():
            bag.write(topic, stamp, msg)
    metadata = yaml.safe_load((tmp_path / "bag" / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    assert metadata["ros_distro"] == ros_distro() != "rosbags"
    topics = {t["topic_metadata"]["name"]: t["topic_metadata"] for t in metadata["topics_with_message_count"]}
    assert topics["/robot/flashrt/events"]["offered_qos_profiles"][0]["durability"] == "transient_local"
    for name, meta in topics.items():
        assert meta["type_description_hash"] == ros_type_hash(meta["type"]), name
    with AnyReader([tmp_path / "bag"], default_typestore=None) as reader:  # types only from the bag itself
        events_conn = next(c for c in reader.connections if c.topic == "/robot/flashrt/events")
        assert events_conn.ext.offered_qos_profiles == [EVENTS_QOS]
        decoded = [reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages()]
    assert sorted(type(m).__name__ for m in decoded) == sorted(
        ["flashrt_ros__msg__Observation", "flashrt_ros__msg__StateEvent", "flashrt_ros__msg__TokenChunk",
         "flashrt_ros__msg__ActionChunk"])
    if storage == "sqlite3":
        with sqlite3.connect(tmp_path / "bag" / "bag.db3") as db:
            assert db.execute("SELECT ros_distro FROM schema").fetchone()[0] == ros_distro()


def test_mcap_channels_decode_with_foxglove_readers_and_carry_the_type_hash(tmp_path):
    """mcap + mcap-ros2-support (independent of rosbags): the channel metadata rosbag2 writes, and the
    messages decoded from the embedded schemas."""
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    with BagWriter(tmp_path / "bag", HEADER, "mcap", lambda topic: [EVENTS_QOS] if topic == "events" else []) as bag:
        for topic, stamp, msg in session_messages():
            bag.write(topic, stamp, msg)
    (path,) = (tmp_path / "bag").glob("*.mcap")
    with path.open("rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        channels = {c.topic: c for c in reader.get_summary().channels.values()}
        decoded = {channel.topic: message for _, channel, _, message in reader.iter_decoded_messages()}
        records = {m.name: m.metadata for m in reader.iter_metadata()}
    for topic, channel in channels.items():
        schema = reader.get_summary().schemas[channel.schema_id]
        assert channel.metadata["topic_type_hash"] == ros_type_hash(schema.name), topic
    assert "transient_local" in channels["/robot/flashrt/events"].metadata["offered_qos_profiles"]
    assert list(decoded["/robot/flashrt/tokens"].token_ids) == [7, 8]
    assert decoded["/robot/flashrt/observation"].text == "hi"
    assert f"ros_distro: {ros_distro()}" in records["rosbag2"]["serialized_metadata"]
