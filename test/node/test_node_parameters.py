"""Parameters tell the truth: through the standard parameter services (what `ros2 param set` calls), a
parameter read at configure is refused with the reason while the node is configured, `autostart` is
read-only, and the sampling defaults apply to the next generation; a refused rollback reports the
live position; a Generate goal's top_p defaults to 1."""
import pytest
from conftest import wait_for
from lifecycle_msgs.msg import State, Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rclpy.parameter import Parameter
from rclpy.parameter_client import AsyncParameterClient
from std_srvs.srv import Trigger

from flashrt_ros.action import Generate
from flashrt_ros.msg import ErrorCode, Observation, TokenChunk
from flashrt_ros.params import LIVE, PARAMETERS, READ_ONLY
from flashrt_ros.runtime import SamplingParams
from flashrt_ros.srv import Rollback

CONFIGURE_TIME = [(name, default, bounds, choices) for name, default, _, bounds, choices in PARAMETERS
                  if name not in LIVE and name not in READ_ONLY]


def other_value(default, bounds, choices):
    """A value of the parameter's type, within its declared range, that differs from ``default``."""
    if isinstance(default, bool):
        return not default
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, str):
        return default + "_other"
    step = 1 if isinstance(default, int) else 0.5
    return default + step if bounds is None or default + step <= bounds[1] else default - step


@pytest.fixture(scope="module")
def params(node_and_client):
    node, client = node_and_client
    return AsyncParameterClient(client.node, node.get_fully_qualified_name())


def set_parameter(client, params, name, value):
    assert params.wait_for_services(10.0)
    (result,) = client.wait(params.set_parameters([Parameter(name, value=value)]), 10.0).results
    return result


def get_parameter(client, params, name):
    from rclpy.parameter import parameter_value_to_python
    (value,) = client.wait(params.get_parameters([name]), 10.0).values
    return parameter_value_to_python(value)


def session_sampling(node) -> SamplingParams:
    return node.worker.submit(lambda s: s.default_sampling).result(10)


@pytest.mark.parametrize("name,default,bounds,choices", CONFIGURE_TIME, ids=[c[0] for c in CONFIGURE_TIME])
def test_a_configure_time_parameter_is_refused_with_the_reason_while_configured(
        node_and_client, params, name, default, bounds, choices):
    _, client = node_and_client
    before = get_parameter(client, params, name)
    result = set_parameter(client, params, name, other_value(before, bounds, choices))
    assert not result.successful
    assert f"{name}: read at configure" in result.reason and "cleanup" in result.reason
    assert get_parameter(client, params, name) == before


def test_autostart_is_read_only(node_and_client, params):
    _, client = node_and_client
    result = set_parameter(client, params, "autostart", False)
    assert not result.successful and "read-only" in result.reason
    assert get_parameter(client, params, "autostart") is True


@pytest.mark.parametrize("name,value,reason", [
    ("sampling.top_p", 0.0, "sampling.top_p must be in (0, 1], got 0.0"),
    ("sampling.top_p", 1e-46, "sampling.top_p must be in (0, 1], got 0.0"),  # in range, but 0 in float32
    ("sampling.top_p", 1.5, "out of range"),
    ("sampling.temperature", -1.0, "out of range"),
])
def test_bad_sampling_values_are_refused_and_change_nothing(node_and_client, params, name, value, reason):
    node, client = node_and_client
    before = session_sampling(node)
    result = set_parameter(client, params, name, value)
    assert not result.successful and reason in result.reason
    assert get_parameter(client, params, name) == getattr(before, name.split(".")[1])
    assert session_sampling(node) == before


def greedy_then_sampled(client, params, text):
    """Tokens of one observation from an empty context, first at the node's greedy defaults, then after
    `sampling.temperature` was set to 5 (reset in between: same context, same sampler seed)."""
    tokens = client.subscribe(TokenChunk, "tokens")
    observations = client.publisher(Observation, "observation")
    wait_for(lambda: observations.get_subscription_count() > 0, what="the node's ~/observation")
    runs = []
    for temperature in (None, 5.0):
        if temperature is not None:
            assert set_parameter(client, params, "sampling.temperature", temperature).successful
        assert client.call(Trigger, "reset").success
        tokens.clear()
        observations.publish(Observation(text=text, max_new_tokens=12))
        final = wait_for(lambda: [c for c in tokens if c.final], 60.0, "the generation's final chunk")
        runs.append([t for c in tokens if c.request_id == final[0].request_id for t in c.token_ids])
    return runs


def test_sampling_defaults_apply_to_the_next_generation(node_and_client, params):
    node, client = node_and_client
    try:
        greedy, sampled = greedy_then_sampled(client, params, "the cup is")
        assert session_sampling(node) == SamplingParams(temperature=5.0, top_k=0, top_p=1.0)
        assert get_parameter(client, params, "sampling.temperature") == 5.0  # what a bag header records
        assert greedy != sampled
    finally:
        assert set_parameter(client, params, "sampling.temperature", 0.0).successful
    assert session_sampling(node).greedy


def test_unconfigured_the_node_takes_a_new_value_at_configure(node_and_client, params):
    node, client = node_and_client

    def change(transition_id):
        request = Transition(id=transition_id)
        assert client.call(ChangeState, "change_state", transition=request).success

    change(Transition.TRANSITION_DEACTIVATE)
    change(Transition.TRANSITION_CLEANUP)
    try:
        assert client.call(GetState, "get_state").current_state.id == State.PRIMARY_STATE_UNCONFIGURED
        assert set_parameter(client, params, "history_depth", 3).successful
    finally:
        change(Transition.TRANSITION_CONFIGURE)
        change(Transition.TRANSITION_ACTIVATE)
    assert node.worker.submit(lambda s: s.engine.config.history_depth).result(10) == 3


def test_a_refused_rollback_reports_the_live_position(node_and_client):
    node, client = node_and_client
    assert client.call(Trigger, "reset").success
    tokens = client.subscribe(TokenChunk, "tokens")
    pub = client.publisher(Observation, "observation")
    wait_for(lambda: pub.get_subscription_count() > 0, what="the node's ~/observation")
    pub.publish(Observation(text="hello there", max_new_tokens=4))
    wait_for(lambda: [c for c in tokens if c.final], 60.0, "the generation's final chunk")
    live = node.worker.submit(lambda s: s.engine.position).result(10)
    assert live > 0
    response = client.call(Rollback, "rollback", steps=60000)
    assert (response.success, response.error_code) == (False, ErrorCode.NO_HISTORY)
    assert response.position == live


def test_a_goal_leaving_top_p_out_samples_with_top_p_1(node_and_client):
    assert Generate.Goal().top_p == 1.0
    _, client = node_and_client
    action = client.action_client(Generate, "generate")
    goal = Generate.Goal(override_sampling=True, temperature=0.8)
    goal.observation.text, goal.observation.max_new_tokens = "plan", 4
    result = client.result(client.send_goal(action, goal, []), 60.0).result
    assert (result.success, result.error_code) == (True, ErrorCode.OK), result.message
    assert len(result.token_ids) > 0
