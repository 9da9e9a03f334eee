"""`flashrt_bag record` against a live node: sqlite3 recording works (the writer thread owns the
connection), a recording of nothing exits 2, and the bag holds the QoS the node's publishers offered."""
import threading

import pytest
from conftest import wait_for
from rosbags.highlevel import AnyReader
from rosbags.interfaces import QosDurability

from flashrt_ros.bag import cli, record
from flashrt_ros.bag.bagfile import read_bag
from flashrt_ros.msg import Observation, TokenChunk


def test_a_recording_of_nothing_exits_2(node_and_client, tmp_path, capsys):
    node, _ = node_and_client
    code = cli.main(["record", "--node", node.get_fully_qualified_name(), "-o", str(tmp_path / "empty"),
                     "--duration", "0.5", "--timeout", "30"])
    assert code == cli.BAD_INPUT
    assert "recorded no messages" in capsys.readouterr().err


@pytest.mark.parametrize("storage", ["sqlite3", "mcap"])
def test_recording_a_session_writes_every_message_with_the_offered_qos(node_and_client, tmp_path, storage):
    node, client = node_and_client
    target = node.get_fully_qualified_name()
    bag, result = tmp_path / "session", {}
    recorder = threading.Thread(target=lambda: result.setdefault("code", cli.main(
        ["record", "--node", target, "-o", str(bag), "--storage", storage, "--duration", "8", "--timeout", "30"])))
    tokens = client.subscribe(TokenChunk, "tokens")
    recorder.start()
    wait_for(lambda: client.node.count_subscribers(f"{target}/observation") >= 1
             and client.node.count_subscribers(f"{target}/tokens") >= 2, 30.0, "the recorder's subscriptions")
    publisher = client.publisher(Observation, "observation")
    wait_for(lambda: publisher.get_subscription_count() >= 2, 20.0, "node and recorder on ~/observation")
    publisher.publish(Observation(text="record me", max_new_tokens=6))
    wait_for(lambda: [c for c in tokens if c.final], 60.0, "the final chunk")
    recorder.join(60)
    assert result.get("code") == 0
    _, records = read_bag(bag)
    recorded = [r.msg for r in records if r.topic == "tokens"]
    assert [list(m.token_ids) for m in recorded] == [list(m.token_ids) for m in tokens]
    assert any(r.topic == "observation" and r.msg.text == "record me" for r in records)
    with AnyReader([bag], default_typestore=None) as reader:
        qos = {c.topic: c.ext.offered_qos_profiles for c in reader.connections}
    assert [q.durability for q in qos[f"{target}/events"]] == [QosDurability.TRANSIENT_LOCAL]
    assert [q.durability for q in qos[f"{target}/tokens"]] == [QosDurability.VOLATILE]


def test_a_request_lost_while_the_service_matches_is_sent_again(monkeypatch):
    """DDS can drop a request made just as the service appears; the recorder asks again every RETRY_S until its
    timeout, and names the node when none is answered."""
    from rclpy.task import Future

    monkeypatch.setattr(record, "RETRY_S", 0.05)
    sent = []

    def send():          # the first request is lost; the second is answered
        future = Future()
        sent.append(future)
        if len(sent) == 2:
            future.set_result("reply")
        return future

    assert record._request(send, 5.0, "/robot/flashrt") == "reply"
    assert len(sent) == 2 and sent[0].cancelled()
    with pytest.raises(record.BagError, match="/robot/flashrt did not answer"):
        record._request(Future, 0.2, "/robot/flashrt")
