"""Observations at sensor rate on the live node (real rclpy, tiny model, CPU): 200 at 200 Hz and 1,000 at 1 kHz
from a reliable KEEP_ALL publisher are all applied, in order, as coalesced prefills; the live state equals the
same texts applied offline (positions: sequentially; bytes: in the recorded groups); a bag of the run replays
token-identically; a capsule taken mid-stream says what was applied, and restoring it and replaying the rest is
exact. Past a small byte budget, every observation is accounted for by an event and in /diagnostics."""
import time
from pathlib import Path

import pytest
from conftest import TINY_PARAMS, RosClient, running_node, wait_for
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

from flashrt_ros.bag import cli
from flashrt_ros.bag.bagfile import read_bag
from flashrt_ros.bag.record import Recorder, fetch_header
from flashrt_ros.bag.replay import _engine, advance, apply, settings_from
from flashrt_ros.bag.script import build_script
from flashrt_ros.msg import Observation, StateEvent
from flashrt_ros.node import diagnostics_name
from flashrt_ros.session import ObservationInput, Session
from flashrt_ros.srv import Snapshot

PARAMS = {**TINY_PARAMS, "max_context": 8192, "capsule_budget_mb": 64}
KEEP_ALL = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)
EVENTS = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE,
                    durability=DurabilityPolicy.TRANSIENT_LOCAL)
ACCOUNTED = ("observe", "observation_dropped")


def publish_at(publisher, texts, hz: float, midway=None) -> None:
    """Publish one observation per text at ``hz`` (stamp = its index + 1, in ns); ``midway()`` halfway through."""
    start = time.monotonic()
    for i, text in enumerate(texts):
        msg = Observation(text=text)
        msg.header.stamp.nanosec = i + 1
        publisher.publish(msg)
        if midway is not None and i == len(texts) // 2:
            midway()
        delay = start + (i + 1) / hz - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def run_live(ros_context, tmp_path: Path, namespace: str, texts, hz: float, params=None, midway=None):
    """Publish ``texts`` at ``hz`` to a fresh node under recording; returns (events, bag, client results)."""
    bag = tmp_path / namespace.strip("/")
    with running_node(ros_context, namespace, **{**PARAMS, **(params or {})}) as node:
        target = node.get_fully_qualified_name()
        client = RosClient(ros_context, target)
        try:
            events = client.subscribe(StateEvent, "events", EVENTS)
            diagnostics = client.subscribe(DiagnosticArray, "/diagnostics", 100)
            recorder = Recorder(client.node, bag, fetch_header(client.node, target, 30.0))
            publisher = client.publisher(Observation, "observation", KEEP_ALL)
            wait_for(lambda: publisher.get_subscription_count() >= 2, 20.0, "node and recorder on ~/observation")
            results = {}
            publish_at(publisher, texts, hz, midway and (lambda: midway(client, results)))
            wait_for(lambda: sum(e.op in ACCOUNTED for e in events) >= len(texts), 120.0,
                     "an event for every observation")
            results["final"] = client.call(Snapshot, "snapshot", capsule_id="final")
            wait_for(lambda: any(e.op == "snapshot" and e.result_id == "final" for e in events), 10.0, "its event")
            status = diagnostics_name(target)
            since = len(diagnostics)
            wait_for(lambda: any(s.name == status for m in diagnostics[since:] for s in m.status), 10.0, "diagnostics")
            results["diagnostics"] = {kv.key: kv.value for m in diagnostics[since:] for s in m.status
                                      if s.name == status for kv in s.values}
            time.sleep(0.5)  # let the recorder take the last messages
            recorder.close()
        finally:
            client.close()
    return list(events), bag, results


def offline_session(bag: Path):
    """A fresh Session built from the bag's parameters, as the offline replay builds it."""
    header, records = read_bag(bag)
    settings = settings_from(header.parameters)
    engine = _engine(settings)
    return engine, Session(engine, discretiser=settings.discretiser, default_sampling=settings.sampling,
                           emit=lambda _: None), build_script(records)


def replay_calls(session, calls) -> None:
    for call in calls:
        advance(session, call)
        apply(session, call)


def check_applied_in_order_and_exact(events, bag, results, texts, capsys):
    observed = [e for e in events if e.op == "observe"]
    assert [e.op for e in events if e.op not in ("observe", "snapshot")] == []  # nothing lost, dropped or refused
    assert all(e.success for e in observed)
    assert [e.observation.text for e in observed] == texts  # every one applied, in publish order
    assert [e.observation.header.stamp.nanosec for e in observed] == list(range(1, len(texts) + 1))

    # the same texts applied sequentially offline: the same token spans, so the same token stream
    engine, session, script = offline_session(bag)
    spans = []
    for text in texts:
        before = engine.position
        session.observe(ObservationInput(text=text))
        spans.append((before, engine.position))
    assert [(e.position_before, e.position_after) for e in observed] == spans
    assert results["final"].capsule.position == spans[-1][1]

    # the state byte for byte: the recorded groups replayed offline (replay re-coalesces them)
    engine, session, script = offline_session(bag)
    replay_calls(session, script)
    assert engine.capsule("final").checksum == results["final"].capsule.checksum
    assert cli.main(["replay", str(bag), "--offline"]) == 0
    assert "RESULT: identical" in capsys.readouterr().out
    return observed, script


