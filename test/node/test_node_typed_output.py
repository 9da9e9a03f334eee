"""A Generate goal with output_type through the real node (rclpy): the result's text is the type's JSON and the
parsed message arrives on ~/typed/<pkg>/msg/<Type>; an unknown type aborts with INVALID_ARGUMENT."""
import json

from action_msgs.msg import GoalStatus
from conftest import wait_for
from geometry_msgs.msg import Twist

from flashrt_ros.action import Generate
from flashrt_ros.msg import ErrorCode, Observation, TokenChunk


def send(client, action, **fields):
    goal = Generate.Goal(**fields)
    goal.observation.text, goal.observation.max_new_tokens = "go", 256
    handle = client.send_goal(action, goal, [])
    return client.result(handle)


def test_output_type_goal_returns_and_publishes_a_twist(node_and_client):
    _, client = node_and_client
    action = client.action_client(Generate, "generate")
    twists = client.subscribe(Twist, "typed/geometry_msgs/msg/Twist")
    answer = send(client, action, output_type="geometry_msgs/msg/Twist")
    result = answer.result
    assert answer.status == GoalStatus.STATUS_SUCCEEDED and result.finish_reason == "stop", result.message
    value = json.loads(result.text)
    wait_for(lambda: twists, timeout=20.0, what="a Twist on ~/typed/geometry_msgs/msg/Twist")
    (twist,) = twists
    assert (twist.linear.x, twist.linear.y, twist.angular.z) == (
        float(value["linear"]["x"]), float(value["linear"]["y"]), float(value["angular"]["z"]))


def test_an_unknown_output_type_aborts_with_invalid_argument(node_and_client):
    _, client = node_and_client
    action = client.action_client(Generate, "generate")
    answer = send(client, action, output_type="geometry_msgs/msg/Nope")
    assert answer.status == GoalStatus.STATUS_ABORTED
    assert answer.result.error_code == ErrorCode.INVALID_ARGUMENT and "cannot import" in answer.result.message


def test_an_observation_with_output_type_publishes_a_twist(node_and_client):
    """An Observation on ~/observation with max_new_tokens and output_type (no action): the Twist arrives on the
    typed topic, equal to the text streamed on ~/tokens."""
    _, client = node_and_client
    twists = client.subscribe(Twist, "typed/geometry_msgs/msg/Twist")
    chunks = client.subscribe(TokenChunk, "tokens")
    publisher = client.publisher(Observation, "observation")
    wait_for(lambda: publisher.get_subscription_count() > 0, what="the node's ~/observation subscription")
    publisher.publish(Observation(text="go", max_new_tokens=256, output_type="geometry_msgs/msg/Twist"))
    wait_for(lambda: twists and chunks and chunks[-1].final, timeout=60.0, what="a Twist and the final chunk")
    assert chunks[-1].finish_reason == "stop"
    value = json.loads("".join(chunk.text for chunk in chunks))
    (twist,) = twists
    assert (twist.linear.x, twist.linear.y, twist.angular.z) == (
        float(value["linear"]["x"]), float(value["linear"]["y"]), float(value["angular"]["z"]))
