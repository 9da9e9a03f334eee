"""Observation loss through real rclpy: a reliable publisher floods ~/observation at 1 kHz into a node whose queue
is one deep, so DDS drops some; every observation sent is then either applied by the engine or counted lost on
/diagnostics and as 'observation_lost' events (the old callback never received MessageInfo: all loss was silent)."""
import time

from conftest import wait_for
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

from flashrt_ros import node as node_module
from flashrt_ros.msg import Observation, StateEvent
from flashrt_ros.node import diagnostics_name

SENT = 1000
RATE_HZ = 1000.0
NODE_PARAMS = {"max_context": 2048, "qos.observation.depth": 1}
KEEP_ALL_RELIABLE = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)
EVENTS_QOS = QoSProfile(depth=5000, reliability=ReliabilityPolicy.RELIABLE,
                        durability=DurabilityPolicy.TRANSIENT_LOCAL)


def diagnostics_values(diagnostics: list, name: str) -> dict:
    statuses = [s for m in diagnostics for s in m.status if s.name == name]
    return {kv.key: kv.value for kv in statuses[-1].values} if statuses else {}


def test_every_observation_is_applied_or_counted_lost(node_and_client, monkeypatch):
    node, client = node_and_client
    events = client.subscribe(StateEvent, "events", EVENTS_QOS)
    diagnostics = client.subscribe(DiagnosticArray, "/diagnostics")
    publisher = client.publisher(Observation, "observation", KEEP_ALL_RELIABLE)
    # A sample sent before the node's reader knows the writer is never delivered, and what a publisher sent before
    # its first delivered sample cannot be told from what it sent before it was connected: so first empty
    # (refused, state-free) markers, one every 20 ms, until one has reached the engine.
    wait_for(lambda: publisher.get_subscription_count() > 0, what="the observation subscription")
    markers = 0
    deadline = time.monotonic() + 30.0
    while not any(e.op == "observe" for e in events):
        assert time.monotonic() < deadline, "no marker observation reached the engine in 30 s"
        markers += 1
        marker = Observation()
        marker.header.stamp.sec = -markers
        publisher.publish(marker)
        time.sleep(0.02)
    first_delivered = -max(e.observation.header.stamp.sec for e in events if e.op == "observe")

    # A node busy elsewhere for 20 ms now and then (on a fast machine the executor might otherwise keep up with
    # 1 kHz): the queue of one then overflows, whatever the machine.
    take = node_module.conv.observation_in

    def slow_now_and_then(msg, *limits):
        if msg.header.stamp.sec % 100 == 0:
            time.sleep(0.02)
        return take(msg, *limits)
    monkeypatch.setattr(node_module.conv, "observation_in", slow_now_and_then)

    start = time.monotonic()
    for i in range(SENT):  # one token each, stamped with its index
        msg = Observation(token_ids=[1])
        msg.header.stamp.sec = i + 1
        publisher.publish(msg)
        time.sleep(max(0.0, start + (i + 1) / RATE_HZ - time.monotonic()))

    # DDS keeps the newest sample of a full queue, so the last one sent reaches the engine, and a loss is reported
    # (its event queued) before the observation after the gap: once the last one's event is in, every earlier
    # observation has been applied or counted.
    wait_for(lambda: any(e.op == "observe" and e.observation.header.stamp.sec == SENT for e in events),
             timeout=60.0, what="the last observation's event")
    applied = node.worker.submit(lambda s: s.engine.position).result(10)
    refused = sum(e.op == "observe" and not e.success for e in events)  # the markers
    lost = sum(e.count for e in events if e.op == "observation_lost")
    sent = SENT + markers - first_delivered + 1
    assert applied + refused + lost == sent and lost > 0, (applied, refused, lost, sent)
    assert all(e.success for e in events if e.op == "observation_lost")
    name = diagnostics_name(node.get_fully_qualified_name())
    wait_for(lambda: diagnostics_values(diagnostics, name).get("observations_lost") == str(lost), timeout=10.0,
             what=f"observations_lost {lost} on /diagnostics")
