"""Record a real session of a tiny-model flashrt node with ``flashrt_bag record``, replay it offline
and live, and check that the replay tells a faithful recording from a tampered, foreign or broken one.

The recorded session covers observations with generation, a snapshot taken with an observation's
``snapshot_label``, an explicit snapshot, a rollback, a fork that becomes live, an observation with
continuous values (an action chunk), a refused observation that asked for tokens (its stream ends
with an ``error`` chunk), an urgent observation interrupting a generation and the resume of the
interrupted stream, a refused restore and a reset. Its operations run while no generation is
running (the interrupt arrives before the first token of the interrupted request), so a live replay
can reproduce it exactly. A second recording places a snapshot and a rollback mid-generation,
which offline replay reproduces at the same token boundary.
"""
import json
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import rclpy
from conftest import TINY_PARAMS, running_node, wait_for
from rosbags.rosbag2 import StoragePlugin, Writer

from flashrt_ros.bag.bagfile import TOPICS, BagWriter, read_bag
from flashrt_ros.bag.cli import main
from flashrt_ros.bag.script import build_script
from flashrt_ros.bag.typestore import typestore
from flashrt_ros.action import Generate
from flashrt_ros.bt_planner import run_planner
from flashrt_ros.client import FlashRTClient
from lifecycle_msgs.msg import Transition
from flashrt_ros.msg import Observation
from flashrt_ros.runtime import Engine

ROOT = Path(__file__).resolve().parents[2]
URGENT = Observation.PRIORITY_URGENT
LONG_TASK = " Describe every object on the table, its colour and where it stands." * 3


