"""Record a running flashrt node's session into a bag, with rclpy alone (no rosbag2 needed).

The recorder subscribes to the node's four topics with ``raw=True`` and writes the serialized CDR
bytes straight into the bag, stamped with their receive time, with the QoS profiles the publishers
offer, exactly as ``ros2 bag record`` does. One writer thread opens, writes and closes the bag (an sqlite3
connection may only be used from the thread that opened it; the executor's callbacks only queue).
The bag header holds the node's parameters, read through the standard parameter services, and its
engine's fingerprint, read from the node's ``/diagnostics`` status (never computed here: that would
load the model a second time, which a large model on a robot cannot afford).
"""
import queue
import threading
import time
from importlib.metadata import PackageNotFoundError, version

from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import State
from lifecycle_msgs.srv import GetState
from rclpy.node import Node
from rclpy.parameter import parameter_value_to_python
from rclpy.parameter_client import AsyncParameterClient
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

from flashrt_ros.bag.bagfile import TOPICS, BagError, BagHeader, BagWriter
from flashrt_ros.endpoints import diagnostics_name
from flashrt_ros.msg import ActionChunk, Observation, StateEvent, TokenChunk

RETRY_S = 2.0     # a request unanswered this long is sent again (see _request)
MSG_CLASSES = {"observation": Observation, "tokens": TokenChunk, "action": ActionChunk, "events": StateEvent}


def package_version() -> str:
    try:
        return version("flashrt_ros")
    except PackageNotFoundError:
        return "unknown"


def fetch_header(node: Node, target: str, timeout: float = 30.0) -> BagHeader:
    """The header for a recording of ``target``: its parameters and its engine's fingerprint.

    ``node`` must be spinning in another thread (the requests and diagnostics arrive there).
    BagError if the node does not answer within ``timeout`` seconds, is unconfigured (asked, not waited
    for: it has no engine, so no fingerprint), or publishes no diagnostics within ``timeout`` seconds.
    """
    fingerprint = _FingerprintListener(node, target)
    try:
        client = AsyncParameterClient(node, target)
        if not client.wait_for_services(timeout_sec=timeout):
            raise BagError(f"node {target} does not answer its parameter services")
        names = _request(client.list_parameters, timeout, target).result.names
        values = _request(lambda: client.get_parameters(names), timeout, target).values
        parameters = {n: parameter_value_to_python(v) for n, v in zip(names, values)}
        _check_configured(node, target, timeout)
        return BagHeader(node=target, fingerprint=fingerprint.wait(timeout), parameters=parameters,
                         package_version=package_version())
    finally:
        fingerprint.close()


def _check_configured(node: Node, target: str, timeout: float) -> None:
    """BagError at once if ``target`` says it is unconfigured or finalized (its lifecycle ``get_state``)."""
    client = node.create_client(GetState, f"{target.rstrip('/')}/get_state")
    try:
        if not client.wait_for_service(timeout_sec=timeout):
            return  # not a lifecycle node: the fingerprint wait decides
        state = _request(lambda: client.call_async(GetState.Request()), timeout, target).current_state
    finally:
        node.destroy_client(client)
    if state.id in (State.PRIMARY_STATE_UNCONFIGURED, State.PRIMARY_STATE_FINALIZED):
        raise BagError(f"node {target} is {state.label}: it has no engine, hence no fingerprint to record; "
                       f"configure it first (ros2 lifecycle set {target} configure)")


def _request(send, timeout: float, target: str):
    """The reply to the request ``send()`` makes (it returns the future). One left unanswered for
    :data:`RETRY_S` is made again, until ``timeout`` seconds have passed: DDS can drop a request sent while
    the service's endpoints are still being matched (just after ``wait_for_service``), and on a loaded
    machine that window is seconds long."""
    deadline = time.monotonic() + timeout
    while True:
        future, done = send(), threading.Event()
        future.add_done_callback(lambda _: done.set())
        if done.wait(max(0.0, min(RETRY_S, deadline - time.monotonic()))):
            return future.result()
        future.cancel()
        if time.monotonic() >= deadline:
            raise BagError(f"node {target} did not answer a parameter request within {timeout:.0f} s")


