"""A small synchronous rclpy client for the ``flashrt`` node.

:class:`FlashRTClient` wraps the node's services, its ``~/observation`` / ``~/tokens`` topics and its
``~/generate`` action. It spins the given rclpy node on a background executor thread, so every method
can simply block on a future; the behaviour tree, the demo and the latency benchmark all use it.

Service helpers return the response objects unchanged: the caller decides on ``success`` /
``error_code``. Only transport problems raise :class:`ClientError` (service or action server absent,
no answer in time), so a refused request and an unreachable node are never confused.
"""
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import rclpy.executors
from rclpy.action import ActionClient
from rclpy.task import Future

from flashrt_ros.action import Generate
from flashrt_ros.endpoints import REQUEST_QOS
from flashrt_ros.msg import Observation, TokenChunk
from flashrt_ros.operations import resolve_type, services
from flashrt_ros.srv import Hold

# ~/<name> -> type, from the operations table (plus ~/hold, the replay's boundary placement)
SERVICE_TYPES = {**{op.interface: resolve_type(op.ros_type) for op in services()}, "hold": Hold}
NOT_ACTIVE = 12  # msg/ErrorCode.NOT_ACTIVE: the lifecycle node is not active (yet)
_KEPT_STREAMS = 4096  # finished streams nobody waited for are forgotten after this many (a burst fits)


_PROBE_TIMEOUT_S = 2.0


