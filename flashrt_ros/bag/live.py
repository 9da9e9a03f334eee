"""The ROS side of the bag tools: record a running node (or give a ``ros2 bag record`` bag the
header it lacks), and replay a bag into a running node.

A live replay publishes the recorded observations on the node's ``~/observation`` and issues the
recorded state operations through its services, each once the node has caught up with the point
where the recording issued it (see :func:`_LiveReplay.pace`), while a :class:`Recorder` captures
what the node answers. Operations that ran at a quiet point (no generation running), and an
observation that followed the call starting a generation before its first token, are reproduced
exactly; an operation that ran after ``k > 0`` tokens of a generation depends on timing and is
issued as soon as ``k`` tokens have been seen (best effort, reported as a note). Offline replay
places every operation exactly.
"""
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions

from flashrt_ros.bag.bagfile import TOPICS, BagError, BagHeader, adopt_bag, read_bag
from flashrt_ros.bag.compare import OUTPUT_TOPICS
from flashrt_ros.bag.record import Recorder, fetch_header
from flashrt_ros.bag.replay import check_fingerprint
from flashrt_ros.bag.script import Call
from flashrt_ros.bag.typestore import typestore
from flashrt_ros.client import BackgroundSpinner, ClientError, FlashRTClient
from flashrt_ros.msg import ActionChunk, Observation, StateEvent, TokenChunk

_RELIABLE = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)


@contextmanager
def _ros_node(name: str):
    """An rclpy node on its own context (coexists with any other rclpy use in the process).

    rclpy's signal handlers stay off, so Ctrl-C raises KeyboardInterrupt and the bag is closed cleanly.
    """
    context = rclpy.Context()
    rclpy.init(context=context, signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node(name, context=context)
    try:
        yield node
    finally:
        node.destroy_node()
        context.try_shutdown()


@contextmanager
def _spinning_node(name: str):
    """:func:`_ros_node`, spun by an executor on a background thread."""
    with _ros_node(name) as node:
        executor = SingleThreadedExecutor(context=node.context)
        executor.add_node(node)
        with BackgroundSpinner(executor):
            yield node


def record_node(target: str, output: Path, storage: str = "mcap", duration: float | None = None,
                timeout: float = 30.0) -> int:
    """Record ``target``'s session until ``duration`` seconds passed or Ctrl-C; returns the count.

    ``timeout``: how long to wait for the node's parameters, diagnostics and topics.
    """
    with _spinning_node("flashrt_bag_recorder") as node:
        recorder = Recorder(node, output, fetch_header(node, target, timeout), storage)
        try:
            _wait_connected([recorder], timeout)
            print(f"recording {target} into {output} (Ctrl-C stops)", flush=True)
            deadline = time.monotonic() + duration if duration is not None else None
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.1)
        except KeyboardInterrupt:
            pass
        finally:
            recorder.close()
    return recorder.count


def adopt_recording(source: Path, target: str, output: Path, storage: str = "mcap", timeout: float = 30.0) -> int:
    """Turn a bag of ``target``'s topics from ``ros2 bag record`` into a session bag, with the header
    read from the (still running, same parameters) node; returns the message count."""
    with _spinning_node("flashrt_bag_adopt") as node:
        header = fetch_header(node, target, timeout)
    return adopt_bag(source, output, header, storage)


class _Monitor:
    """Counts what the node publishes, so the replay knows how far the node has got."""

    def __init__(self, node, header: BagHeader):
        self._cond = threading.Condition()
        self.counts = {topic: 0 for topic in OUTPUT_TOPICS}
        self.finals = 0
        self.tokens = {}  # request id -> tokens streamed so far
        self._subscriptions = [
            node.create_subscription(cls, header.topic(topic), self._counter(topic), _RELIABLE)
            for topic, cls in (("tokens", TokenChunk), ("action", ActionChunk), ("events", StateEvent))]

    def connected(self) -> bool:
        return all(s.get_publisher_count() > 0 for s in self._subscriptions)

    def _counter(self, topic: str):
        def count(msg) -> None:
            with self._cond:
                self.counts[topic] += 1
                if topic == "tokens":
                    self.tokens[msg.request_id] = self.tokens.get(msg.request_id, 0) + len(msg.token_ids)
                    self.finals += msg.final
                self._cond.notify_all()
        return count

    def wait(self, ready, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: ready(self), timeout)


