"""No exception in a callback stops the node: a failure injected into a service, the action, the observation
subscription or a parameter set is answered INTERNAL with its reason (or counted lost), and the node then still
answers other requests. (An exception used to propagate into the executor and end its spin: the node went deaf.)"""
import dataclasses

import pytest
from conftest import wait_for
from rcl_interfaces.msg import Parameter as ParameterMsg, ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from flashrt_ros import node as node_module
from flashrt_ros.action import Generate
from flashrt_ros.msg import ErrorCode, Observation, StateEvent
from flashrt_ros.srv import ListCapsules, Snapshot

EVENTS_QOS = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE,
                        durability=DurabilityPolicy.TRANSIENT_LOCAL)


class Injected(RuntimeError):
    pass


def fail_once(monkeypatch, owner, name):
    """Make ``owner.name`` raise Injected on its next call, then behave as before."""
    original = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        if not calls:
            calls.append(args)
            raise Injected(f"injected into {name}")
        return original(*args, **kwargs)
    monkeypatch.setattr(owner, name, failing)
    return calls


def still_serving(client):
    response = client.call(ListCapsules, "list_capsules")
    assert response.success and response.error_code == ErrorCode.OK


def test_a_failing_service_callback_answers_internal_and_the_node_keeps_serving(node_and_client, monkeypatch):
    node, client = node_and_client
    fail_once(monkeypatch, node_module.conv, "session_kwargs")
    response = client.call(Snapshot, "snapshot", capsule_id="never")
    assert not response.success and response.error_code == ErrorCode.INTERNAL
    assert response.message == "~/snapshot: Injected: injected into session_kwargs"
    still_serving(client)
    assert "injected into session_kwargs" in node._last_error  # also on /diagnostics as last_error


def test_a_capsule_created_beyond_2038_or_at_1e308_is_listed_not_fatal(node_and_client, monkeypatch):
    node, client = node_and_client
    assert client.call(Snapshot, "snapshot", capsule_id="odd_times").success
    engine = node.worker.submit(lambda s: s.engine).result(10)
    capsules = engine.capsules
    monkeypatch.setattr(engine, "capsules", lambda: [dataclasses.replace(c, created=1e308) for c in capsules()])
    response = client.call(ListCapsules, "list_capsules")  # raised OverflowError inside the callback
    assert response.success
    assert {c.created.sec for c in response.capsules} == {2**31 - 1}


def test_a_failing_goal_is_aborted_with_internal_and_the_node_keeps_serving(node_and_client, monkeypatch):
    node, client = node_and_client
    fail_once(monkeypatch, node_module.conv, "session_kwargs")
    goal = Generate.Goal()
    goal.observation.token_ids, goal.observation.max_new_tokens = [1], 2
    handle = client.send_goal(client.action_client(Generate, "generate"), goal, [])
    assert handle.accepted
    result = client.result(handle).result
    assert not result.success and result.error_code == ErrorCode.INTERNAL and "Injected" in result.message
    still_serving(client)


def test_a_failing_observation_callback_is_counted_lost_and_the_node_keeps_serving(node_and_client, monkeypatch):
    node, client = node_and_client
    events = client.subscribe(StateEvent, "events", EVENTS_QOS)
    publisher = client.publisher(Observation, "observation")
    wait_for(lambda: publisher.get_subscription_count() > 0, what="the observation subscription")
    wait_for(lambda: node._observation_sub.get_publisher_count() > 0, what="the node to match the publisher")
    lost_before = node._observations_lost
    fail_once(monkeypatch, node_module.conv, "observation_in")
    publisher.publish(Observation(token_ids=[1]))
    lost = wait_for(lambda: [e for e in events if e.op == "observation_lost" and e.count == 1], what="an observation_lost event")
    assert lost[-1].success and node._observations_lost == lost_before + 1
    publisher.publish(Observation(token_ids=[1]))  # the next one is applied as usual
    wait_for(lambda: any(e.op == "observe" and e.success for e in events), what="the next observation's event")
    still_serving(client)


def test_a_failing_parameter_callback_refuses_the_set_with_the_reason(node_and_client, monkeypatch):
    node, client = node_and_client
    fail_once(monkeypatch, node_module, "check_update")
    value = ParameterValue(type=ParameterType.PARAMETER_DOUBLE, double_value=0.5)
    response = client.call(SetParameters, f"{client.target}/set_parameters",
                           parameters=[ParameterMsg(name="sampling.top_p", value=value)])
    (result,) = response.results
    assert not result.successful and "Injected" in result.reason
    assert node.get_parameter("sampling.top_p").value == 1.0  # unchanged
    still_serving(client)


@pytest.fixture(autouse=True)
def _drop_capsules(node_and_client):
    yield
    node, _ = node_and_client
    node.worker.submit(lambda s: [s.engine.drop(c.id) for c in s.engine.capsules()]).result(10)