@contextmanager
def recorded(ros_context, tmp_path: Path, namespace: str):
    """A fresh node in ``namespace``, a client for it and ``flashrt_bag record`` running on it.

    Yields ``(client, bag_path)``; on exit the recorder gets Ctrl-C and must close the bag cleanly.
    """
    bag = tmp_path / f"{namespace.strip('/')}_bag"
    with running_node(ros_context, namespace, **TINY_PARAMS) as node:
        target = node.get_fully_qualified_name()
        client = FlashRTClient(rclpy.create_node("bag_test_client", context=ros_context), ns=target)
        client.wait_ready(60.0)
        recorder = subprocess.Popen(
            [sys.executable, "-m", "flashrt_ros.bag.cli", "record", "--node", target, "-o", str(bag)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # a shell's background job ignores SIGINT, and a child inheriting that would never see the Ctrl-C below
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            lines = []  # the recorder says "recording ..." once it is subscribed (logs may come first)
            while not (lines and lines[-1].startswith("recording")):
                lines.append(recorder.stdout.readline())
                assert lines[-1], "".join(lines)  # EOF: the recorder died
            wait_for(lambda: client.node.count_subscribers(f"{target}/observation") >= 2, 20.0,
                     "the recorder to subscribe to ~/observation")
            yield client, bag
            time.sleep(1.0)  # let DDS deliver the session's last messages to the recorder
        finally:
            recorder.send_signal(signal.SIGINT)
            output = recorder.communicate(timeout=60)[0]
            client.close()
            client.node.destroy_node()
        assert recorder.returncode == 0, output


def session(client: FlashRTClient) -> None:
    """The scripted session of the main recording: every operation runs while no generation is
    running, except the interrupt, which lands before the first token of the interrupted request."""
    client.observe("The robot sees a red cup.", 6, snapshot_label="cup")
    cup = next(c.id for c in client.list().capsules if c.label == "cup")
    assert client.snapshot(label="after first").success
    client.observe(" Plan:", 6)
    assert client.rollback(capsule_id=cup).success
    assert client.fork(cup, capsule_id="alt", switch_to=True).success
    client.observe(max_new_tokens=4, values=[0.25, -0.5])
    refused = client.observe(token_ids=[100_000], max_new_tokens=3)  # out of the vocabulary
    assert (refused.finish_reason, refused.token_ids) == ("error", [])
    # Both urgent: queued in order, the second arrives while the first is still being ingested and
    # preempts it before its first token (a point a live replay reproduces exactly).
    long = client.publish(client.observation(LONG_TASK, max_new_tokens=10, priority=URGENT))
    stop = client.publish(client.observation(" Stop!", max_new_tokens=4, priority=URGENT))
    assert client.wait_tokens(stamp_ns=long).finish_reason == "preempted"
    client.wait_tokens(stamp_ns=stop)
    resumed = client.resume()
    assert resumed.success
    client.wait_tokens(request_id=resumed.request_id)
    assert not client.restore("missing").success
    assert client.reset().success


@pytest.fixture(scope="module")
def session_bag(ros_context, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bags")
    with recorded(ros_context, tmp, "/t_bag_rec") as (client, bag):
        session(client)
    return bag


def replay(*args) -> int:
    return main(["replay", *map(str, args)])


def report_rows(out: str) -> dict[str, list[str]]:
    """The report's count rows: topic -> [matched, mismatched, missing, extra]."""
    return {words[0]: words[1:] for words in map(str.split, out.splitlines())
            if words and words[0] in ("tokens", "action", "events")}


def test_recorded_bag_holds_the_session_and_its_header(session_bag):
    header, records = read_bag(session_bag)
    assert header.node == "/t_bag_rec/flashrt" and len(header.fingerprint) >= 16
    assert header.parameters["model"] == "tiny" and header.parameters["stream_chunk_tokens"] == 4
    ops = [r.msg.op for r in records if r.topic == "events"]
    assert ops == ["observe", "snapshot", "snapshot", "observe", "rollback", "fork", "observe", "observe",
                   "observe", "preempt", "observe", "resume", "restore", "reset"]
    assert sum(r.topic == "observation" for r in records) == 6
    errors = [r.msg for r in records if r.topic == "tokens" and r.msg.finish_reason == "error"]
    assert len(errors) == 1 and errors[0].final and len(errors[0].token_ids) == 0
    script = build_script(records)
    long, interrupt = [call for call in script if call.op == "observe"][-2:]
    # it preempted the long request before its first token: at the position where that request started
    assert interrupt.running == long.event.request_id > 0
    assert interrupt.event.position_before == long.event.position_after
    assert interrupt.event.observation.text == " Stop!"  # the event carries what it ingested
    assert any(r.topic == "action" for r in records)
    assert (session_bag / "metadata.yaml").read_text().count("storage_identifier: mcap") == 1


def test_offline_replay_is_identical(session_bag, capsys):
    assert replay(session_bag, "--offline") == 0
    out = capsys.readouterr().out
    assert "RESULT: identical" in out
    _, records = read_bag(session_bag)
    for topic, counts in report_rows(out).items():
        assert counts == [str(sum(r.topic == topic for r in records)), "0", "0", "0"]


def test_live_replay_into_a_fresh_node_is_identical(session_bag, ros_context, tmp_path, capsys):
    with running_node(ros_context, "/t_bag_live", **TINY_PARAMS):
        answers = tmp_path / "answers"
        assert replay(session_bag, "--live", "--node", "/t_bag_live/flashrt", "-o", answers) == 0
    out = capsys.readouterr().out
    assert "RESULT: identical" in out and "note:" not in out
    _, live = read_bag(answers)
    _, recorded = read_bag(session_bag)
    assert [r.msg.op for r in live if r.topic == "events"] == [r.msg.op for r in recorded if r.topic == "events"]


def copy_bag(source: Path, target: Path, change) -> Path:
    """Copy a bag message by message through ``change(header, records) -> (header, records)``."""
    header, records = change(*read_bag(source))
    with BagWriter(target, header) as bag:
        for record in records:
            bag.write(record.topic, record.stamp, record.msg)
    return target


def test_a_tampered_token_is_reported_as_exactly_that_message(session_bag, tmp_path, capsys):
    index = 2  # the third ~/tokens message of the recording

    def tamper(header, records):
        chunk = [r for r in records if r.topic == "tokens"][index].msg
        chunk.token_ids = np.array([(int(chunk.token_ids[0]) + 1) % 512, *chunk.token_ids[1:]], np.int32)
        return header, records

    _, original = read_bag(session_bag)
    want = [r for r in original if r.topic == "tokens"][index].msg.token_ids.tolist()
    tampered = copy_bag(session_bag, tmp_path / "tampered", tamper)
    assert replay(tampered, "--offline") == 1
    out = capsys.readouterr().out
    rows = report_rows(out)
    total = sum(r.topic == "tokens" for r in original)
    assert rows["tokens"] == [str(total - 1), "1", "0", "0"]
    assert rows["events"][1:] == ["0", "0", "0"] and rows["action"][1:] == ["0", "0", "0"]
    assert f"first divergence on ~/tokens: message #{index} differs in token_ids" in out
    assert f"recorded token_ids: {[(want[0] + 1) % 512, *want[1:]]}" in out
    assert f"replayed token_ids: {want}" in out
    assert out.rstrip().endswith("RESULT: diverged")


def test_another_model_is_refused_unless_allowed(session_bag, tmp_path, capsys):
    def other_model(header, records):
        return header.__class__(header.node, "0" * 64, header.parameters, header.package_version), records

    foreign = copy_bag(session_bag, tmp_path / "foreign", other_model)
    assert replay(foreign, "--offline") == 2
    err = capsys.readouterr().err
    assert "fingerprint differs" in err and "--allow-model-change" in err and "Traceback" not in err
    assert replay(foreign, "--offline", "--allow-model-change") == 0
    assert "note: model fingerprint differs" in capsys.readouterr().out


def test_a_ros2_bag_record_bag_is_adopted_with_the_header_of_the_node(session_bag, ros_context, tmp_path,
                                                                     capsys, monkeypatch):
    """`ros2 bag record` writes the topics (among others) but no header: `adopt` reads it from the node."""
    header, records = read_bag(session_bag)
    plain = tmp_path / "ros2_bag"
    with Writer(plain, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        other = writer.add_connection("/chatter", "std_msgs/msg/String", typestore=typestore())
        writer.write(other, 1, typestore().serialize_cdr(typestore().types["std_msgs/msg/String"]("hi"),
                                                          "std_msgs/msg/String"))
        connections = {topic: writer.add_connection(header.topic(topic), msgtype, typestore=typestore())
                       for topic, msgtype in TOPICS.items()}
        for r in records:
            writer.write(connections[r.topic], r.stamp, typestore().serialize_cdr(r.msg, TOPICS[r.topic]))
    adopted = tmp_path / "adopted"
    with running_node(ros_context, "/t_bag_rec", **TINY_PARAMS) as node:
        live_fingerprint = node.worker.submit(lambda s: s.engine.fingerprint).result(10)
        with monkeypatch.context() as patch:  # the header comes from the node: no second engine is built
            patch.setattr(Engine, "__init__", refuse_to_build_an_engine)
            assert main(["adopt", str(plain), "--node", header.node, "-o", str(adopted)]) == 0
    assert f"wrote {len(records)} messages" in capsys.readouterr().out
    assert read_bag(adopted)[0] == header and header.fingerprint == live_fingerprint
    assert replay(adopted, "--offline") == 0


def refuse_to_build_an_engine(*args, **kwargs):
    raise AssertionError("the bag tools built an Engine")


def test_recording_a_node_without_an_engine_fails_clearly(ros_context, tmp_path, capsys, monkeypatch):
    """An unconfigured node has no engine, hence no fingerprint: exit 2, no bag. The recorder asks the node's
    lifecycle state instead of waiting out a fingerprint that cannot come, so the timeout only bounds discovery
    (3 s was too short for that on a loaded machine: "does not answer its parameter services")."""
    monkeypatch.setattr(Engine, "__init__", refuse_to_build_an_engine)
    with running_node(ros_context, "/t_bag_idle", **{**TINY_PARAMS, "autostart": False}):
        code = main(["record", "--node", "/t_bag_idle/flashrt", "-o", str(tmp_path / "bag"), "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "node /t_bag_idle/flashrt is unconfigured: it has no engine, hence no fingerprint to record" in err
    assert not (tmp_path / "bag").exists()


@pytest.mark.parametrize("damage", ["truncate", "garble", "no_metadata"])
def test_a_broken_bag_gives_a_clear_error(session_bag, tmp_path, capsys, damage):
    broken = tmp_path / "broken"
    shutil.copytree(session_bag, broken)
    storage = next(broken.glob("*.mcap"))
    data = storage.read_bytes()
    if damage == "truncate":
        storage.write_bytes(data[: len(data) // 2])
    elif damage == "garble":
        storage.write_bytes(data[:8] + bytes(len(data) - 8))
    else:
        (broken / "metadata.yaml").unlink()
    assert replay(broken, "--offline") == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("flashrt_bag: error: ") and "Traceback" not in captured.err
    assert str(broken) in captured.err


@pytest.fixture(scope="module")
def mid_generation_bag(ros_context, tmp_path_factory):
    """A recording whose snapshot and rollback arrive while a generation is streaming."""
    with recorded(ros_context, tmp_path_factory.mktemp("mid"), "/t_bag_mid") as (client, bag):
        first = client.publish(client.observation("Count the cups:", max_new_tokens=24))
        client.wait_tokens(stamp_ns=first, min_tokens=4)
        assert client.snapshot(label="mid").success
        assert client.wait_tokens(stamp_ns=first).finish_reason == "length"
        second = client.publish(client.observation(" again", max_new_tokens=24))
        client.wait_tokens(stamp_ns=second, min_tokens=4)
        assert client.rollback(steps=2).success
        assert client.wait_tokens(stamp_ns=second).finish_reason == "canceled"
    return bag


def mid_generation_depths(bag) -> dict[str, int]:
    """How many tokens into the running request each snapshot / rollback ran."""
    script = build_script(read_bag(bag)[1])
    starts = {c.event.request_id: c.event.position_after for c in script if c.op == "observe"}
    return {c.op: c.event.position_before - starts[c.running] for c in script
            if c.op in ("snapshot", "rollback") and c.running}


def test_mid_generation_operations_replay_offline_at_the_same_token(mid_generation_bag, capsys):
    depth = mid_generation_depths(mid_generation_bag)
    assert depth["snapshot"] >= 4 and depth["rollback"] >= 4  # both ran mid-generation
    assert replay(mid_generation_bag, "--offline") == 0
    assert "RESULT: identical" in capsys.readouterr().out


def test_live_replay_places_mid_generation_operations_exactly(mid_generation_bag, ros_context, capsys):
    """The node holds the running request at each recorded boundary (~/hold): --live is exact, with no note."""
    with running_node(ros_context, "/t_bag_mid_live", **TINY_PARAMS):
        code = replay(mid_generation_bag, "--live", "--node", "/t_bag_mid_live/flashrt")
    out = capsys.readouterr().out
    assert code == 0 and "RESULT: identical" in out and "note:" not in out, out


@pytest.fixture(scope="module")
def typed_bag(ros_context, tmp_path_factory):
    """A recording of constrained goals: a Twist, one preempted mid-constraint and resumed, one cut short."""
    with recorded(ros_context, tmp_path_factory.mktemp("typed"), "/t_bag_typed") as (client, bag):
        twist = client.generate("go", 256, output_type="geometry_msgs/msg/Twist")
        assert twist.finish_reason == "stop" and json.loads(twist.text)["linear"]
        goal = goal_of(client, "go", 256)
        goal.output_type = "geometry_msgs/msg/Twist"
        client.wait(client.send_goal(goal))
        client.wait_tokens(stamp_ns=stamp_ns(goal), min_tokens=8)
        stop = client.publish(client.observation(" Stop!", max_new_tokens=4, priority=URGENT))
        assert client.wait_tokens(stamp_ns=stamp_ns(goal)).finish_reason == "preempted"
        client.wait_tokens(stamp_ns=stop)
        resumed = client.resume()
        assert client.wait_tokens(request_id=resumed.request_id).finish_reason == "stop"
        assert client.generate("go", 8, output_type="geometry_msgs/msg/Twist").finish_reason == "incomplete"
    return bag


def test_a_constrained_session_replays_offline_identically(typed_bag, capsys):
    events = [r.msg for r in read_bag(typed_bag)[1] if r.topic == "events"]
    assert [e.output_type for e in events if e.op == "generate"] == ["geometry_msgs/msg/Twist"] * 3
    assert "preempt" in [e.op for e in events] and "resume" in [e.op for e in events]
    assert replay(typed_bag, "--offline") == 0
    assert "RESULT: identical" in capsys.readouterr().out


@pytest.fixture(scope="module")
def planner_bag(ros_context, tmp_path_factory):
    """A behaviour-tree planning run (~/generate goals, snapshots, restores, drops), a goal canceled
    mid-stream, and a deactivate / activate that ends a running goal."""
    with recorded(ros_context, tmp_path_factory.mktemp("bt"), "/t_bag_bt") as (client, bag):
        client.observe("The robot stands at the table.", 4)
        result = run_planner(client, ["Pick up the red cup.", "Open the top drawer."], max_new_tokens=6,
                             temperature=0.7)
        assert result.chosen.capsule is not None
        canceled_goal = goal_of(client, " Now describe the room.", 200)
        handle = client.wait(client.send_goal(canceled_goal))
        client.wait_tokens(stamp_ns=stamp_ns(canceled_goal), min_tokens=4)
        client.wait(handle.cancel_goal_async())
        assert client.wait(handle.get_result_async()).result.finish_reason == "canceled"
        running_goal = goal_of(client, " And again.", 200)
        running = client.wait(client.send_goal(running_goal))
        client.wait_tokens(stamp_ns=stamp_ns(running_goal), min_tokens=4)
        lifecycle(client, "/t_bag_bt/flashrt", Transition.TRANSITION_DEACTIVATE)
        assert client.wait(running.get_result_async()).result.finish_reason == "canceled"
        lifecycle(client, "/t_bag_bt/flashrt", Transition.TRANSITION_ACTIVATE)
        set_parameters(client, "/t_bag_bt/flashrt", {"sampling.temperature": 0.9, "sampling.top_k": 40})
        client.observe(" Done.", 6)  # sampled with the node's new defaults
    return bag


def set_parameters(client, node, values):
    from rclpy.parameter import Parameter
    from rclpy.parameter_client import AsyncParameterClient

    parameters = AsyncParameterClient(client.node, node)
    assert parameters.wait_for_services(timeout_sec=10)
    # atomically: one parameter callback, one 'set_sampling' event (a plain set applies them one by one)
    result = client.wait(parameters.set_parameters_atomically([Parameter(k, value=v) for k, v in values.items()]))
    assert result.result.successful, result.result.reason


def goal_of(client, text, max_new_tokens):
    return Generate.Goal(observation=client.observation(text, max_new_tokens=max_new_tokens))


def stamp_ns(goal) -> int:
    return goal.observation.header.stamp.sec * 1_000_000_000 + goal.observation.header.stamp.nanosec


def lifecycle(client, node, transition_id):
    from lifecycle_msgs.srv import ChangeState

    service = client.node.create_client(ChangeState, f"{node}/change_state")
    assert service.wait_for_service(timeout_sec=10)
    assert client.wait(service.call_async(ChangeState.Request(transition=Transition(id=transition_id)))).success


def test_a_behaviour_tree_session_replays_offline_and_live(planner_bag, ros_context, capsys):
    _, records = read_bag(planner_bag)
    ops = {r.msg.op for r in records if r.topic == "events"}
    assert {"generate", "cancel", "deactivate", "activate", "set_sampling", "snapshot", "restore", "drop"} <= ops
    assert replay(planner_bag, "--offline") == 0
    assert "RESULT: identical" in capsys.readouterr().out
    with running_node(ros_context, "/t_bag_bt_live", **TINY_PARAMS):
        code = replay(planner_bag, "--live", "--node", "/t_bag_bt_live/flashrt")
    out = capsys.readouterr().out
    assert code == 0 and "RESULT: identical" in out and "note:" not in out, out


def test_a_bag_of_the_previous_format_is_refused_with_the_reason(capsys):
    """test/bag/fixtures/bag_format1 was written by flashrt_ros at 4e9f7a5 (test/bag/fixtures/make_format1_bag.py)."""
    assert replay(Path(__file__).resolve().parent / "fixtures" / "bag_format1", "--offline") == 2
    err = capsys.readouterr().err
    assert "bag format 1" in err and "record the session again" in err and "Traceback" not in err