class _FingerprintListener:
    """Takes the ``fingerprint`` value of ``target``'s engine status from ``/diagnostics``."""

    def __init__(self, node: Node, target: str):
        self._node, self._target = node, target
        self._name = diagnostics_name("/" + target.lstrip("/"))
        self._value = None
        self._arrived = threading.Event()
        self._subscription = node.create_subscription(DiagnosticArray, "/diagnostics", self._on_array, 10)

    def _on_array(self, array: DiagnosticArray) -> None:
        for status in array.status:
            if status.name == self._name:
                value = next((kv.value for kv in status.values if kv.key == "fingerprint"), "")
                if value:
                    self._value = value
                    self._arrived.set()

    def wait(self, timeout: float) -> str:
        if not self._arrived.wait(timeout):
            raise BagError(f"no /diagnostics status '{self._name}' with a fingerprint within {timeout:.0f} s: "
                           f"is {self._target} configured (it publishes its engine's fingerprint there) "
                           "and on this ROS_DOMAIN_ID?")
        return self._value

    def close(self) -> None:
        self._node.destroy_subscription(self._subscription)


def offered_qos(node: Node, topic: str) -> list[Qos]:
    """The QoS profiles that ``topic``'s publishers offer, as rosbags writes them into a bag."""
    def duration(d) -> QosTime:
        return QosTime(*divmod(d.nanoseconds, 10**9))

    return [Qos(QosHistory(int(p.history)), p.depth, QosReliability(int(p.reliability)),
                QosDurability(int(p.durability)), duration(p.deadline), duration(p.lifespan),
                QosLiveliness(int(p.liveliness)), duration(p.liveliness_lease_duration),
                p.avoid_ros_namespace_conventions)
            for p in (info.qos_profile for info in node.get_publishers_info_by_topic(topic))]


class Recorder:
    """Writes everything ``header.node`` publishes (and receives on ``~/observation``) into a bag.

    The subscription callbacks queue what arrives, so ``node`` must be spun by the caller; the writer
    thread writes it. :meth:`close` stops recording, writes the metadata and raises :class:`BagError` if
    the bag could not be written. ``topics`` narrows what is recorded.
    """

    def __init__(self, node: Node, path, header: BagHeader, storage: str = "mcap", topics=tuple(TOPICS)):
        self._node = node
        self.count = 0  # messages written
        self._received: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Exception | None = None
        bag = BagWriter(path, header, storage, lambda short: offered_qos(node, header.topic(short)))
        opened = threading.Event()
        self._thread = threading.Thread(target=self._write, args=(bag, opened), name="flashrt-bag-writer",
                                        daemon=True)
        self._thread.start()
        opened.wait()
        if self._error is not None:
            raise self._error
        qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        self._subscriptions = {
            short: node.create_subscription(
                MSG_CLASSES[short], header.topic(short),
                lambda data, short=short: self._received.put((short, time.time_ns(), data)), qos, raw=True)
            for short in topics
        }

    def _write(self, bag: BagWriter, opened: threading.Event) -> None:
        """The writer thread: open the bag, write what arrives until ``None``, close it."""
        try:
            with bag:
                opened.set()
                while (item := self._received.get()) is not None:
                    bag.write_cdr(*item)
                    self.count += 1
        except Exception as exc:  # noqa: BLE001 - raised again by the constructor or close()
            self._error = exc if isinstance(exc, BagError) else BagError(f"writing the bag failed: {exc}")
        finally:
            opened.set()

    def connected(self) -> bool:
        """Whether the node's recorded output topics are matched (``~/observation`` is published by
        others, whenever they like)."""
        return all(s.get_publisher_count() > 0 for short, s in self._subscriptions.items()
                   if short != "observation")

    def close(self) -> None:
        for subscription in self._subscriptions.values():
            self._node.destroy_subscription(subscription)
        self._received.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
