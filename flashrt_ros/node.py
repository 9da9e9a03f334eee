"""The ``flashrt`` lifecycle node: the ROS 2 adapter around one Engine (via Session + EngineWorker).

Lifecycle (rclpy.lifecycle, as in ros2/demos lifecycle_py):

* constructor: declares the parameters, creates the services, the ``~/generate`` action server and the
  (lifecycle) publishers. Services and the action always answer; outside ``active`` they answer
  ``NOT_ACTIVE``. With ``autostart`` (default) it configures and activates itself.
* ``on_configure``: reads the parameters, builds the Engine (load, allocate, warm up), starts the engine
  thread, subscribes ``~/observation`` (QoS from ``qos.observation.*``) and starts the ``/diagnostics`` timer.
  A model that cannot be loaded fails the transition (the node stays unconfigured; fix and retry).
* ``on_activate``: enables the publishers and the request handling.
* ``on_deactivate``: ends a running generation (``canceled``), refuses waiting observations, disables output.
* ``on_cleanup`` / ``on_shutdown``: stop the engine thread and free the engine.

Callbacks never touch the engine: they submit work to the engine thread and wait on its future
(``request_timeout_s``) in a reentrant callback group, spun by a MultiThreadedExecutor. ``~/observation`` has
a group of its own (one callback at a time), so observations reach the engine in the order they arrived and
the publisher's sequence numbers are seen in order (loss detection).

Every callback the executor runs is wrapped by :meth:`FlashRTNode._guarded`: an exception (a bug) is logged,
becomes ``last_error`` and is answered as ``INTERNAL`` with its reason (a service response, an aborted goal, a
rejected goal or cancel, a refused parameter set, an observation counted as lost), and the node keeps serving.
"""
import dataclasses
import functools
import queue
import threading
import time
import traceback
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import Node, State, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from flashrt_ros import image_convert, ros_convert as conv
from flashrt_ros.action import Generate
from flashrt_ros.endpoints import REQUEST_QOS, diagnostics_name, typed_topic
from flashrt_ros.engine_worker import EngineWorker
from flashrt_ros.msg import ActionChunk, Observation, StateEvent, TokenChunk
from flashrt_ros.observation_queue import ObservationIngest, ObservationQueue
from flashrt_ros.operations import OPERATIONS, Operation, resolve_type, services
from flashrt_ros.params import NodeSettings, check_update, declare_parameters, read_settings
from flashrt_ros.runtime import Engine, ErrorCode, FlashRTError
from flashrt_ros.session import (CANCELED, PRIORITY_URGENT, ActionOutput, EventOutput, Session,
                                 TokenOutput, TypedOutput)
from flashrt_ros.ros_convert import SequenceGaps
from flashrt_ros.srv import Hold

EXECUTOR_THREADS = 16  # blocking service/action callbacks each hold one thread while the engine works
# Goals hold an executor thread for as long as they wait and stream; beyond this many at once a new goal is
# rejected, so services, observations and cancels always find a free thread.
MAX_GOALS_IN_FLIGHT = EXECUTOR_THREADS // 2

# Events are an audit trail: keep them for late joiners (bag recorders) and never drop them.
_EVENTS_QOS = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
OUTPUT_DEPTH = 1000  # ~/tokens and ~/action history, so a slow subscriber sees a burst's answers