class _LiveReplay:
    """Issues the script's calls into the node, each at the recorded point."""

    def __init__(self, node, client: FlashRTClient, header: BagHeader, timeout: float):
        self.client = client
        self.monitor = _Monitor(node, header)
        self.timeout = timeout
        self.notes: list[str] = []
        self.requests = 0  # request ids the script's calls have taken so far
        self._observations = node.create_publisher(Observation, header.topic("observation"), _RELIABLE)

    def connected(self) -> bool:
        return self.monitor.connected() and self._observations.get_subscription_count() > 0

    def pace(self, call: Call) -> bool:
        """Wait until the node reached the point where ``call`` ran; False if it never does."""
        k, events_before, requests = call.tokens_into_request, call.event.seq - 1, self.requests
        if k == 0 and call.op == "observe":
            return True  # same publisher as the call that started the generation: order is kept
        if k is None:
            def ready(m):
                return m.counts["events"] >= events_before and m.finals >= requests
        else:
            self.notes.append(f"event seq {call.event.seq} ({call.op}) ran {k} tokens into a generation: "
                              "live timing is best effort")

            def ready(m):
                return m.counts["events"] >= events_before and m.tokens.get(requests, 0) >= k
        if self.monitor.wait(ready, self.timeout):
            return True
        self.notes.append(f"the node did not reach event seq {events_before} within {self.timeout:.0f} s; "
                          "replay stopped there")
        return False

    def issue(self, call: Call) -> None:
        e = call.event
        if call.op == "observe":
            self._observations.publish(bytes(typestore().serialize_cdr(call.observation, TOPICS["observation"])))
        else:
            service, fields = {
                "snapshot": ("snapshot", {"capsule_id": e.capsule_id}),
                "restore": ("restore", {"capsule_id": e.capsule_id}),
                "fork": ("fork", {"source_id": e.source_id, "capsule_id": e.capsule_id,
                                  "switch_to": e.switch_to}),
                "rollback": ("rollback", {"capsule_id": e.source_id, "steps": e.steps}),
                "drop": ("drop_capsule", {"capsule_id": e.capsule_id}),
                "reset": ("reset", {}),
                "resume": ("resume", {"capsule_id": e.capsule_id}),
            }[call.op]
            self.client.call(service, **fields)
        self.requests += call.opens_request

    def finish(self, expected: dict[str, int]) -> None:
        """Wait until every topic has as many messages as the recording (or the timeout)."""
        if not self.monitor.wait(lambda m: all(m.counts[t] >= n for t, n in expected.items()), self.timeout):
            self.notes.append(f"the node's answers were incomplete after {self.timeout:.0f} s")


def replay_live(header: BagHeader, records, script: list[Call], *, node: str, allow_model_change: bool = False,
                output: Path | None = None, timeout: float = 60.0) -> tuple[dict[str, list], list[str]]:
    """Replay ``script`` into the running node ``node``; returns its outputs per topic and notes.

    The node must be freshly started (empty context, no capsules), like the recorded one.
    """
    expected = {t: sum(r.topic == t for r in records) for t in OUTPUT_TOPICS}
    with _ros_node("flashrt_bag_replay") as ros, tempfile.TemporaryDirectory() as tmp:
        client = FlashRTClient(ros, ns=node, timeout=timeout)
        try:
            client.wait_ready(timeout)
            live_header = fetch_header(ros, node, timeout)
            notes = check_fingerprint(header.fingerprint, live_header.fingerprint, allow_model_change)
            state = client.list()
            if state.live_position != 0 or len(state.capsules):
                raise BagError(f"node {node} is not fresh (position {state.live_position}, "
                               f"{len(state.capsules)} capsules); restart it before a live replay")
            path = output or Path(tmp, "live")
            recorder = Recorder(ros, path, live_header, topics=OUTPUT_TOPICS)
            driver = _LiveReplay(ros, client, live_header, timeout)
            try:
                _wait_connected([recorder, driver], timeout)
                for call in script:
                    if not driver.pace(call):
                        break
                    driver.issue(call)
                driver.finish(expected)
            finally:
                recorder.close()
        except ClientError as exc:
            raise BagError(f"live replay against {node}: {exc}") from None
        finally:
            client.close()
        _, answers = read_bag(path)
    return {t: [r.msg for r in answers if r.topic == t] for t in OUTPUT_TOPICS}, notes + driver.notes


def _wait_connected(listeners, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(listener.connected() for listener in listeners):
        if time.monotonic() > deadline:
            raise BagError(f"the node's topics did not connect within {timeout:.0f} s")
        time.sleep(0.05)
