"""The ROS side of the bag tools: record a running node (or give a ``ros2 bag record`` bag the
header it lacks), and replay a bag into a running node.

A live replay publishes the recorded observations on the node's ``~/observation``, sends its recorded
``~/generate`` goals (and their cancels), drives its recorded lifecycle transitions and issues the recorded
state operations through its services, each at its recorded token boundary (see :class:`_LiveReplay`), while
a :class:`Recorder` captures what the node answers.
"""
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import rclpy
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.parameter_client import AsyncParameterClient
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message
from rclpy.signals import SignalHandlerOptions

from flashrt_ros import ros_convert as conv
from flashrt_ros.action import Generate
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
    """Issues the script's calls into the node, each at its recorded token boundary.

    A call that ran mid-generation (``running_request_id`` R, at ``position_before`` P) is placed exactly:
    before anything is issued, the node is asked to hold request R at P (``~/hold``) until one operation has
    run there, and an operation that reaches the node earlier waits for that boundary. A call that ran while
    nothing generated is issued once the node has finished every earlier request.
    """

    def __init__(self, node, client: FlashRTClient, header: BagHeader, timeout: float):
        self.client = client
        self.monitor = _Monitor(node, header)
        self.timeout = timeout
        self.notes: list[str] = []
        self.requests = 0  # request ids the script's calls have taken so far
        self._goals = {}   # request id -> future of its goal handle
        self._observations = node.create_publisher(Observation, header.topic("observation"), _RELIABLE)
        self._lifecycle = node.create_client(ChangeState, header.topic("change_state"))
        self._parameters = AsyncParameterClient(node, header.node)

    def connected(self) -> bool:
        return self.monitor.connected() and self._observations.get_subscription_count() > 0

    def hold(self, script: list[Call]) -> None:
        points = [(c.running, c.event.position_before) for c in script if c.running]
        if points:
            response = self.client.call("hold", request_ids=[r for r, _ in points], positions=[p for _, p in points])
            if not response.success:
                raise BagError(f"the node refused to hold its stream for the replay: {response.message}")

    def pace(self, call: Call) -> bool:
        """Wait until the node reached the point where ``call`` ran; False if it never does."""
        events_before, requests = call.first_seq - 1, self.requests
        if call.running:
            def ready(m):
                return m.counts["events"] >= events_before
        else:
            def ready(m):
                return m.counts["events"] >= events_before and m.finals >= requests
        if self.monitor.wait(ready, self.timeout):
            return True
        self.notes.append(f"the node did not reach event seq {events_before} within {self.timeout:.0f} s; "
                          "replay stopped there")
        return False

    def issue(self, call: Call) -> None:
        e, op = call.event, call.operation
        if op.kind == "service":
            self.client.call(op.interface, **{name: getattr(e, name) for name in op.fields})
        elif call.op == "observe":
            if call.also:  # published back to back: the node ingests together what it finds queued
                self.notes.append(f"event seq {e.seq}: {len(call.observations)} observations shared one prefill; "
                                  "the live node groups what reaches it while busy, which may differ")
            for observation in call.observations:
                self._observations.publish(bytes(typestore().serialize_cdr(observation, TOPICS["observation"])))
        elif call.op == "generate":
            self._goals[int(e.request_id)] = self.client.send_goal(_as_message(e, op))
        elif call.op == "cancel":
            handle = self.client.wait(self._goals[int(e.request_id)]) if int(e.request_id) in self._goals else None
            if handle is None or not handle.accepted:
                self.notes.append(f"event seq {e.seq}: no goal of request {e.request_id} to cancel")
            else:
                handle.cancel_goal_async()
        elif op.kind == "lifecycle":
            self._transition(call.op)
        elif op.kind == "parameter":
            self._set_parameters({f"sampling.{name}": conv.plain(getattr(e, name)) for name in op.fields})
        else:  # observation_lost: the recorded node lost them; the live one gets every observation
            self.notes.append(f"event seq {e.seq} ({call.op}) is not re-issued in a live replay")
        self.requests = max(self.requests, call.opens_request)

    def _set_parameters(self, values: dict) -> None:
        """Set ``values`` atomically: one callback on the node, hence one event, as recorded."""
        future = self._parameters.set_parameters_atomically([Parameter(k, value=v) for k, v in values.items()])
        result = self.client.wait(future).result
        if not result.successful:
            self.notes.append(f"the node refused the parameters {values}: {result.reason}")

    def _transition(self, name: str) -> None:
        if not self._lifecycle.wait_for_service(timeout_sec=self.timeout):
            raise BagError("the node offers no lifecycle change_state service")
        transition = {"activate": Transition.TRANSITION_ACTIVATE, "deactivate": Transition.TRANSITION_DEACTIVATE}
        self.client.wait(self._lifecycle.call_async(ChangeState.Request(transition=Transition(id=transition[name]))))

    def finish(self, expected: dict[str, int]) -> None:
        """Wait until every topic has as many messages as the recording (or the timeout)."""
        if not self.monitor.wait(lambda m: all(m.counts[t] >= n for t, n in expected.items()), self.timeout):
            self.notes.append(f"the node's answers were incomplete after {self.timeout:.0f} s")


def _as_message(event, op):
    """The Generate goal a 'generate' event records (same field names)."""
    goal = Generate.Goal()
    for name in op.fields:
        value = getattr(event, name)
        if name == "observation":
            value = deserialize_message(bytes(typestore().serialize_cdr(value, TOPICS["observation"])), Observation)
        setattr(goal, name, conv.plain(value))
    return goal


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
                driver.hold(script)
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