class FlashRTNode(Node):
    def __init__(self, node_name: str = "flashrt", **kwargs):
        super().__init__(node_name, **kwargs)
        declare_parameters(self)
        self._last_error = ""
        self.add_on_set_parameters_callback(self._guarded(self._on_set_parameters, _refuse_parameters))
        self._group = ReentrantCallbackGroup()
        self._observation_group = MutuallyExclusiveCallbackGroup()
        self._settings: Optional[NodeSettings] = None
        self._image_limits = image_convert.ImageLimits()  # the image.* parameters on the engine, set at configure
        self._worker: Optional[EngineWorker] = None
        self._active = False
        self._goal_feedback: dict[int, queue.SimpleQueue] = {}  # request id -> chunks for its action goal
        self._goals_lock = threading.Lock()
        self._goals_in_flight = 0
        self._observation_sub = None
        self._ingest: Optional[ObservationIngest] = None
        self._diagnostics_timer = None

        # ~/tokens and ~/events publish in every configured state, so that refusals while inactive are answered
        self._tokens_pub = self.create_publisher(TokenChunk, "~/tokens", OUTPUT_DEPTH)
        self._action_pub = self.create_lifecycle_publisher(ActionChunk, "~/action", OUTPUT_DEPTH)
        self._events_pub = self.create_publisher(StateEvent, "~/events", _EVENTS_QOS)
        self._typed_pubs: dict = {}    # output_type -> its publisher on ~/typed/<pkg>/msg/<Type>, made on first use
        self._loss = SequenceGaps()
        self._observations_lost = 0
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)

        for op in services():
            self.create_service(resolve_type(op.ros_type), f"~/{op.interface}",
                                self._guarded(self._service(op), _refuse_request),
                                qos_profile=REQUEST_QOS, callback_group=self._group)
        self.create_service(Hold, "~/hold", self._guarded(self._hold, _refuse_request), qos_profile=REQUEST_QOS,
                            callback_group=self._group)
        self._action_server = ActionServer(
            self, Generate, "~/generate", execute_callback=self._guarded(self._execute_goal, _abort_goal),
            goal_callback=self._guarded(self._accept_goal, lambda _error, _goal: GoalResponse.REJECT),
            cancel_callback=self._guarded(lambda _: CancelResponse.ACCEPT,
                                          lambda _error, _goal: CancelResponse.REJECT),
            goal_service_qos_profile=REQUEST_QOS, result_service_qos_profile=REQUEST_QOS,
            cancel_service_qos_profile=REQUEST_QOS, callback_group=self._group)

        if self.get_parameter("autostart").value:
            if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
                self.trigger_activate()

    @property
    def worker(self) -> Optional[EngineWorker]:
        """The engine thread while configured (tools and tests submit work to it), else None."""
        return self._worker

    def _guarded(self, callback, answer):
        """``callback`` as the executor may run it: an exception is logged, kept as ``last_error`` and answered
        by ``answer(error, *args)`` with an INTERNAL FlashRTError naming it, instead of stopping the executor.

        The wrapper keeps ``callback``'s signature (functools.wraps): rclpy passes a subscription its
        MessageInfo only when the callback takes two arguments."""
        @functools.wraps(callback)
        def guarded(*args):
            try:
                return callback(*args)
            except Exception as e:  # noqa: BLE001 - a bug in one request must not stop the node
                error = FlashRTError(ErrorCode.INTERNAL, f"{getattr(callback, '__name__', 'callback')}: "
                                                         f"{type(e).__name__}: {e}")
                self._last_error = error.message
                self.get_logger().error(f"{error.message}\n{traceback.format_exc()}")
                return answer(error, *args)
        return guarded

    # ---- lifecycle --------------------------------------------------------------------------
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        try:
            settings = read_settings(self)
            engine = Engine(settings.engine)
            image_limits = image_convert.limits_for(engine, **settings.image_limits)
            session = Session(engine, discretiser=settings.discretiser, default_sampling=settings.sampling,
                              emit=self._emit, stream_chunk_tokens=settings.stream_chunk_tokens, active=False)
        except Exception as e:  # noqa: BLE001 - any load failure leaves the node unconfigured, retryable
            self._last_error = f"configure: {e}"
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        self._settings, self._image_limits = settings, image_limits
        self._worker = EngineWorker(session)
        self._ingest = ObservationIngest(self._worker, ObservationQueue(**settings.observation_queue),
                                         warn=self.get_logger().warning)
        # its own mutually exclusive group: observations are taken one at a time, in arrival order, and a
        # callback blocked by observation_queue.overload=block holds one executor thread, not all of them
        self._observation_sub = self.create_subscription(
            Observation, "~/observation", self._guarded(self._on_observation, self._observation_failed),
            settings.observation_qos, callback_group=self._observation_group)
        self._diagnostics_timer = self.create_timer(settings.diagnostics_period_s,
                                                    self._guarded(self._publish_diagnostics, lambda _error: None))
        self.get_logger().info(
            f"configured: model={settings.engine.model} device={settings.engine.device} "
            f"dtype={settings.engine.dtype} max_context={settings.engine.max_context}")
        listed = [c.id for c in engine.capsules() if c.tier == "disk"]
        if listed:
            self.get_logger().info(f"capsule_dir: {len(listed)} capsule(s) listed on the disk tier: {', '.join(listed)}")
        for why in engine.capsule_dir_refused:
            self.get_logger().warning(f"capsule_dir: refused {why}")
        return super().on_configure(state)

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        result = super().on_activate(state)  # enables the lifecycle publishers first
        self._lifecycle("activate")
        self._active = True
        return result

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self._active = False
        self._lifecycle("deactivate")  # ends a running generation; what still waits is refused NOT_ACTIVE
        return super().on_deactivate(state)

    def _lifecycle(self, method: str) -> None:
        """Tell the Session (an 'activate' / 'deactivate' event) and wait for it, at a token boundary."""
        try:
            self._worker.submit(lambda s: getattr(s, method)()).result(self._settings.request_timeout_s)
        except FutureTimeout:
            self.get_logger().error(f"engine thread did not {method} in time")

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self._teardown()
        return super().on_cleanup(state)

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self._active = False
        self._teardown()
        return super().on_shutdown(state)

    def destroy_node(self):
        self._active = False
        self._teardown()
        super().destroy_node()

    def _teardown(self) -> None:
        """Stop the engine thread and drop the engine (its memory goes with the last reference)."""
        if self._ingest is not None:  # first: wakes a callback blocked by overload=block
            self._ingest.close()
            self._ingest = None
        if self._observation_sub is not None:
            self.destroy_subscription(self._observation_sub)
            self._observation_sub = None
        if self._diagnostics_timer is not None:
            self.destroy_timer(self._diagnostics_timer)
            self._diagnostics_timer = None
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def _on_set_parameters(self, parameters) -> SetParametersResult:
        """Refuse what the engine cannot take now, with the reason; hand new sampling defaults to the
        engine thread, ahead of every observation submitted after this set."""
        worker = self._worker
        try:
            sampling = check_update(self, parameters, configured=worker is not None)
        except ValueError as e:
            return SetParametersResult(successful=False, reason=str(e))
        if worker is not None:
            worker.submit(lambda s: s.set_sampling(**dataclasses.asdict(sampling)))
        return SetParametersResult(successful=True)

    # ---- engine output (runs on the engine thread) -------------------------------------------
    def _emit(self, out) -> None:
        stamp = self.get_clock().now().to_msg()
        if isinstance(out, TokenOutput):
            msg = conv.token_chunk(out, stamp)
            self._tokens_pub.publish(msg)
            feedback = self._goal_feedback.get(out.request_id)
            if feedback is not None:
                feedback.put(msg)
        elif isinstance(out, ActionOutput):
            self._action_pub.publish(conv.action_chunk(out, stamp))
        elif isinstance(out, TypedOutput):
            self._typed_publisher(out.type_name, type(out.message)).publish(out.message)
        elif isinstance(out, EventOutput):
            if not out.success:
                self._last_error = f"{out.op}: {out.message}"
            self._events_pub.publish(conv.state_event(out, stamp, self._settings.record_pixels))

    def _typed_publisher(self, type_name: str, msg_type):
        """One publisher per message type a goal's ``output_type`` asked for: a controller subscribes to the
        typed topic it consumes (the set is bounded by the message types this node can import)."""
        if type_name not in self._typed_pubs:
            self._typed_pubs[type_name] = self.create_publisher(msg_type, typed_topic(type_name), OUTPUT_DEPTH)
        return self._typed_pubs[type_name]

    # ---- requests ---------------------------------------------------------------------------
    def _call(self, fn: Callable[[Session], object], when_idle: bool = False):
        """Run ``fn(session)`` on the engine thread; return ``(result, latency_ms)`` or raise FlashRTError.

        ``latency_ms`` is the operation's own time at its token boundary (queueing excluded).
        A request that times out before it started is withdrawn, so it never runs later. Whether the
        node is active is the Session's check (its refusal is an event); here only "no engine".
        """
        worker = self._worker
        if worker is None:
            raise FlashRTError(ErrorCode.NOT_ACTIVE, "node is not configured")

        def timed(session):
            start = time.perf_counter()
            result = fn(session)
            return result, (time.perf_counter() - start) * 1e3

        future = worker.submit(timed, when_idle=when_idle)
        timeout = self._settings.request_timeout_s
        try:
            return future.result(timeout)
        except FutureTimeout:
            fate = "withdrawn" if future.cancel() else "still running and may yet complete"
            raise FlashRTError(ErrorCode.TIMEOUT, f"engine did not answer within {timeout} s; request {fate}")
        except FlashRTError:
            raise
        except Exception as e:  # noqa: BLE001
            raise FlashRTError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}") from e

    def _service(self, op: Operation):
        """The callback of ``op``'s service: request fields -> Session method -> typed result -> response."""
        method = op.method

        def handle(req, resp):
            kwargs = conv.session_kwargs(op, req)
            try:
                result, latency_ms = self._call(lambda s: getattr(s, method)(**kwargs))
            except FlashRTError as e:
                return conv.refusal(resp, e)
            return conv.response(resp, result, latency_ms)
        handle.__name__ = handle.__qualname__ = f"~/{op.interface}"  # names it in an INTERNAL answer
        return handle

    def _hold(self, req, resp):
        """Replay support (``~/hold``): see :meth:`EngineWorker.hold`."""
        if self._worker is None:
            return conv.refusal(resp, FlashRTError(ErrorCode.NOT_ACTIVE, "node is not configured"))
        if len(req.request_ids) != len(req.positions):
            return conv.refusal(resp, FlashRTError(ErrorCode.INVALID_ARGUMENT,
                                                   "request_ids and positions differ in length"))
        try:
            self._worker.hold(zip(req.request_ids, req.positions))
        except FlashRTError as e:
            return conv.refusal(resp, e)
        resp.success, resp.error_code = True, int(ErrorCode.OK)
        return resp

    # ---- observations -------------------------------------------------------------------------
    def _on_observation(self, msg: Observation, info) -> None:
        """``info`` (MessageInfo) has no default: with one, rclpy would pass the message alone and the
        sequence gaps would never be seen."""
        lost = self._loss.seen(info)
        if lost:
            self._report_loss(lost, "dropped before reaching the node: raise qos.observation.depth")
        worker, ingest = self._worker, self._ingest
        if worker is None or ingest is None:  # no engine, so no session to refuse it with an event
            self._report_loss(1, "dropped: the node is not configured")
            return
        try:
            observation = conv.observation_in(msg, self._image_limits)
        except conv.RefusedObservation as refused:  # an image it cannot read: refused with an event, as the Session does
            future = worker.submit(lambda s, r=refused: s.refuse_observation(r.observation, r.message))
        else:
            future = ingest.offer(observation)  # queued; coalesced at the next step boundary
        if future is not None:
            future.add_done_callback(self._log_refusal)

    def _observation_failed(self, error: FlashRTError, _msg, _info) -> None:
        self._report_loss(1, f"not handed to the engine: {error.message}")

    def _report_loss(self, lost: int, why: str) -> None:
        """Observations that never reached the engine: counted (``observations_lost`` on /diagnostics),
        logged, and recorded as an 'observation_lost' event (while there is an engine)."""
        self._observations_lost += lost
        self.get_logger().warning(f"{lost} observation(s) lost ({self._observations_lost} in total): {why}",
                                  throttle_duration_sec=1.0)  # the total says how many lines a flood skipped
        worker = self._worker
        if worker is not None:
            worker.submit(lambda s: s.observation_lost(lost))

    def _log_refusal(self, future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.get_logger().warning(f"observation refused: {future.exception()}")

    def _accept_goal(self, _goal) -> GoalResponse:
        with self._goals_lock:
            if self._goals_in_flight >= MAX_GOALS_IN_FLIGHT:
                self.get_logger().warning(f"goal rejected: {MAX_GOALS_IN_FLIGHT} goals already in flight")
                return GoalResponse.REJECT
            self._goals_in_flight += 1
        return GoalResponse.ACCEPT

    def _execute_goal(self, goal_handle):
        try:
            return self._run_goal(goal_handle)
        finally:
            with self._goals_lock:
                self._goals_in_flight -= 1

    def _run_goal(self, goal_handle):
        goal = goal_handle.request
        result = Generate.Result()
        try:
            kwargs = conv.session_kwargs(OPERATIONS["generate"], goal, self._image_limits)
        except conv.RefusedObservation as refused:  # an image it cannot read: refused with an event, as the Session does
            kwargs = {"observation": refused.observation}
            begin = lambda session, r=refused: session.refuse_observation(r.observation, r.message)  # noqa: E731
        else:
            begin = lambda session: session.generate(**kwargs)  # noqa: E731
        feedback: queue.SimpleQueue = queue.SimpleQueue()

        def start(session):
            if goal_handle.is_cancel_requested:  # canceled while it waited for the engine: never start it
                raise FlashRTError(ErrorCode.CANCELED, "goal canceled before it started")
            gen = begin(session)
            self._goal_feedback[gen.request_id] = feedback  # before the first step, so no chunk is missed
            return gen

        try:
            gen, _ = self._call(start, when_idle=kwargs["observation"].priority != PRIORITY_URGENT)
        except FlashRTError as e:
            if e.code == ErrorCode.CANCELED:
                conv.refusal(result, e)
                result.finish_reason = CANCELED
                goal_handle.canceled()
                return result
            return _abort(goal_handle, result, e)
        try:
            outcome = self._stream_feedback(goal_handle, gen, feedback)
        finally:
            self._goal_feedback.pop(gen.request_id, None)
        result.token_ids, result.text = outcome.token_ids, outcome.text
        result.finish_reason, result.position, result.ttft_ms = outcome.finish_reason, outcome.position, outcome.ttft_ms
        result.acceptance_rate, result.tokens_per_step = outcome.acceptance_rate, outcome.tokens_per_step
        result.success = outcome.error_code == ErrorCode.OK
        result.error_code, result.message = int(outcome.error_code), outcome.message
        if result.success:
            goal_handle.succeed()
        elif outcome.finish_reason == CANCELED and goal_handle.is_cancel_requested:
            goal_handle.canceled()
        else:
            goal_handle.abort()
        return result

    def _stream_feedback(self, goal_handle, gen, feedback: queue.SimpleQueue):
        """Relay the goal's chunks as feedback until it ends; forward a cancel request once.

        The cancel check comes first in every round: a stream whose chunks arrive faster than they
        are relayed must still see its cancel at the next token boundary, not at its end.
        """
        cancel_sent = False
        while True:
            if goal_handle.is_cancel_requested and not cancel_sent and self._worker is not None:
                self._worker.cancel(gen.request_id)
                cancel_sent = True
            try:
                chunk = feedback.get(timeout=0.02)
            except queue.Empty:
                if gen.outcome.done():  # its final chunk was queued before the outcome was set
                    return gen.outcome.result()
                continue
            goal_handle.publish_feedback(Generate.Feedback(chunk=chunk))

    # ---- diagnostics ------------------------------------------------------------------------
    def _publish_diagnostics(self) -> None:
        """Engine figures (:meth:`Engine.stats`: position, ttft_ms, decode_tokens_per_s, speculative_tokens,
        acceptance_rate, tokens_per_step, arena/capsule bytes, kernel, ...), the engine ``fingerprint`` (the bag tools read it here instead of building
        a second engine), ``active``, ``last_error`` and ``observations_lost``; published while configured."""
        worker = self._worker
        if worker is not None:
            future = worker.submit(Session.diagnostics, passive=True)
            future.add_done_callback(self._send_diagnostics)

    def _send_diagnostics(self, future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        values = {**future.result(), "active": self._active, "last_error": self._last_error,
                  "observations_lost": self._observations_lost}
        if self._ingest is not None:
            values.update(self._ingest.stats())
        status = DiagnosticStatus(
            level=DiagnosticStatus.OK if self._active else DiagnosticStatus.WARN,
            name=diagnostics_name(self.get_fully_qualified_name()), hardware_id=self._settings.engine.device,
            message="active" if self._active else "inactive",
            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()])
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diagnostics_pub.publish(msg)


def _abort(goal_handle, result, error: FlashRTError):
    conv.refusal(result, error)
    result.finish_reason = "error"
    if goal_handle.is_active:  # a goal that already ended (a failure after its end) keeps its state
        goal_handle.abort()
    return result


# What a failed callback answers (see FlashRTNode._guarded)
def _refuse_request(error: FlashRTError, _request, response):
    return conv.refusal(response, error)


def _abort_goal(error: FlashRTError, goal_handle):
    return _abort(goal_handle, Generate.Result(), error)


def _refuse_parameters(error: FlashRTError, _parameters) -> SetParametersResult:
    return SetParametersResult(successful=False, reason=error.message)


def main(args=None) -> None:
    rclpy.init(args=args)
    node = FlashRTNode()
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