class BackgroundSpinner:
    """Spins an executor on a daemon thread until :meth:`close` (also a context manager)."""

    def __init__(self, executor):
        self.executor = executor
        self._thread = threading.Thread(target=executor.spin, daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        self.executor.shutdown()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ClientError(RuntimeError):
    """The node could not be reached or did not answer in time."""


@dataclass
class Stream:
    """One generation as seen on ``~/tokens``: the chunks of one request id up to its final chunk.

    ``first_token_at`` is the ``time.perf_counter()`` at which the first chunk arrived (for latency).
    """

    request_id: int
    observation_stamp_ns: int
    token_ids: list = field(default_factory=list)
    text: str = ""
    position: int = 0
    final: bool = False
    finish_reason: str = ""
    first_token_at: float = 0.0


def _stamp_ns(stamp) -> int:
    return stamp.sec * 1_000_000_000 + stamp.nanosec


class _StreamCollector:
    """Gathers ``~/tokens`` chunks into :class:`Stream` records that callers can wait for.

    Chunks may arrive before the caller knows which request id to wait for (a resume response and
    its first chunks race), so every stream is buffered until it is taken.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._streams = deque(maxlen=_KEPT_STREAMS)

    def on_chunk(self, chunk: TokenChunk) -> None:
        with self._cond:
            stream = next((s for s in self._streams
                           if s.request_id == chunk.request_id and not s.final), None)
            if stream is None:
                stream = Stream(chunk.request_id, _stamp_ns(chunk.observation_stamp),
                                first_token_at=time.perf_counter())
                self._streams.append(stream)
            stream.token_ids.extend(chunk.token_ids)
            stream.text += chunk.text
            stream.position = chunk.position
            stream.final = chunk.final
            stream.finish_reason = chunk.finish_reason
            self._cond.notify_all()

    def finished(self, stamps: set) -> dict:
        with self._cond:
            return {s.observation_stamp_ns: s for s in self._streams if s.final and s.observation_stamp_ns in stamps}

    def wait(self, matches, timeout: float, min_tokens: int | None = None) -> Stream:
        """Return the oldest stream for which ``matches(stream)`` holds.

        Without ``min_tokens`` this waits for the final chunk and removes the stream from the buffer;
        with it, it returns a copy of the stream once it holds that many tokens or has ended.
        """

        def ready():
            for s in self._streams:
                if matches(s) and (s.final or (min_tokens is not None and len(s.token_ids) >= min_tokens)):
                    return s
            return None

        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                wanted = "final chunk" if min_tokens is None else f"{min_tokens} tokens"
                raise ClientError(f"no token stream reached its {wanted} within {timeout:.1f} s")
            stream = ready()
            if min_tokens is not None:
                return replace(stream, token_ids=list(stream.token_ids))
            self._streams.remove(stream)
            return stream


class FlashRTClient:
    """Blocking access to one ``flashrt`` node (default name ``/flashrt``).

    The client adds ``node`` to its own executor and spins it on a daemon thread until
    :meth:`close`; do not spin ``node`` anywhere else meanwhile.
    """

    def __init__(self, node, ns: str = "/flashrt", timeout: float = 30.0):
        self.node = node
        self.ns = ns
        self.timeout = timeout
        # deep queues, so a burst of requests and their answers is never dropped at the default depth of 10
        self._clients = {name: node.create_client(srv, f"{ns}/{name}", qos_profile=REQUEST_QOS)
                         for name, srv in SERVICE_TYPES.items()}
        self._action = ActionClient(node, Generate, f"{ns}/generate", goal_service_qos_profile=REQUEST_QOS,
                                    result_service_qos_profile=REQUEST_QOS, cancel_service_qos_profile=REQUEST_QOS)
        self._observations = node.create_publisher(Observation, f"{ns}/observation", REQUEST_QOS)
        self._streams = _StreamCollector()
        self._tokens = node.create_subscription(TokenChunk, f"{ns}/tokens",
                                                self._streams.on_chunk, REQUEST_QOS)
        self._last_stamp_ns = 0
        executor = rclpy.executors.SingleThreadedExecutor(context=node.context)
        executor.add_node(node)
        self._spinner = BackgroundSpinner(executor)

    def close(self) -> None:
        """Stop spinning (the node itself stays the caller's to destroy)."""
        self._spinner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- readiness -------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until every service, the action, both topics are matched and the node is active."""
        deadline = time.monotonic() + timeout

        def left():
            return max(0.0, deadline - time.monotonic())

        for client in self._clients.values():
            if not client.wait_for_service(timeout_sec=left()):
                raise ClientError(f"service {client.srv_name} not available after {timeout:.0f} s")
        if not self._action.wait_for_server(timeout_sec=left()):
            raise ClientError(f"action server not available after {timeout:.0f} s")
        while (self._observations.get_subscription_count() == 0
               or self._tokens.get_publisher_count() == 0
               or not self._answers_active(min(_PROBE_TIMEOUT_S, left()))):
            if left() == 0.0:
                raise ClientError(f"node not active with matched topics after {timeout:.0f} s")
            time.sleep(0.1)

    def _answers_active(self, timeout: float) -> bool:
        """One readiness probe. While discovery is still matching the service's reply topic the node's
        answer can be lost (rmw: "failed to send response"), so a probe without an answer is retried."""
        try:
            return self.call("list_capsules", timeout=timeout).error_code != NOT_ACTIVE
        except ClientError:
            return False

    # -- futures ---------------------------------------------------------------------------------
    def wait(self, future: Future, timeout: float | None = None):
        """Block until ``future`` is done and return its result (``ClientError`` on timeout)."""
        timeout = self.timeout if timeout is None else timeout
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            future.cancel()
            raise ClientError(f"no answer within {timeout:.1f} s")
        if future.exception() is not None:
            raise future.exception()
        return future.result()

    def call_async(self, service: str, **fields) -> Future:
        """Send a request to ``~/<service>`` built from ``fields``; returns the response future."""
        client = self._clients[service]
        if not client.service_is_ready() and not client.wait_for_service(timeout_sec=self.timeout):
            raise ClientError(f"service {client.srv_name} not available")
        return client.call_async(SERVICE_TYPES[service].Request(**fields))

    def call(self, service: str, timeout: float | None = None, **fields):
        return self.wait(self.call_async(service, **fields), timeout)

    # -- services --------------------------------------------------------------------------------
    def snapshot(self, label: str = "", capsule_id: str = "", pinned: bool = False):
        return self.call("snapshot", capsule_id=capsule_id, label=label, pinned=pinned)

    def restore(self, capsule_id: str, verify_checksum: bool = False):
        return self.call("restore", capsule_id=capsule_id, verify_checksum=verify_checksum)

    def fork(self, source_id: str = "", capsule_id: str = "", label: str = "", switch_to: bool = False):
        return self.call("fork", source_id=source_id, capsule_id=capsule_id, label=label,
                         switch_to=switch_to)

    def rollback(self, capsule_id: str = "", steps: int = 0):
        return self.call("rollback", capsule_id=capsule_id, steps=steps)

    def list(self):
        return self.call("list_capsules")

    def drop(self, capsule_id: str):
        return self.call("drop_capsule", capsule_id=capsule_id)

    def export_capsule(self, capsule_id: str):
        return self.call("export_capsule", capsule_id=capsule_id)

    def import_capsule(self, capsule_id: str):
        return self.call("import_capsule", capsule_id=capsule_id)

    def spill_capsule(self, capsule_id: str, tier: str = "", wait: bool = True):
        return self.call("spill_capsule", capsule_id=capsule_id, tier=tier, wait=wait)

    def fetch_capsule(self, capsule_id: str, wait: bool = True):
        return self.call("fetch_capsule", capsule_id=capsule_id, wait=wait)

    def pin_capsule(self, capsule_id: str, pinned: bool = True):
        return self.call("pin_capsule", capsule_id=capsule_id, pinned=pinned)

    def reset(self):
        return self.call("reset")

    def resume(self, capsule_id: str = ""):
        return self.call("resume", capsule_id=capsule_id)

    # -- topics ----------------------------------------------------------------------------------
    def observation(self, text: str = "", token_ids=(), max_new_tokens: int = 0, priority: int = 0,
                    snapshot_label: str = "", values=(), images=(), json_schema: str = "", grammar: str = "",
                    output_type: str = "") -> Observation:
        """Build an Observation whose ``header.stamp`` is unique, so its token chunks can be found. ``images``:
        ``sensor_msgs/Image`` messages (placed before the text); ``json_schema``, ``grammar`` or ``output_type``
        constrain what it generates, as on a Generate goal."""
        msg = Observation(text=text, token_ids=list(token_ids), values=list(values),
                          max_new_tokens=max_new_tokens, priority=priority,
                          snapshot_label=snapshot_label, images=list(images), json_schema=json_schema,
                          grammar=grammar, output_type=output_type)
        now = max(self.node.get_clock().now().nanoseconds, self._last_stamp_ns + 1)
        self._last_stamp_ns = now
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 1_000_000_000)
        return msg

    def publish(self, observation: Observation) -> int:
        """Publish on ``~/observation``; returns the stamp (ns) its token chunks will carry."""
        self._observations.publish(observation)
        return _stamp_ns(observation.header.stamp)

    def wait_tokens(self, *, stamp_ns: int | None = None, request_id: int | None = None,
                    timeout: float | None = None, min_tokens: int | None = None) -> Stream:
        """Wait for the stream caused by the observation stamped ``stamp_ns``, or with ``request_id``.

        Returns once its final chunk arrived, or (``min_tokens``) once it holds that many tokens; the
        latter leaves the stream to be waited for again and may return a stream that already ended
        (e.g. at an end-of-sequence token), so check ``final``.
        """
        if (stamp_ns is None) == (request_id is None):
            raise ValueError("give exactly one of stamp_ns and request_id")
        if stamp_ns is not None:
            def matches(s):
                return s.observation_stamp_ns == stamp_ns
        else:
            def matches(s):
                return s.request_id == request_id
        return self._streams.wait(matches, self.timeout if timeout is None else timeout, min_tokens)

    def finished_streams(self, stamps) -> dict:
        """The finished streams among those caused by the observations stamped ``stamps`` (ns), by stamp;
        they stay buffered (the last ``_KEPT_STREAMS`` streams)."""
        return self._streams.finished(set(stamps))

    def observe(self, text: str = "", max_new_tokens: int = 16, priority: int = 0,
                timeout: float | None = None, **fields) -> Stream:
        """Publish an observation that generates (``max_new_tokens`` > 0) and collect its tokens.

        A refused observation (too long for the context, a token id out of range, bad values, ...)
        returns at once: its stream is one empty final chunk with ``finish_reason == "error"``. The
        error code and message are on the failed ``observe`` StateEvent on ``~/events`` (subscribe to
        it, or use the ``~/generate`` action, whose result carries them).
        """
        if max_new_tokens <= 0:
            raise ValueError("observe() collects tokens: max_new_tokens must be > 0")
        stamp = self.publish(self.observation(text, max_new_tokens=max_new_tokens,
                                              priority=priority, **fields))
        return self.wait_tokens(stamp_ns=stamp, timeout=timeout)

    # -- action ----------------------------------------------------------------------------------
    def generate_async(self, text: str = "", max_new_tokens: int = 16, *, temperature: float | None = None,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None, json_schema: str = "",
                       grammar: str = "", output_type: str = "", **fields) -> Future:
        """Send a ``~/generate`` goal; the returned future completes with the ``Generate.Result``.

        ``temperature=None`` keeps the node's sampling parameters; ``seed`` reseeds the sampler first;
        ``json_schema``, ``grammar`` or ``output_type`` constrain the output (see action/Generate.action).
        """
        goal = Generate.Goal(observation=self.observation(text, max_new_tokens=max_new_tokens, **fields),
                             override_sampling=temperature is not None,
                             temperature=temperature or 0.0, top_p=top_p, top_k=top_k,
                             reseed=seed is not None, seed=seed or 0,
                             json_schema=json_schema, grammar=grammar, output_type=output_type)
        result = Future()

        def on_result(future):
            result.set_result(future.result().result)

        def on_goal(future):
            handle = future.result()
            if not handle.accepted:
                result.set_exception(ClientError("generate goal rejected"))
            else:
                handle.get_result_async().add_done_callback(on_result)

        self.send_goal(goal).add_done_callback(on_goal)
        return result

    def send_goal(self, goal) -> Future:
        """Send a ``Generate.Goal`` as it is; the returned future completes with its goal handle."""
        if not self._action.server_is_ready() and not self._action.wait_for_server(self.timeout):
            raise ClientError("action server not available")
        return self._action.send_goal_async(goal)

    def generate(self, text: str = "", max_new_tokens: int = 16, timeout: float | None = None, **kw):
        return self.wait(self.generate_async(text, max_new_tokens, **kw), timeout)