def test_200_observations_at_200_hz_are_all_applied_and_replay_exactly(ros_context, tmp_path, capsys):
    texts = [f"{i};" for i in range(200)]
    events, bag, results = run_live(ros_context, tmp_path, "/t_obs_200hz", texts, 200.0)
    check_applied_in_order_and_exact(events, bag, results, texts, capsys)
    assert results["diagnostics"]["observations_dropped"] == "0"


def test_1000_observations_at_1_khz_coalesce_and_a_capsule_taken_midway_restores_exactly(
        ros_context, tmp_path, capsys):
    texts = [f"{i};" for i in range(1000)]

    def midway(client, results):  # a capsule while observations are queued
        results["mid"] = client.call(Snapshot, "snapshot", capsule_id="mid")

    events, bag, results = run_live(ros_context, tmp_path, "/t_obs_1khz", texts, 1000.0, midway=midway)
    observed, script = check_applied_in_order_and_exact(events, bag, results, texts, capsys)
    assert max(e.count for e in observed) > 0, "no observations were coalesced at 1 kHz"
    assert len(script) < len(observed)

    # the midway capsule says which observations it holds: exactly those whose events precede it
    [mid] = [e for e in events if e.op == "snapshot" and e.result_id == "mid"]
    applied = [e for e in observed if e.seq < mid.seq]
    assert results["mid"].capsule.position == mid.position_before == applied[-1].position_after
    # restore it offline, replay the rest of the recording: the live final state
    engine, session, script = offline_session(bag)
    at = next(i for i, call in enumerate(script) if call.op == "snapshot" and call.event.capsule_id == "mid")
    replay_calls(session, script[:at + 1])
    session.observe(ObservationInput(text="something else entirely"))  # the live state moves on, then back
    session.restore("mid")
    replay_calls(session, script[at + 1:])
    assert engine.capsule("final").checksum == results["final"].capsule.checksum


@pytest.mark.parametrize("policy", ["drop_oldest", "refuse_new"])
def test_past_the_byte_budget_every_observation_is_accounted_for(ros_context, tmp_path, policy, capsys):
    texts = [f"{i:04d};" for i in range(300)]
    events, bag, results = run_live(ros_context, tmp_path, f"/t_obs_{policy}", texts, 1000.0,
                                    {"observation_queue.max_bytes": 20, "observation_queue.overload": policy})
    applied = [e.observation.header.stamp.nanosec for e in events if e.op == "observe"]
    dropped = [e for e in events if e.op == "observation_dropped"]
    assert dropped, "a 20-byte budget at 1 kHz dropped nothing"
    assert all(policy in e.message for e in dropped)
    assert sorted(applied + [e.observation.header.stamp.nanosec for e in dropped]) == list(range(1, 301))
    assert applied == sorted(applied)
    assert results["diagnostics"]["observations_dropped"] == str(len(dropped))
    assert cli.main(["replay", str(bag), "--offline"]) == 0  # the drops are part of the recording
    assert "RESULT: identical" in capsys.readouterr().out


def test_block_drops_nothing_past_the_budget_it_holds_them_back_in_dds(ros_context, tmp_path):
    texts = [f"{i:04d};" for i in range(300)]
    events, bag, results = run_live(ros_context, tmp_path, "/t_obs_block", texts, 1000.0,
                                    {"observation_queue.max_bytes": 20, "observation_queue.overload": "block"})
    assert [e.observation.text for e in events if e.op == "observe"] == texts
    assert not [e for e in events if e.op == "observation_dropped"]
    assert results["diagnostics"]["observations_dropped"] == "0"
    assert int(results["diagnostics"]["observation_queue_peak_bytes"]) <= 20


def test_an_urgent_observation_is_not_queued_behind_normal_ones(ros_context):
    """Normal observations wait while a generation runs; an urgent one published after them runs at the next
    token boundary, ahead of them, preempting the generation; the normal ones then follow as one prefill."""
    with running_node(ros_context, "/t_obs_urgent", **PARAMS) as node:
        client = RosClient(ros_context, node.get_fully_qualified_name())
        try:
            events = client.subscribe(StateEvent, "events", EVENTS)
            publisher = client.publisher(Observation, "observation", KEEP_ALL)
            wait_for(lambda: publisher.get_subscription_count() >= 1, 20.0, "the node on ~/observation")
            publisher.publish(Observation(text="Describe the room.", max_new_tokens=400))
            wait_for(lambda: any(e.op == "observe" for e in events), 30.0, "the long generation to start")
            for i in range(5):
                publisher.publish(Observation(text=f" normal {i};"))
            publisher.publish(Observation(text=" urgent!", priority=Observation.PRIORITY_URGENT))
            wait_for(lambda: sum(e.op == "observe" for e in events) == 7, 60.0, "every observation's event")
        finally:
            client.close()
    long, *rest = [e for e in events if e.op in ("observe", "preempt")]
    assert [e.op for e in rest] == ["preempt", "observe"] + ["observe"] * 5
    urgent, normals = rest[1], rest[2:]
    assert urgent.observation.text == " urgent!"
    assert urgent.running_request_id == long.request_id > 0  # it ran inside the generation, at a token boundary
    assert urgent.position_before < long.position_after + 400
    assert [e.observation.text for e in normals] == [f" normal {i};" for i in range(5)]
    assert [e.count for e in normals] == [4, 3, 2, 1, 0]  # they waited together: one prefill
    assert all(e.running_request_id == 0 for e in normals)
